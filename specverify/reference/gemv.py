"""Reference of :mod:`specverify.gemv`: ``x @ w.T`` in fp32 (fp64 stays fp64), rounded once to x's dtype."""
from __future__ import annotations

import torch


def gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ctype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(ctype) @ w.to(ctype).t()).to(x.dtype)


def rmsnorm_gemv_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
                           residual: torch.Tensor | None = None):
    """``(rmsnorm(s) @ w.T, s)`` with ``s = x + residual`` rounded to x's dtype (``s = x`` without a residual): the
    unfused composition :func:`specverify.gemv.rmsnorm_gemv` computes in one launch."""
    from specverify.reference.fused_ops import rmsnorm_reference

    s = x if residual is None else x + residual
    return gemv_reference(rmsnorm_reference(s, norm_weight, eps), w), s
