"""Launch configs that fit the device: compile a candidate, read its shared memory, keep the first that fits.

A tile that is right on one GPU can be too big on another (sm_90 gives a block up to 227 KiB of shared memory,
sm_120 about 99 KiB) or for a larger shape on the same GPU (more rows per program, more pipeline stages). Triton
only reports that at launch (``OutOfResources``). :func:`first_fitting` asks first: it compiles each candidate
through ``kernel.warmup`` (no launch, the compiled kernel is cached for the real launch), compares the compiled
kernel's shared memory with the device's per-block limit, and remembers the choice per key, so the check costs
one compile per (kernel, shape class, device) and nothing afterwards. Host only; call it outside CUDA-graph
capture or let the first eager call make the choice (compiling during capture also works: it launches nothing).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence

import torch
from triton.runtime.errors import OutOfResources

from specverify import envvars

__all__ = ["first_fitting", "launch_fitting", "pdl_kwargs", "pdl_launch", "persistent_grid",
           "shared_memory_limit_bytes", "sm_count", "spill_bytes"]

_CHOSEN: dict[tuple, dict] = {}


@functools.cache
def _limit(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    if optin:
        return int(optin)
    from triton.runtime import driver  # older torch: ask Triton's driver, which reads the same attribute

    return int(driver.active.utils.get_device_properties(device_index)["max_shared_mem"])


@functools.lru_cache(maxsize=None)
def sm_count(device_type: str, index: int | None) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (None: the current one), for grids sized to the GPU; 4 off
    CUDA (the CPU interpreter: keep grids tiny)."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()
                                                ).multi_processor_count
    return 4


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_launch(device: torch.device) -> bool:
    """Whether the verify pass's kernels launch as programmatic dependents (PDL) on ``device``: CUDA sm_90+ and
    ``SPECVERIFY_PDL`` on. Such a kernel is given ``PDL=True`` and ``launch_pdl=True``: it may start while the
    previous kernel of the stream finishes, prefetches only constant data (weights) and calls ``gdc_wait`` before
    it reads or writes anything else, so every kernel of the chain waits for all before it. A kernel whose
    successor reads earlier kernels' data before its own wait (the experts' down kernel reads the routing's ids)
    calls ``gdc_launch_dependents`` only after its ``gdc_wait``. Captured in a CUDA graph as programmatic edges.
    Off the GPU (the interpreter) always False."""
    if device.type != "cuda" or not envvars.get_flag("SPECVERIFY_PDL"):
        return False
    return _capability_major(_index(device)) >= 9


def pdl_kwargs(device: torch.device) -> dict:
    """Launch keywords of a kernel that takes a ``PDL`` constexpr: ``PDL`` and ``launch_pdl`` when
    :func:`pdl_launch` says so, else ``PDL=False``."""
    return {"PDL": True, "launch_pdl": True} if pdl_launch(device) else {"PDL": False}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def shared_memory_limit_bytes(device: torch.device | str | int) -> int:
    """The most shared memory one block may use on ``device`` (opt-in limit, bytes): 232448 on an H100/H200,
    101376 on sm_120 (RTX PRO 6000, RTX 5090)."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"shared_memory_limit_bytes needs a CUDA device, got {device}")
    return _limit(_index(device))


def spill_bytes(compiled) -> int:
    """Spill stores per thread of a compiled kernel (``n_spills``, read once its module is loaded on the device; no
    launch; 0 where Triton does not report it)."""
    init = getattr(compiled, "_init_handles", None)
    if init is not None:
        init()
    return int(getattr(compiled, "n_spills", 0) or 0)


def first_fitting(kernel, grid, args: Sequence, candidates: Sequence[dict], *, device: torch.device,
                  key: Hashable, what: str, avoid_spills: bool = False) -> dict:
    """The first of ``candidates`` (launch keyword arguments, best first) whose compiled kernel fits the shared
    memory of ``device``.

    Parameters
    ----------
    kernel : triton.JITFunction
    grid : tuple of int
        Any grid of the launch (compilation does not depend on it).
    args : sequence
        The launch's positional arguments (tensors and scalars of the real call: their dtypes, alignment and
        integer specialisation select the compiled variant).
    candidates : sequence of dict
        Constexprs and ``num_warps`` / ``num_stages``, best first.
    device : torch.device
        CUDA device of the launch. On the CPU (the interpreter) the first candidate is returned unchecked.
    key : hashable
        What determines the choice besides the device (the shape class); the choice is cached under it.
    what : str
        The op, for the error message.
    avoid_spills : bool
        Also skip candidates whose compiled kernel spills registers (the first fitting one is still taken when every
        fitting candidate spills): a tile that spills on one Triton release and not on another is then chosen by
        what this Triton compiles, not by a version.

    Raises
    ------
    ValueError
        No candidate fits (the message lists each candidate's shared memory and the limit).
    """
    if device.type != "cuda" or envvars.triton_interpret():
        return dict(candidates[0])
    index = _index(device)
    cache_key = (what, key, index)
    hit = _CHOSEN.get(cache_key)
    if hit is not None:
        return hit
    limit = _limit(index)
    seen, fitting = [], None
    for cand in candidates:
        compiled = kernel.warmup(*args, grid=grid, **cand)
        shared = int(getattr(getattr(compiled, "metadata", None), "shared", 0) or 0)
        if shared <= limit:
            if not avoid_spills or spill_bytes(compiled) == 0:
                _CHOSEN[cache_key] = dict(cand)
                return _CHOSEN[cache_key]
            fitting = fitting or dict(cand)
        seen.append(f"{cand}: {shared} B")
    if fitting is not None:
        _CHOSEN[cache_key] = fitting
        return fitting
    raise ValueError(f"{what}: no launch config fits the {limit} B of shared memory a block may use on "
                     f"{_device_name(index)} ({'; '.join(seen)}); report this shape")


