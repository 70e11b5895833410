"""L2 prefetch of the next projections' weights beside the verify pass's latency-bound kernels (issue 22).

At a few tokens a layer's attention chain (q_a norm, q_b, MLA preparation, attention, split merge, V up-projection)
runs ~15-20 us on one H200 but moves only ~10 MB: HBM idles while o_proj, the router and the shared expert wait
with ~30 MB of weights that do not depend on anything. :func:`prefetch_l2` asks L2 for those bytes from a small
grid; the verify forward launches it on a side stream forked after qkv_a (``VerifyModel._prefetch``), so the
weights stream in while the chain runs and the projections read them from L2. See :mod:`specverify.kernels.prefetch`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specverify.fit import sm_count

#: ``mode``: ``line`` (``prefetch.global.L2`` per 128-byte line) or ``bulk`` (``cp.async.bulk.prefetch.L2`` of
#: ``bulk_bytes`` a lane, sm_90+); ``programs``: the grid (one program of ``num_warps`` warps an SM at most);
#: ``l2_fraction``: the default budget, this share of the device's L2.
_CONFIG = {"mode": "line", "programs": 32, "num_warps": 4, "bulk_bytes": 4096, "l2_fraction": 0.6}
_MODES = {"count": 0, "line": 1, "bulk": 2}
_MAX_REGIONS = 4


def l2_bytes(device: torch.device) -> int:
    """L2 cache size of CUDA ``device`` in bytes (50 MiB on an H100 / H200)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(index).L2_cache_size)


def plan_regions(tensors: Sequence[torch.Tensor], max_bytes: int, align: int = 1) -> list[tuple[torch.Tensor, int]]:
    """(uint8 view, bytes) of each tensor's bytes, in order, cut so the total stays within ``max_bytes``; with
    ``align`` > 1 each region starts and ends on multiples of ``align`` bytes (the edges left out). Empty regions
    are dropped."""
    out, left = [], int(max_bytes)
    for t in tensors:
        if left <= 0:
            break
        flat = t.reshape(-1).view(torch.uint8)
        start = (-t.data_ptr()) % align
        end = min(flat.numel(), start + left)
        end -= (t.data_ptr() + end) % align
        if end - start > 0:
            out.append((flat[start:end], end - start))
            left -= end - start
    return out


def _check(tensors, max_bytes, programs):
    op = "prefetch_l2"
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{op}: tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: tensors[{i}] must be a tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: tensors[{i}] must be contiguous (a strided view would prefetch bytes it does "
                             f"not own), got shape {list(t.shape)} strides {list(t.stride())}; pass the weight "
                             "itself or a contiguous slice of it")
        if t.device != tensors[0].device:
            raise ValueError(f"{op}: every tensor must be on {tensors[0].device}, got {t.device} at {i}")
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"{op}: max_bytes must be an int >= 0 or None (a share of L2), got {max_bytes!r}")
    if programs is not None and (not isinstance(programs, int) or programs < 1):
        raise ValueError(f"{op}: programs must be an int >= 1 or None (the default grid), got {programs!r}")


