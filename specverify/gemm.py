"""Small-M linear layers for the verify pass (``y = x @ w^T`` with a few tokens): :func:`skinny_linear`.

At verify sizes a projection is a matrix-vector product whose time is reading the weight; the launcher picks the
column tile and a reduction split so that about two waves of programs stream the weight rows. Opt-in: the
``specverify`` provider uses it only where a benchmark showed it faster than cuBLAS (``bench/bench_gemm.py``).
"""
from __future__ import annotations

import functools

import torch

from specverify import envvars

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
#: Largest M (rows of x) the kernel is meant for; larger M is still correct but cuBLAS is the better choice.
MAX_M = 64


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _plan(m: int, n: int, k: int, device: torch.device, config: dict | None):
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps): about two waves of programs, each reading >= 32 KiB of weight."""
    if config:
        return (config.get("BLOCK_N", 16), config.get("BLOCK_K", 256), config.get("SPLIT_K", 1),
                config.get("num_warps", 4))
    if device.type != "cuda":
        return 16, 32, (2 if k >= 64 else 1), 4  # interpreter: small tiles, split path exercised
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    block_n = 16 if n <= 16 * 2 * sms else 32 if n <= 32 * 4 * sms else 64
    block_k = 256 if k >= 256 else max(32, 1 << (k - 1).bit_length())
    programs = -(-n // block_n)
    split = 1
    while programs * split < 2 * sms and k // (split * 2) >= max(block_k, 1024):
        split *= 2
    return block_n, block_k, split, 4


def skinny_linear(x, w, *, out=None, config: dict | None = None, impl: str = "auto"):
    """``x @ w.T`` for a few rows of x, streaming ``w`` once with enough programs to use the HBM bandwidth.

    Parameters
    ----------
    x : Tensor [..., K], bf16/fp16/fp32; unit last stride
    w : Tensor [N, K], x's dtype; unit last stride (torch ``Linear`` layout)
    out : Tensor [..., N], optional; contiguous, x's dtype; written and returned
    config : dict, optional
        Benchmarks only: ``BLOCK_N``, ``BLOCK_K``, ``SPLIT_K``, ``num_warps``.
    impl : "auto" | "triton" | "reference"
        ``reference`` is ``torch.matmul``; ``auto`` runs Triton on CUDA tensors (or under TRITON_INTERPRET=1).

    Returns
    -------
    Tensor [..., N] in x's dtype (fp32 accumulation; deterministic: a split reduction is summed in fixed order).

    Raises
    ------
    TypeError, ValueError
        Dtypes, shapes or strides that do not fit.

    Notes
    -----
    CUDA-graph capturable (the split partials are allocated per call from torch's allocator, which graph capture
    serves from the graph's pool). Two launches when the reduction is split, else one.
    """
    if impl not in ("auto", "triton", "reference"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'reference', got {impl!r}")
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"skinny_linear: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT:
            raise TypeError(f"skinny_linear: {name} must be bfloat16, float16 or float32, got {t.dtype}")
    if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[1] or w.dtype != x.dtype:
        raise ValueError(f"skinny_linear: need x [..., K] and w [N, K] of one dtype, got x {list(x.shape)} "
                         f"{x.dtype}, w {list(w.shape)} {w.dtype}")
    n, k = w.shape
    lead = x.shape[:-1]
    if out is not None and (tuple(out.shape) != (*lead, n) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"skinny_linear: out must be a contiguous {[*lead, n]} {x.dtype} tensor, got "
                         f"{list(out.shape)} {out.dtype}; pass out=None to allocate")
    runnable = (x.is_cuda and w.is_cuda) or envvars.triton_interpret()
    if impl == "reference" or (impl == "auto" and (not runnable or envvars.get_flag("SPECVERIFY_DISABLE_TRITON"))):
        y = x @ w.t()
        return y if out is None else out.copy_(y)
    if not runnable:
        raise ValueError("skinny_linear: impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1); use impl='auto'")
    from specverify.kernels.skinny_gemm import _skinny_gemm_kernel, _skinny_gemm_reduce_kernel

    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    m = x2.shape[0]
    y = out if out is not None else torch.empty(*lead, n, dtype=x.dtype, device=x.device)
    y2 = y.view(m, n)
    if m == 0:
        return y
    block_n, block_k, split, warps = _plan(m, n, k, x.device, config)
    k_per = -(-k // split)
    k_per = -(-k_per // block_k) * block_k
    split = -(-k // k_per)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y2
    upcast = envvars.triton_interpret() or x.dtype == torch.float32
    _skinny_gemm_kernel[(-(-n // block_n), split)](
        x2, w, y2, part, m, n, k, k_per, x2.stride(0), w.stride(0), y2.stride(0), SPLIT_K=split, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=(k % k_per == 0 and k_per % block_k == 0), UPCAST=upcast,
        num_warps=warps)
    if split > 1:
        block = 1024
        _skinny_gemm_reduce_kernel[(-(-(m * n) // block),)](part, y2, m, n, y2.stride(0), SPLIT_K=split,
                                                              BLOCK=block, num_warps=4)
    return y