def _device_name(index: int) -> str:
    try:
        return torch.cuda.get_device_name(index)
    except Exception:  # noqa: BLE001 - only for the message
        return f"cuda:{index}"


def launch_fitting(kernel, grid, args: Sequence, kwargs: dict, *, what: str, spill_fallback: dict | None = None):
    """``kernel[grid](*args, **kwargs)`` with the pipeline depth lowered where the compiled kernel would not fit
    the device's shared memory (``num_stages`` from the asked value down to 1; tiles and results are unchanged,
    only how many loads are in flight). ``spill_fallback`` (e.g. ``{"num_warps": 8}``): launch keywords tried at
    each depth when the asked ones compile to a kernel that spills registers. The choice is cached per kernel,
    constexprs and tensor dtypes (:func:`first_fitting`). Raises ValueError naming ``what`` when even one stage
    does not fit."""
    dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if dev is None or dev.type != "cuda" or envvars.triton_interpret():
        return kernel[grid](*args, **kwargs)
    key = (getattr(kernel, "__name__", None) or repr(kernel), tuple(sorted(kwargs.items())),
           tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
    stages = int(kwargs.get("num_stages", 3))
    cands = []
    for s in range(stages, 0, -1):
        cands.append(dict(kwargs, num_stages=s))
        if spill_fallback:
            cands.append(dict(kwargs, **spill_fallback, num_stages=s))
    cfg = first_fitting(kernel, grid, args, cands, device=dev, key=key, what=what,
                        avoid_spills=bool(spill_fallback))
    return kernel[grid](*args, **cfg)


@functools.lru_cache(maxsize=None)
def _sm_resources(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    regs = int(getattr(props, "regs_per_multiprocessor", 65536) or 65536)
    smem = int(getattr(props, "shared_memory_per_multiprocessor", 0) or 0)
    return regs, smem


def persistent_grid(kernel, args: Sequence, consts: dict, device: torch.device, sms: int, key: Hashable,
                    candidates: Sequence, plan: Callable[[int, object], dict], chosen: dict, what: str) -> dict:
    """Launch keywords of a persistent kernel whose programs must all be resident at once (grid barriers): the
    first of ``candidates`` (best first) at 2, then 1 program an SM whose compiled kernel lets every program be
    resident (registers and shared memory) and does not spill (a resident but spilling one only when none is
    spill-free). ``sms``: the device's SM count (:func:`sm_count`).

    ``plan(nprog, candidate)`` returns the candidate's launch keywords for a grid of ``nprog`` programs (``NPROG``,
    ``num_warps`` and the tiles); ``consts`` the keywords common to all. The choice is cached in ``chosen`` under
    ``(key, device index)``. On the CPU (the interpreter) the first candidate at one program an SM. Host only:
    compiles (no launch) on a cache miss, so make the first call eagerly, outside CUDA-graph capture.

    Raises
    ------
    RuntimeError
        No candidate lets the grid be resident (the message lists each one's registers and shared memory).
    """
    if device.type != "cuda" or envvars.triton_interpret():
        return plan(sms, candidates[0])
    index = _index(device)
    hit = chosen.get((key, index))
    if hit is not None:
        return plan(*hit)
    regs_sm, smem_sm = _sm_resources(index)
    seen, spilling = [], None
    for cand in candidates:
        for per_sm in (2, 1):
            cfg = plan(sms * per_sm, cand)
            compiled = kernel.warmup(*args, grid=(sms * per_sm,), **dict(consts, **cfg))
            try:
                spills = spill_bytes(compiled)  # loads the module: more shared memory than a block may have raises
            except OutOfResources as exc:
                seen.append(f"{cand} x{per_sm}: {exc}")
                continue
            n_regs = int(getattr(compiled, "n_regs", 0) or 0)
            shared = int(getattr(getattr(compiled, "metadata", None), "shared", 0) or 0)
            fits = (per_sm * n_regs * 32 * cfg["num_warps"] <= regs_sm
                    and (smem_sm == 0 or per_sm * (shared + 1024) <= smem_sm))
            if fits and not spills:
                chosen[(key, index)] = (sms * per_sm, cand)
                return cfg
            if fits and spilling is None:
                spilling = (sms * per_sm, cand)
            seen.append(f"{cand} x{per_sm}: {n_regs} registers, {shared} B, {spills} B spilled")
    if spilling is not None:
        chosen[(key, index)] = spilling
        return plan(*spilling)
    raise RuntimeError(f"{what}: no launch config lets the persistent grid be resident ({'; '.join(seen)}); "
                       "report this shape")