def prefetch_l2(tensors: Sequence[torch.Tensor], *, max_bytes: int | None = None, programs: int | None = None,
                mode: str | None = None) -> int:
    """Ask the device's L2 for the bytes of ``tensors`` (constant data: weights), in order, up to ``max_bytes``.

    Source: software prefetch ahead of a dependent kernel, as in the L2-prefetch of low-latency decode paths
    (TensorRT-LLM's PDL prologues; the "megakernel" weight streaming of Hazy Research, 2025) moved onto a side
    stream so that it overlaps kernels that do not read HBM.

    Parameters
    ----------
    tensors : sequence of Tensor
        Contiguous tensors of one CUDA device, any dtype; the first is requested first.
    max_bytes : int, optional
        Bytes to request at most (a tensor past the budget is cut). Default: 60% of the device's L2.
    programs : int, optional
        Programs of the grid (default 32: a few SMs' worth, so the kernels beside it keep theirs).
    mode : {"line", "bulk"}, optional
        ``prefetch.global.L2`` per 128-byte line or ``cp.async.bulk.prefetch.L2`` chunks (default: ``line``).

    Returns
    -------
    int
        Bytes requested (0 off CUDA, where there is nothing to prefetch into, and for an empty list).

    Raises
    ------
    TypeError
        ``tensors`` not a sequence of tensors.
    ValueError
        A strided tensor, tensors on several devices, a negative ``max_bytes``, ``programs`` < 1, an unknown mode.

    Notes
    -----
    One launch per four tensors, no output, nothing read back: CUDA-graph capturable, and safe on any stream since
    a prefetch never faults and changes no data. The result is a hint: lines may be evicted before they are read.
    """
    _check(tensors, max_bytes, programs)
    mode = mode or _CONFIG["mode"]
    if mode not in ("line", "bulk"):
        raise ValueError(f"prefetch_l2: mode must be 'line' or 'bulk', got {mode!r}")
    if not tensors or not tensors[0].is_cuda:
        return 0
    if max_bytes is None:
        max_bytes = int(l2_bytes(tensors[0].device) * _CONFIG["l2_fraction"])
    regions = plan_regions(tensors, max_bytes, align=16 if mode == "bulk" else 1)
    return _launch(regions, mode, programs or _CONFIG["programs"], _unit(mode))


def _unit(mode: str) -> int:
    return _CONFIG["bulk_bytes"] if mode == "bulk" else 128


def _launch(regions, mode: str, programs: int, unit: int, counts: torch.Tensor | None = None) -> int:
    """Prefetch (or, with ``mode="count"``, count into ``counts`` int32 [4, max_units]) ``regions`` from
    :func:`plan_regions`, four a launch. Returns the bytes covered."""
    from specverify.kernels.prefetch import _prefetch_l2_kernel

    if not regions:
        return 0
    warps = _CONFIG["num_warps"]
    block = 32 * warps
    sms = sm_count(regions[0][0].device.type, regions[0][0].device.index)
    grid = (max(1, min(programs, sms)),)
    for i in range(0, len(regions), _MAX_REGIONS):
        group = list(regions[i:i + _MAX_REGIONS])
        group += [(group[0][0], 0)] * (_MAX_REGIONS - len(group))
        args = [a for view, n in group for a in (view, n)]
        if counts is None:
            counts_arg, max_units = group[0][0], 0
        else:
            counts_arg, max_units = counts, counts.shape[1]
        _prefetch_l2_kernel[grid](*args, counts_arg, max_units, UNIT=unit, BLOCK=block, MODE=_MODES[mode],
                                  num_warps=warps)
    return sum(n for _, n in regions)


def coverage(tensors: Sequence[torch.Tensor], *, max_bytes: int, programs: int, mode: str = "line") -> torch.Tensor:
    """What :func:`prefetch_l2` would request, counted instead of prefetched (the same grid and slices; the CPU
    interpreter can run it): int32 [4, max_units] with ``[r, u]`` the bytes of unit ``u`` of region ``r`` (128-byte
    lines, or ``bulk_bytes`` chunks in ``bulk`` mode), each unit counted by the program that owns it."""
    _check(tensors, max_bytes, programs)
    regions = plan_regions(tensors, max_bytes, align=16 if mode == "bulk" else 1)
    unit = _unit(mode)
    units = max([-(-n // unit) for _, n in regions], default=1)
    counts = torch.zeros(_MAX_REGIONS * max(1, -(-len(regions) // _MAX_REGIONS)), units, dtype=torch.int32,
                         device=tensors[0].device if tensors else "cpu")
    for i in range(0, len(regions), _MAX_REGIONS):
        _launch(regions[i:i + _MAX_REGIONS], "count", programs, unit, counts[i:i + _MAX_REGIONS])
    return counts
