"""Compile specverify's CUDA sources (``csrc/``) at first use through NVRTC, with a versioned on-disk cache.

One entry point per module: :func:`load_module` compiles ``specverify/csrc/<name>.cu`` with NVRTC (through CuPy,
``pip install 'specverify-kernels[cu13]'`` or ``[cu12]``) into a cubin, stores it under
``<SPECVERIFY_CACHE_DIR>/jit/<specverify version>/<arch>-nvrtc<major>.<minor>/<name>-<source hash>.cubin`` while
holding a file lock (so concurrent processes, for example the ranks of one machine, compile once), and loads it
as a ``cupy.RawModule``. The result is cached in the process with :func:`functools.cache`.

``specverify build`` calls :func:`build_all` (compile ahead of time); ``specverify clear-cache`` calls
:func:`clear_cache`.

Kernels are launched by the callers (for example :mod:`specverify.comm.custom_allreduce`) with
``func(grid, block, args, stream=stream)`` where ``stream`` wraps torch's current stream
(:func:`torch_stream`), so launches are ordered with torch's work and are captured by torch's CUDA graphs.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from specverify import __version__, envvars

logger = logging.getLogger("specverify")

#: Modules under csrc/: name -> (entry source, headers it includes). The hash of all of them keys the cache.
MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "allreduce": ("allreduce.cu", ("allreduce.cuh",)),
}

#: The architecture compiled for when no GPU is visible (``specverify build`` on a CPU machine): the H200's.
DEFAULT_ARCH = "sm_90"

_LOCK_TIMEOUT_S = 600.0


class JitUnavailableError(RuntimeError):
    """CUDA sources cannot be compiled or loaded here (no CuPy, no NVRTC, no GPU)."""


def csrc_dir() -> Path:
    """The folder holding the installed CUDA sources (package data ``specverify.csrc``)."""
    import specverify.csrc as csrc_pkg

    return Path(os.path.dirname(os.path.abspath(csrc_pkg.__file__)))


def _cupy():
    try:
        import cupy  # noqa: F401
        from cupy.cuda import nvrtc  # noqa: F401
    except Exception as exc:  # ImportError, or CuPy failing to find its CUDA libraries
        raise JitUnavailableError(
            "specverify compiles its CUDA sources with NVRTC through CuPy, which could not be imported "
            f"({type(exc).__name__}: {exc}); install it with `pip install 'specverify-kernels[cu13]'` "
            "(CUDA 13) or `[cu12]` (CUDA 12), matching your PyTorch build's CUDA."
        ) from exc
    return cupy


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor) version as CuPy loads it.

    Raises
    ------
    JitUnavailableError
        When CuPy or its NVRTC library is missing.
    """
    _cupy()
    from cupy.cuda import nvrtc

    try:
        major, minor = nvrtc.getVersion()
    except Exception as exc:
        raise JitUnavailableError(
            f"CuPy is installed but NVRTC could not be loaded ({type(exc).__name__}: {exc}); install the NVRTC "
            "wheel matching CuPy (`pip install nvidia-cuda-nvrtc` for CUDA 13, `nvidia-cuda-nvrtc-cu12` for 12)."
        ) from exc
    return int(major), int(minor)


def device_arch(device: int | None = None) -> str:
    """``sm_XY`` of CUDA device ``device`` (torch's current device when None), or :data:`DEFAULT_ARCH` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return DEFAULT_ARCH
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _check_name(name: str) -> tuple[str, tuple[str, ...]]:
    if name not in MODULES:
        raise ValueError(f"unknown CUDA module {name!r}: expected one of {sorted(MODULES)}")
    return MODULES[name]


def source_hash(name: str) -> str:
    """First 16 hex digits of the SHA-256 of module ``name``'s sources (entry file and headers)."""
    entry, headers = _check_name(name)
    h = hashlib.sha256()
    for fname in (entry, *headers):
        h.update(fname.encode())
        h.update((csrc_dir() / fname).read_bytes())
    return h.hexdigest()[:16]


def jit_root() -> Path:
    """Where compiled modules live: ``<SPECVERIFY_CACHE_DIR>/jit`` (removed whole by :func:`clear_cache`)."""
    return envvars.cache_dir() / "jit"


def cache_path(name: str, arch: str, nvrtc: tuple[int, int]) -> Path:
    """The cubin file of module ``name`` for ``arch`` built by NVRTC ``nvrtc``: keyed by version, arch, CUDA, source."""
    return jit_root() / __version__ / f"{arch}-nvrtc{nvrtc[0]}.{nvrtc[1]}" / f"{name}-{source_hash(name)}.cubin"


