"""Reference of :mod:`specverify.gemv`: ``x @ w.T`` in fp32 (fp64 stays fp64), rounded once to x's dtype."""
from __future__ import annotations

import torch


def gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ctype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(ctype) @ w.to(ctype).t()).to(x.dtype)
