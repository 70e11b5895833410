"""Low-latency allreduce over CUDA IPC for tensor-parallel verify passes, with an NCCL fallback.

Source: the one-shot / two-shot IPC allreduce pattern of vLLM's and TensorRT-LLM's custom allreduce and PyTorch's
intra-node low-latency kernels; this is our own implementation (``csrc/allreduce.cuh`` describes the memory
layout and the flag protocol).

Each rank allocates one buffer (flags + two staging slots of ``max_bytes``), exports it with
``cudaIpcGetMemHandle`` and opens every peer's through the ``torch.distributed`` group given at construction (used
only for that exchange, gloo is enough). A call launches one kernel on ``torch.cuda.current_stream()``: every
block copies its share of the input into this rank's staging slot, meets its peers through flags in the shared
memory (no host round trip), then sums (one-shot: read every peer's copy; two-shot: reduce-scatter then
all-gather). Because the kernel copies its input in, graphs need no per-input registration: any tensor can be
reduced inside a captured graph, and the graph stays valid when its inputs are overwritten in place.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import math
from typing import Optional

import numpy as np
import torch

from specverify import envvars, jit
from specverify.comm import thresholds

logger = logging.getLogger("specverify")

#: Ranks the kernels support (compile-time limit SV_MAX_RANKS in csrc/allreduce.cuh).
MAX_RANKS = 8
#: Blocks per launch limit (SV_MAX_BLOCKS) and threads per block (SV_AR_THREADS).
MAX_BLOCKS = 64
THREADS = 512
#: Byte offset of the staging slots in each rank's buffer (kDataOffset in csrc/allreduce.cuh).
DATA_OFFSET = 8192
#: Error codes of the error word (SV_ERR_* in csrc/allreduce.cuh).
ERR_TIMEOUT = 1
ERR_BAD_ARGS = 2

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_ALGOS = ("auto", "oneshot", "twoshot", "nccl")

_logged: set[str] = set()


def _log_once(msg: str) -> None:
    if msg not in _logged:
        _logged.add(msg)
        logger.warning(msg)


class AllReduceTimeoutError(RuntimeError):
    """A peer did not reach a flag barrier in time: a rank died, hung, or called collectives in another order."""


def residual_rmsnorm_reference(
    x_sum: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch definition of the fused tail: ``y = x_sum + residual`` (rounded to the dtype), RMSNorm of y.

    Parameters
    ----------
    x_sum : torch.Tensor
        Shape ``(rows, hidden)``, the allreduced activations (any float dtype; kept in fp32 if given so).
    residual : torch.Tensor
        Shape ``(rows, hidden)``, dtype D.
    weight : torch.Tensor
        Shape ``(hidden,)``.
    eps : float

    Returns
    -------
    (out, new_residual) : tuple of torch.Tensor
        Both ``(rows, hidden)`` dtype D: ``new_residual = D(x_sum + residual)`` and
        ``out = D(y * rsqrt(mean(y^2, -1) + eps) * weight)`` computed in fp32 from the rounded ``y``.
    """
    y = (x_sum.float() + residual.float()).to(residual.dtype)
    yf = y.float()
    inv = torch.rsqrt(yf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (yf * inv * weight.float()).to(residual.dtype), y


def _cupy_runtime():
    jit._cupy()
    import cupy

    return cupy, cupy.cuda.runtime


def _detect_link(bus_ids: list[str]) -> str:
    """``same_device`` when all ranks share one GPU, ``nvlink`` when NVML reports NVLink P2P between every pair of
    distinct GPUs, else ``pcie`` (also when NVML is unavailable: the conservative choice)."""
    distinct = sorted(set(bus_ids))
    if len(distinct) == 1:
        return "same_device"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handles = [pynvml.nvmlDeviceGetHandleByPciBusId(b.encode() if isinstance(b, str) else b) for b in distinct]
            for i in range(len(handles)):
                for j in range(i + 1, len(handles)):
                    status = pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                    if status != pynvml.NVML_P2P_STATUS_OK:
                        return "pcie"
            return "nvlink"
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # pynvml missing or NVML refusing: assume PCIe
        _log_once(f"specverify: could not query NVLink through NVML ({type(exc).__name__}: {exc}); assuming PCIe")
        return "pcie"


class CustomAllReduce:
    """Allreduce across the ranks of one machine through CUDA IPC, with an NCCL fallback.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup
        The tensor-parallel group. Used only to exchange IPC handles, NCCL's id and a few flags (gloo works; NCCL
        cannot run several ranks on one GPU, gloo can).
    device : int or torch.device, optional
        This rank's GPU; torch's current device by default.
    max_bytes : int
        Size of one staging slot (two are allocated); larger messages are reduced in chunks of this size.
        Must be a positive multiple of 16.
    num_blocks : int, optional
        Blocks per launch, the same on every rank and call (1..64). Default 32 (16 when ranks share one GPU).
    link : {"nvlink", "pcie", "same_device"}, optional
        Override link detection (NVML) for the algorithm table.
    nccl : bool or "auto"
        Make an NCCL communicator for messages above the thresholds: ``"auto"`` when every rank has its own GPU
        and libnccl loads; ``False`` never.
    timeout_s : float, optional
        How long a flag wait may spin before the call fails (``SPECVERIFY_ALLREDUCE_TIMEOUT_S``, default 10).

    Attributes
    ----------
    disabled : bool
        True when the custom kernels cannot run here (world size 1 or > 8, ``SPECVERIFY_ALLREDUCE=off``, CuPy
        or NVRTC missing, peers unable to map each other's memory); :attr:`disabled_reason` says why. A disabled
        communicator still reduces through NCCL when it has one.
    link : str
        The link type the table is read for.
    nccl : NcclAllReduce or None
        The fallback communicator.

    Raises
    ------
    TypeError
        ``group`` is not a process group.
    ValueError
        ``max_bytes`` / ``num_blocks`` / ``link`` out of range.

    Notes
    -----
    Construction is collective: every rank of ``group`` must build it, in the same order relative to other
    collectives. Calls are collective too: every rank must call :meth:`all_reduce` /
    :meth:`all_reduce_residual_rmsnorm` in the same order with the same shapes, and on each rank the calls must be
    ordered on the GPU (one stream, or streams joined by events: two calls of one communicator must never run at
    once on one rank, since they share its per-block epoch counters). A rank that does not arrive within
    the timeout makes the others fail with :class:`AllReduceTimeoutError` (raised by the next call or
    :meth:`check`), never hang.

    Examples
    --------
    >>> # in each of N processes, after dist.init_process_group("gloo", ...) and torch.cuda.set_device(local_rank):
    >>> # ar = CustomAllReduce(dist.group.WORLD)
    >>> # y = ar.all_reduce(x) if ar.should_use(x) else fallback(x)
    """

    def __init__(
        self,
        group,
        device=None,
        max_bytes: int = 8 * 1024 * 1024,
        num_blocks: Optional[int] = None,
        link: Optional[str] = None,
        nccl="auto",
        timeout_s: Optional[float] = None,
    ):
        import torch.distributed as dist

        if group is None:
            group = dist.group.WORLD
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
        if not isinstance(max_bytes, int) or max_bytes <= 0 or max_bytes % 16:
            raise ValueError(f"max_bytes must be a positive multiple of 16, got {max_bytes!r}")
        if num_blocks is not None and not (1 <= int(num_blocks) <= MAX_BLOCKS):
            raise ValueError(f"num_blocks must be in [1, {MAX_BLOCKS}], got {num_blocks}")
        if link is not None and link not in thresholds.LINKS:
            raise ValueError(f"link must be one of {thresholds.LINKS} or None, got {link!r}")
        if nccl not in ("auto", True, False):
            raise ValueError(f"nccl must be 'auto', True or False, got {nccl!r}")

        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if device is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else 0
        self.device = torch.device("cuda", device if isinstance(device, int) else torch.device(device).index)
        self.max_bytes = max_bytes
        self.timeout_s = float(timeout_s if timeout_s is not None else envvars.get("SPECVERIFY_ALLREDUCE_TIMEOUT_S"))
        self.mode = envvars.get("SPECVERIFY_ALLREDUCE").strip().lower()
        if self.mode not in ("auto", "off", "oneshot", "twoshot"):
            raise ValueError(
                f"SPECVERIFY_ALLREDUCE must be auto, off, oneshot or twoshot, got {self.mode!r}; fix the environment"
            )
        self.disabled = True
        self.disabled_reason = ""
        self.nccl = None
        self.link = link or "pcie"
        self._buf = 0
        self._peer_ptrs: list[int] = []
        self._host_err = 0
        self._closed = False
        self._capturing = False

        # Which GPU each rank drives decides the link and whether NCCL can run at all.
        bus_id = self._bus_id()
        bus_ids = [None] * self.world_size
        dist.all_gather_object(bus_ids, bus_id, group=group)
        self.link = link or _detect_link(bus_ids)
        self.num_blocks = int(num_blocks or (16 if self.link == "same_device" else 32))
        distinct_gpus = len(set(bus_ids)) == self.world_size

        if self.world_size == 1:
            self.disabled_reason = "world size 1: nothing to reduce"
        elif self.world_size > MAX_RANKS:
            self.disabled_reason = f"world size {self.world_size} > {MAX_RANKS} (the kernels' limit)"
        elif self.mode == "off":
            self.disabled_reason = "SPECVERIFY_ALLREDUCE=off"
        if self.world_size > 1:
            self._setup_ipc(dist)
            if nccl is True or (nccl == "auto" and distinct_gpus):
                self._setup_nccl(dist, required=nccl is True)

    # ---- construction ----------------------------------------------------------------------------------------

    def _bus_id(self) -> str:
        try:
            _, rt = _cupy_runtime()
            return rt.deviceGetPCIBusId(self.device.index).lower()
        except Exception:
            pass
        try:
            props = torch.cuda.get_device_properties(self.device)
            return f"{getattr(props, 'pci_domain_id', '')}:{getattr(props, 'pci_bus_id', '')}:" \
                   f"{getattr(props, 'pci_device_id', '')}:{getattr(props, 'uuid', self.device.index)}"
        except Exception:  # no CUDA at all (world size 1 on a CPU machine)
            return f"no-cuda-{self.device.index}"

    def _agree(self, dist, ok: bool) -> bool:
        flags = [None] * self.world_size
        dist.all_gather_object(flags, bool(ok), group=self.group)
        return all(flags)

    def _setup_ipc(self, dist) -> None:
        local_reason = self.disabled_reason
        handle = None
        if not local_reason:
            try:
                cupy, rt = _cupy_runtime()
                with cupy.cuda.Device(self.device.index):
                    for name in _DTYPES.values():  # compile / load now: never inside a graph capture
                        for kind in ("one_shot", "two_shot", "one_shot_rmsnorm"):
                            jit.get_function("allreduce", f"specverify_ar_{kind}_{name}", self.device.index)
                    size = DATA_OFFSET + 2 * self.max_bytes
                    self._buf = rt.malloc(size)
                    rt.memset(self._buf, 0, size)
                    self._host_err = rt.hostAlloc(4, 3)  # cudaHostAllocPortable | cudaHostAllocMapped
                    ctypes.c_int32.from_address(self._host_err).value = 0
                    rt.deviceSynchronize()
                    handle = bytes(rt.ipcGetMemHandle(self._buf))
            except Exception as exc:
                local_reason = f"could not set up the IPC buffer ({type(exc).__name__}: {exc})"
        # Everyone learns everyone's reason so that all ranks take the same path.
        infos = [None] * self.world_size
        dist.all_gather_object(infos, (local_reason, handle), group=self.group)
        reasons = [f"rank {r}: {why}" for r, (why, _) in enumerate(infos) if why]
        if reasons:
            self.disabled_reason = reasons[0] if local_reason == "" else local_reason
            self._free_own()
            return
        opened_ok, why = True, ""
        try:
            _, rt = _cupy_runtime()
            ptrs = []
            for r, (_, h) in enumerate(infos):
                ptrs.append(self._buf if r == self.rank else rt.ipcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess))
            self._peer_ptrs = ptrs
        except Exception as exc:
            opened_ok, why = False, f"peers cannot map each other's memory ({type(exc).__name__}: {exc})"
        if not self._agree(dist, opened_ok):
            self.disabled_reason = why or "another rank could not map its peers' memory through CUDA IPC"
            self._close_peers()
            self._free_own()
            return
        bases = [np.uint64(p) for p in self._peer_ptrs] + [np.uint64(0)] * (MAX_RANKS - self.world_size)
        self._tail_args = (
            *bases,
            np.int32(self.rank),
            np.int32(self.world_size),
            np.int64(self.max_bytes),
            np.uint64(self._host_err),
            np.int64(int(self.timeout_s * 1e9)),
        )
        self.disabled = False
        self.disabled_reason = ""
        dist.barrier(group=self.group)

    def _setup_nccl(self, dist, required: bool) -> None:
        from specverify.comm import nccl as nccl_mod

        ok, why = True, ""
        try:
            nccl_mod.load_library()
        except Exception as exc:
            ok, why = False, str(exc)
        if not self._agree(dist, ok):
            if required:
                raise RuntimeError(f"nccl=True but libnccl is unavailable on some rank: {why or 'another rank'}")
            _log_once(f"specverify: no NCCL fallback ({why or 'libnccl missing on another rank'})")
            return
        self.nccl = nccl_mod.NcclAllReduce(self.group, self.device)

    # ---- the gate ----------------------------------------------------------------------------------------------

    def _ineligible_reason(self, tensor) -> str:
        """Why the custom kernels cannot reduce ``tensor`` (empty string: they can)."""
        if self.disabled:
            return f"custom allreduce disabled: {self.disabled_reason}"
        if not isinstance(tensor, torch.Tensor):
            return f"expected a torch.Tensor, got {type(tensor).__name__}"
        if tensor.dtype not in _DTYPES:
            return f"dtype must be bfloat16, float16 or float32, got {tensor.dtype}"
        if tensor.device != self.device:
            return f"tensor must be on {self.device}, got {tensor.device}"
        if not tensor.is_contiguous():
            return "tensor must be contiguous (call .contiguous())"
        if tensor.data_ptr() % 16:
            return f"tensor's data must be 16-byte aligned, got address % 16 = {tensor.data_ptr() % 16} (clone it)"
        if tensor.numel() == 0:
            return "tensor is empty"
        return ""

    def algorithm(self, tensor: torch.Tensor) -> str:
        """``"oneshot"``, ``"twoshot"`` or ``"nccl"``: what :meth:`all_reduce` runs for ``tensor`` with ``algo="auto"``.

        ``SPECVERIFY_ALLREDUCE=oneshot|twoshot`` forces an algorithm for eligible tensors; otherwise the
        :mod:`~specverify.comm.thresholds` table decides from size, world size and link. When the table says NCCL
        but there is no NCCL communicator (ranks sharing one GPU), two-shot runs instead.
        """
        if self._ineligible_reason(tensor):
            return "nccl"
        if self.mode in ("oneshot", "twoshot"):
            return self.mode
        algo = thresholds.choose(tensor.numel() * tensor.element_size(), self.world_size, self.link)
        if algo == "nccl" and self.nccl is None:
            return "twoshot"
        return algo

    def should_use(self, tensor: torch.Tensor) -> bool:
        """Whether :meth:`all_reduce` takes the custom IPC path for ``tensor`` (size, dtype, alignment, world size,
        peer access, thresholds). Never raises; a False answer means "use NCCL"."""
        return not self._ineligible_reason(tensor) and self.algorithm(tensor) != "nccl"

    # ---- errors ------------------------------------------------------------------------------------------------

    def error_code(self) -> int:
        """The error word the kernels write (0: none). Reads pinned host memory: no sync, graph-safe."""
        if not self._host_err:
            return 0
        return ctypes.c_int32.from_address(self._host_err).value

    def check(self) -> None:
        """Raise if an earlier call failed on the GPU. Call after a synchronize to cover the calls so far (graph
        replays included).

        Raises
        ------
        AllReduceTimeoutError
            A flag wait timed out: a peer died, hung, or the ranks' calls did not match.
        RuntimeError
            The kernels rejected their arguments (a bug: please report it).
        """
        code = self.error_code()
        if code == ERR_TIMEOUT:
            raise AllReduceTimeoutError(
                f"custom allreduce on rank {self.rank}/{self.world_size}: a peer did not reach the barrier within "
                f"{self.timeout_s:g} s (SPECVERIFY_ALLREDUCE_TIMEOUT_S). A rank died or hung, or the ranks called "
                "collectives in different orders or shapes. This communicator is unusable now: close() it and "
                "build a new one."
            )
        if code:
            raise RuntimeError(f"custom allreduce kernel reported error {code} on rank {self.rank} (bad arguments)")

    # ---- calls -------------------------------------------------------------------------------------------------

    def _launch(self, kind: str, dtype: torch.dtype, args: tuple) -> None:
        fn = jit.get_function("allreduce", f"specverify_ar_{kind}_{_DTYPES[dtype]}", self.device.index)
        fn((self.num_blocks,), (THREADS,), args + self._tail_args, stream=jit.torch_stream(self.device))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("CustomAllReduce used after close(); build a new one")

    def all_reduce(self, tensor: torch.Tensor, out: Optional[torch.Tensor] = None, algo: str = "auto") -> torch.Tensor:
        """Sum ``tensor`` over the ranks (out of place) on torch's current stream.

        Parameters
        ----------
        tensor : torch.Tensor
            Any shape, bfloat16 / float16 / float32, contiguous, 16-byte aligned, on this rank's device.
        out : torch.Tensor, optional
            Same shape and dtype, contiguous, 16-byte aligned; mutated. May be ``tensor`` itself. New when None.
        algo : {"auto", "oneshot", "twoshot", "nccl"}
            ``auto`` follows :meth:`algorithm` and falls back to NCCL for tensors the kernels cannot take
            (logged once); an explicit algorithm never falls back and raises instead.

        Returns
        -------
        torch.Tensor
            ``out``: the element-wise sum over ranks, accumulated in fp32 in rank order (bit-identical on every
            rank), rounded once to the dtype.

        Raises
        ------
        TypeError
            Not a tensor, or dtype not bf16/fp16/fp32 (explicit algo, or no NCCL to fall back to).
        ValueError
            Wrong device, not contiguous, misaligned, ``out`` mismatched, unknown ``algo``.
        RuntimeError
            Custom kernels disabled and no NCCL; :class:`AllReduceTimeoutError` after an earlier timeout.

        Notes
        -----
        Graph-safe when ``out`` is given or allocated inside the capture: one kernel launch per ``max_bytes``
        chunk, no host sync, no allocation of ours. Messages larger than ``max_bytes`` are reduced chunk by chunk.
        """
        self._check_open()
        if algo not in _ALGOS:
            raise ValueError(f"algo must be one of {_ALGOS}, got {algo!r}")
        if self.world_size == 1:
            out = torch.empty_like(tensor) if out is None else out
            return out.copy_(tensor)
        reason = self._ineligible_reason(tensor)
        if algo == "auto":
            algo = self.algorithm(tensor)
            if reason:
                if self.nccl is None:
                    self._raise_for(tensor, reason)
                _log_once(f"specverify: allreduce falls back to NCCL: {reason}")
        elif algo != "nccl" and reason:
            self._raise_for(tensor, reason)
        if algo == "nccl":
            if self.nccl is None:
                raise RuntimeError(
                    "algo='nccl' but this CustomAllReduce has no NCCL communicator (ranks share a GPU, libnccl "
                    "missing, or nccl=False); use algo='auto'"
                )
            return self.nccl.all_reduce(tensor, out=out)
        out = self._check_out(tensor, out)
        self.check()
        es = tensor.element_size()
        chunk = self.max_bytes // es
        n = tensor.numel()
        kind = "one_shot" if algo == "oneshot" else "two_shot"
        inp_ptr, out_ptr = tensor.data_ptr(), out.data_ptr()
        for start in range(0, n, chunk):
            count = min(chunk, n - start)
            self._launch(
                kind, tensor.dtype, (np.uint64(inp_ptr + start * es), np.uint64(out_ptr + start * es), np.int64(count))
            )
        return out

    def _raise_for(self, tensor, reason: str):
        if self.disabled:
            raise RuntimeError(f"{reason}, and there is no NCCL communicator to fall back to")
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _DTYPES:
            raise TypeError(f"custom allreduce: {reason}")
        raise ValueError(f"custom allreduce: {reason}")

    def _check_out(self, tensor: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
        if out is None:
            return torch.empty_like(tensor, memory_format=torch.contiguous_format)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != tensor.dtype:
            raise TypeError(f"out must have dtype {tensor.dtype}, got {out.dtype}")
        if out.shape != tensor.shape or out.device != tensor.device or not out.is_contiguous() or out.data_ptr() % 16:
            raise ValueError(
                f"out must be a contiguous, 16-byte aligned tensor of shape {tuple(tensor.shape)} on {tensor.device}, "
                f"got shape {tuple(out.shape)} on {out.device}, contiguous={out.is_contiguous()}, "
                f"address % 16 = {out.data_ptr() % 16}"
            )
        return out

    def all_reduce_residual_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float = 1e-6,
        out: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Allreduce ``x``, add ``residual`` and RMSNorm, in one kernel: ``residual`` is updated in place.

        Parameters
        ----------
        x : torch.Tensor
            Shape ``(..., hidden)``, this rank's partial activations; bf16/fp16/fp32, contiguous, 16-byte aligned.
        residual : torch.Tensor
            Same shape and dtype; mutated to ``x_sum + residual`` (rounded to the dtype).
        weight : torch.Tensor
            Shape ``(hidden,)``, same dtype.
        eps : float
        out : torch.Tensor, optional
            Same shape and dtype as ``x``; mutated. New when None.

        Returns
        -------
        (out, residual) : tuple of torch.Tensor
            ``out = RMSNorm(residual_new) * weight``; see :func:`residual_rmsnorm_reference` for the exact
            rounding. The kernel sums the ranks in fp32 before adding the residual (one rounding); the composed
            fallback rounds the allreduce first, which can differ in the last bit.

        Raises
        ------
        TypeError
            dtypes differ or are not bf16/fp16/fp32.
        ValueError
            Shapes mismatch, ``hidden * element_size`` not a multiple of 16, non-contiguous or misaligned inputs.

        Notes
        -----
        One-shot only (the fused tail needs whole rows on every rank). When the custom kernels are disabled or the
        message is beyond the one-shot table, it runs :meth:`all_reduce` then the reference tail in torch.
        Graph-safe under the same conditions as :meth:`all_reduce`.
        """
        self._check_open()
        for name, t in (("x", x), ("residual", residual), ("weight", weight)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in _DTYPES:
                raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")
        if residual.dtype != x.dtype or weight.dtype != x.dtype:
            raise TypeError(
                f"x, residual and weight must share one dtype, got {x.dtype}, {residual.dtype}, {weight.dtype}"
            )
        if x.dim() < 1 or residual.shape != x.shape or weight.shape != (x.shape[-1],):
            raise ValueError(
                f"expected x and residual of shape (..., hidden) and weight of shape (hidden,), got x "
                f"{tuple(x.shape)}, residual {tuple(residual.shape)}, weight {tuple(weight.shape)}"
            )
        if not (x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()):
            raise ValueError("x, residual and weight must be contiguous; call .contiguous() on them")
        hidden = x.shape[-1]
        es = x.element_size()
        rows = x.numel() // hidden if hidden else 0
        if out is None:
            out = torch.empty_like(x)
        else:
            out = self._check_out(x, out)
        kernel_ok = (
            not self._ineligible_reason(x)
            and (hidden * es) % 16 == 0
            and residual.data_ptr() % 16 == 0
            and weight.data_ptr() % 16 == 0
            and residual.device == x.device
            and weight.device == x.device
            and hidden * es <= self.max_bytes
            and rows > 0
            and (self.mode == "oneshot" or self.algorithm(x) == "oneshot" or self.nccl is None)
        )
        if not kernel_ok:
            if self.world_size > 1 and (hidden * es) % 16 and not self.disabled:
                _log_once(f"specverify: fused allreduce+RMSNorm needs hidden*element_size % 16 == 0, got {hidden}*{es}")
            x_sum = self.all_reduce(x)
            o, y = residual_rmsnorm_reference(x_sum, residual, weight, eps)
            residual.copy_(y)
            out.copy_(o)
            return out, residual
        self.check()
        rows_per_chunk = self.max_bytes // (hidden * es)
        xp, rp, op, wp = x.data_ptr(), residual.data_ptr(), out.data_ptr(), weight.data_ptr()
        row_bytes = hidden * es
        for start in range(0, rows, rows_per_chunk):
            count = min(rows_per_chunk, rows - start)
            off = start * row_bytes
            self._launch(
                "one_shot_rmsnorm",
                x.dtype,
                (
                    np.uint64(xp + off), np.uint64(op + off), np.uint64(rp + off), np.uint64(wp),
                    np.int64(count), np.int64(hidden), np.float32(eps),
                ),
            )
        return out, residual

    @contextlib.contextmanager
    def capture(self):
        """Context for capturing CUDA graphs that contain these allreduces.

        The kernels copy their inputs into this communicator's IPC buffers themselves, so no input buffer needs
        registering when the capture ends: a captured graph reduces whatever its input tensors hold at replay. The
        context checks the communicator is healthy on entry and marks the capture (so callers written for
        register-at-capture-end allreduces work unchanged). Every rank must capture and replay the same graphs in
        the same order.
        """
        self._check_open()
        self.check()
        self._capturing = True
        try:
            yield self
        finally:
            self._capturing = False

    # ---- teardown ----------------------------------------------------------------------------------------------

    def _close_peers(self) -> None:
        if not self._peer_ptrs:
            return
        try:
            _, rt = _cupy_runtime()
            for r, p in enumerate(self._peer_ptrs):
                if r != self.rank and p:
                    with contextlib.suppress(Exception):
                        rt.ipcCloseMemHandle(p)
        finally:
            self._peer_ptrs = []

    def _free_own(self) -> None:
        if not (self._buf or self._host_err):
            return
        _, rt = _cupy_runtime()
        if self._buf:
            with contextlib.suppress(Exception):
                rt.free(self._buf)
            self._buf = 0
        if self._host_err:
            with contextlib.suppress(Exception):
                rt.freeHost(self._host_err)
            self._host_err = 0

    def close(self, barrier: bool = True) -> None:
        """Release the IPC mappings, buffers and the NCCL communicator (idempotent).

        Collective when ``barrier`` (the default): waits until every rank stopped using the buffers before
        freeing them. Pass ``barrier=False`` after a timeout, when a peer may be gone.
        """
        if self._closed:
            return
        self._closed = True
        if self.world_size > 1 and not self.disabled:
            torch.cuda.synchronize(self.device)
            if barrier:
                import torch.distributed as dist

                dist.barrier(group=self.group)
        self._close_peers()
        self._free_own()
        if self.nccl is not None:
            self.nccl.close()
            self.nccl = None
        self.disabled = True
        self.disabled_reason = "closed"

    def __repr__(self) -> str:
        state = f"disabled ({self.disabled_reason})" if self.disabled else f"link={self.link}"
        return (
            f"CustomAllReduce(rank={self.rank}, world_size={self.world_size}, {state}, "
            f"max_bytes={self.max_bytes}, nccl={'yes' if self.nccl is not None else 'no'})"
        )


def slot_bytes_needed(nbytes: int) -> int:
    """Smallest valid ``max_bytes`` holding a message of ``nbytes`` in one chunk (rounded up to 16)."""
    return max(16, int(math.ceil(nbytes / 16)) * 16)