def compile_options(arch: str) -> tuple[str, ...]:
    """NVRTC options for ``arch`` (``sm_XY``): one target, C++17, the csrc folder on the include path."""
    if not (arch.startswith("sm_") and arch[3:].rstrip("a").isdigit()):
        raise ValueError(f"arch must look like 'sm_90' (or 'sm_90a'), got {arch!r}")
    return (f"-arch={arch}", "-std=c++17", f"-I{csrc_dir()}")


def compile_source(name: str, arch: str) -> bytes:
    """Compile module ``name`` for ``arch`` with NVRTC and return the cubin (no cache).

    Raises
    ------
    JitUnavailableError
        CuPy or NVRTC missing.
    RuntimeError
        NVRTC rejected the source; the message holds NVRTC's log.
    """
    entry, _ = _check_name(name)
    options = compile_options(arch)
    _cupy()
    from cupy.cuda import nvrtc

    nvrtc_version()  # a clear error when the library is missing
    source = (csrc_dir() / entry).read_text()
    prog = nvrtc.createProgram(source, entry, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except Exception as exc:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(
                f"NVRTC failed to compile csrc/{entry} for {arch} with options {list(options)}: {exc}\n{log}"
            ) from exc
        get_cubin = getattr(nvrtc, "getCUBIN", None)
        if get_cubin is None:
            raise JitUnavailableError(
                "this CuPy has no nvrtc.getCUBIN; specverify needs CuPy >= 13 (`pip install -U cupy-cuda13x`)."
            )
        cubin = get_cubin(prog)
    finally:
        nvrtc.destroyProgram(prog)
    if not cubin:
        raise RuntimeError(f"NVRTC produced an empty cubin for csrc/{entry} ({arch}); check the NVRTC version")
    return bytes(cubin)


def build(name: str, arch: str | None = None) -> Path:
    """The cached cubin of module ``name`` for ``arch`` (the current device's when None), compiling it if missing.

    Safe with several processes at once: the compile runs under a file lock and the file appears atomically.
    """
    import filelock

    arch = arch or device_arch()
    path = cache_path(name, arch, nvrtc_version())
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(path) + ".lock", timeout=_LOCK_TIMEOUT_S):
        if path.exists():  # another process compiled it while we waited
            return path
        logger.info("specverify: compiling csrc/%s for %s into %s", MODULES[name][0], arch, path)
        cubin = compile_source(name, arch)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)
    return path


@functools.cache
def load_module(name: str, arch: str | None = None):
    """Module ``name`` compiled (or taken from the disk cache) and loaded as a ``cupy.RawModule``.

    Parameters
    ----------
    name : str
        A key of :data:`MODULES`, e.g. ``"allreduce"``.
    arch : str, optional
        ``sm_XY``; the current CUDA device's by default.

    Raises
    ------
    JitUnavailableError
        CuPy/NVRTC missing.
    RuntimeError
        Compilation failed (NVRTC's log is in the message).
    """
    cupy = _cupy()
    return cupy.RawModule(path=str(build(name, arch or device_arch())))


@functools.cache
def get_function(name: str, func: str, device: int):
    """Kernel ``func`` of module ``name`` on CUDA device ``device``, as a ``cupy.cuda.Function``.

    Launch with ``f((grid,), (block,), args, stream=torch_stream())``; pass pointers as ``numpy.uint64``,
    ``int64`` sizes as ``numpy.int64``, ``int`` as ``numpy.int32`` and ``float`` as ``numpy.float32``.
    """
    cupy = _cupy()
    with cupy.cuda.Device(device):
        kernel = load_module(name, device_arch(device)).get_function(func)
        return kernel.kernel  # the loaded cupy.cuda.Function for this device


_STREAMS: dict[int, object] = {}


def torch_stream(device=None):
    """torch's current CUDA stream wrapped for CuPy launches (cached per stream handle)."""
    import torch

    ptr = torch.cuda.current_stream(device).cuda_stream
    stream = _STREAMS.get(ptr)
    if stream is None:
        cupy = _cupy()
        stream = cupy.cuda.ExternalStream(ptr)
        _STREAMS[ptr] = stream
    return stream


def build_all(arch: str | None = None) -> list[Path]:
    """Compile every module under csrc/ into the disk cache (``specverify build``); returns the cubin paths.

    Parameters
    ----------
    arch : str, optional
        ``sm_XY``; the current GPU's, or :data:`DEFAULT_ARCH` (``sm_90``) when no GPU is visible.

    Raises
    ------
    JitUnavailableError
        CuPy/NVRTC missing (the message says what to install).
    """
    arch = arch or device_arch()
    return [build(name, arch) for name in MODULES]


def clear_cache() -> int:
    """Delete every compiled module (``specverify clear-cache``) and forget loaded ones; returns files removed."""
    root = jit_root()
    removed = 0
    if root.exists():
        removed = sum(1 for p in root.rglob("*") if p.is_file())
        shutil.rmtree(root, ignore_errors=True)
    load_module.cache_clear()
    get_function.cache_clear()
    return removed
