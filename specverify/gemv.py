"""Skinny GEMM for the verify pass's projections (``x @ w.T`` at M <= 16 rows): see :mod:`specverify.kernels.gemv`.

Graph capturable (no host sync; allocates only the output unless ``out`` is given). ``impl="reference"`` runs
:func:`specverify.reference.gemv.gemv_reference`; ``auto`` uses Triton on CUDA tensors (or under
``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import functools

import torch

from specverify.fused_ops import _use_triton, triton_next_pow2

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
#: Largest M the kernel serves (rows held in registers); callers use torch.matmul above it.
MAX_M = 16


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def gemv_config(m: int, n: int, k: int, sms: int) -> dict:
    """Tiles for ``m`` rows: ``BLOCK_N`` (weight rows a program) so the grid covers every SM about twice,
    ``BLOCK_K`` so that ``BLOCK_M * BLOCK_N * BLOCK_K`` fp32 products fit the registers of ``num_warps`` warps."""
    bm = max(1, triton_next_pow2(m))
    bn = 64
    while bn > 1 and -(-n // bn) < 2 * sms:
        bn //= 2
    bk = 512
    while bk > 32 and bm * bn * bk > 16384:
        bk //= 2
    warps = 4 if bn * bk >= 2048 else 2
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}


def gemv(x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """``x @ w.T`` for skinny ``x``.

    Parameters
    ----------
    x : Tensor [M, K], M in [1, 16], unit stride on K; bf16 / fp16 / fp32.
    w : Tensor [N, K] (a Linear weight), unit stride on K, x's dtype.
    out : Tensor [M, N] of x's dtype, or None (allocated).

    Returns ``out`` [M, N] in x's dtype (fp32 accumulation, one rounding).

    Raises
    ------
    TypeError
        Non-float or mismatched dtypes.
    ValueError
        Shapes that disagree, M outside [1, 16] (use ``torch.matmul``), a strided K dimension.
    """
    from specverify.reference.gemv import gemv_reference

    op = "gemv"
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT or t.dim() != 2:
            raise TypeError(f"{op}: {name} must be a 2-d bf16/fp16/fp32 tensor, got {t.dtype} {list(t.shape)}")
    if w.dtype != x.dtype:
        raise TypeError(f"{op}: w must have x's dtype {x.dtype}, got {w.dtype}")
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"{op}: w must be [N, K = {k}] (x is [{m}, {k}]), got {list(w.shape)}")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"{op}: x must have 1..{MAX_M} rows, got {m}; use torch.matmul for wider inputs")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{op}: x and w need a unit stride on K; pass .contiguous() tensors")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"{op}: out must be {x.dtype} [{m}, {n}] with unit stride, got {out.dtype} "
                         f"{list(out.shape)}")
    if not _use_triton(impl, x, w):
        out.copy_(gemv_reference(x, w))
        return out
    from specverify.kernels.gemv import _gemv_kernel

    sms = _sm_count(x.device.index or 0) if x.is_cuda else 132
    cfg = gemv_config(m, n, k, sms)
    grid = (-(-n // cfg["BLOCK_N"]),)
    _gemv_kernel[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=cfg["BLOCK_M"],
                       BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"])
    return out
