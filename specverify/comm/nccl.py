"""A thin NCCL allreduce on torch's current stream, for messages above the custom thresholds.

Binds ``libnccl.so.2`` through ctypes: the copy in the ``nvidia-nccl-cu13`` / ``nvidia-nccl-cu12`` wheel (a
dependency of CUDA builds of PyTorch, and of our ``cu12``/``cu13`` extras) when it is installed, else the system's.
The communicator is made from a ``torch.distributed`` group that is used only to broadcast NCCL's unique id (gloo
is enough). Calls go on ``torch.cuda.current_stream()`` and are captured by CUDA graphs (NCCL >= 2.9).

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so this runs only with one GPU per rank.

NCCL settings for PCIe machines (set in the environment before the communicator is made)
------------------------------------------------------------------------------------------
- ``NCCL_PROTO=LL,LL128`` (or ``LL`` alone for messages under ~64 KiB): the low-latency protocols; ``Simple``
  only pays for large messages.
- ``NCCL_ALGO=Ring``: on PCIe, tree gives no gain for 2-8 ranks under one switch.
- ``NCCL_P2P_LEVEL=SYS`` when the GPUs sit under different PCIe root complexes and peer-to-peer works there
  (check with ``nvidia-smi topo -m``); otherwise NCCL goes through host memory.
- ``NCCL_MAX_NCHANNELS`` small (2-4) for latency-bound allreduces of a few KiB.
On NVLink machines the defaults are right; keep ``NCCL_NVLS_ENABLE=0`` where NVLink multicast must stay off.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import os

import torch

logger = logging.getLogger("specverify")

# ncclDataType_t and ncclRedOp_t values from nccl.h (stable since NCCL 2.0; bf16 since 2.10).
_NCCL_DTYPES = {torch.float16: 6, torch.float32: 7, torch.bfloat16: 9}
_NCCL_SUM = 0


class NcclUnavailableError(RuntimeError):
    """libnccl could not be found or loaded."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def _candidate_paths() -> list[str]:
    paths = []
    try:
        import nvidia.nccl as nccl_pkg  # the nvidia-nccl-cu12/cu13 wheel

        for root in list(getattr(nccl_pkg, "__path__", [])):
            paths += sorted(glob.glob(os.path.join(root, "lib", "libnccl.so*")))
    except Exception:
        pass
    found = ctypes.util.find_library("nccl")
    if found:
        paths.append(found)
    paths.append("libnccl.so.2")
    return paths


_LIB = None


def load_library():
    """The loaded libnccl (ctypes.CDLL), searched in the NCCL wheel first, then the system.

    Raises
    ------
    NcclUnavailableError
        No loadable libnccl; install ``nvidia-nccl-cu13`` (or ``-cu12``).
    """
    global _LIB
    if _LIB is not None:
        return _LIB
    errors = []
    for path in _candidate_paths():
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId, ctypes.c_int]
        lib.ncclAllReduce.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_void_p,
        ]
        lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
        _LIB = lib
        return lib
    raise NcclUnavailableError(
        "could not load libnccl (tried: " + "; ".join(errors) + "); install `nvidia-nccl-cu13` (CUDA 13) or "
        "`nvidia-nccl-cu12` (CUDA 12)"
    )


def _check(lib, status: int, what: str) -> None:
    if status != 0:
        msg = lib.ncclGetErrorString(status).decode(errors="replace")
        raise RuntimeError(f"{what} failed with NCCL error {status}: {msg}")


def nccl_version() -> int:
    """NCCL's version code (e.g. 22703 for 2.27.3)."""
    lib = load_library()
    v = ctypes.c_int()
    _check(lib, lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
    return v.value


class NcclAllReduce:
    """An NCCL communicator over the ranks of ``group``, with an allreduce on torch's current stream.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup
        Used once, to broadcast NCCL's unique id from the group's first rank (gloo or NCCL backend).
    device : int or torch.device
        This rank's CUDA device; every rank needs its own GPU.

    Raises
    ------
    NcclUnavailableError
        libnccl missing.
    RuntimeError
        ``ncclCommInitRank`` failed (for example two ranks on one GPU).

    Notes
    -----
    Graph-safe: :meth:`all_reduce` only enqueues work on the current stream and allocates its output with torch's
    allocator (use ``out=`` to keep addresses fixed inside a captured graph).
    """

    def __init__(self, group, device):
        import torch.distributed as dist

        lib = load_library()
        self.device = torch.device("cuda", torch.device(device).index if not isinstance(device, int) else device)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        uid = _UniqueId()
        if self.rank == 0:
            _check(lib, lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        payload = [bytes(uid.internal) if self.rank == 0 else None]
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
        ctypes.memmove(ctypes.addressof(uid), payload[0], 128)
        comm = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            _check(lib, lib.ncclCommInitRank(ctypes.byref(comm), self.world_size, uid, self.rank), "ncclCommInitRank")
        self._comm = comm
        self._lib = lib

    def all_reduce(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum ``tensor`` over the ranks into ``out`` (new when None) on torch's current stream.

        Raises
        ------
        TypeError
            dtype not in bf16/fp16/fp32.
        ValueError
            tensor not contiguous or not on this communicator's device, or ``out`` of another shape/dtype.
        """
        if self._comm is None:
            raise RuntimeError("NcclAllReduce.all_reduce called after close(); make a new communicator")
        if tensor.dtype not in _NCCL_DTYPES:
            raise TypeError(f"NCCL allreduce supports bfloat16, float16, float32, got {tensor.dtype}")
        if tensor.device != self.device or not tensor.is_contiguous():
            raise ValueError(
                f"NCCL allreduce needs a contiguous tensor on {self.device}, got device {tensor.device}, "
                f"contiguous={tensor.is_contiguous()}; pass tensor.contiguous().to({str(self.device)!r})"
            )
        if out is None:
            out = torch.empty_like(tensor)
        elif out.shape != tensor.shape or out.dtype != tensor.dtype or not out.is_contiguous():
            raise ValueError(
                f"out must be contiguous {tensor.dtype} {tuple(tensor.shape)}, got {out.dtype} {tuple(out.shape)}"
            )
        stream = torch.cuda.current_stream(self.device).cuda_stream
        _check(
            self._lib,
            self._lib.ncclAllReduce(
                tensor.data_ptr(), out.data_ptr(), tensor.numel(), _NCCL_DTYPES[tensor.dtype], _NCCL_SUM,
                self._comm, stream,
            ),
            "ncclAllReduce",
        )
        return out

    def close(self) -> None:
        """Destroy the communicator (idempotent)."""
        if getattr(self, "_comm", None) is not None:
            self._lib.ncclCommDestroy(self._comm)
            self._comm = None

    def __del__(self):  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass
