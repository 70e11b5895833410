"""Fused small ops of the verify forward (RMSNorm with residual, MLA/GQA KV preparation, SiLU-and-multiply).

Each replaces a string of tiny torch kernels with one Triton launch: at verify sizes their cost is the launch.
All are CUDA-graph capturable (no host sync, no allocation besides the returned tensors) and validate shapes and
dtypes only (no value checks). ``impl="reference"`` runs the torch composition in
:mod:`specverify.reference.fused_ops`; ``auto`` uses Triton on CUDA tensors (or under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import logging
import math

import torch

from specverify import envvars

log = logging.getLogger("specverify")
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


def _use_triton(impl: str, *tensors) -> bool:
    if impl not in ("auto", "triton", "reference"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'reference', got {impl!r}")
    if impl == "reference":
        return False
    runnable = all(t.is_cuda for t in tensors) or envvars.triton_interpret()
    if impl == "triton":
        if not runnable:
            raise ValueError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter); "
                             "use impl='auto' to fall back to the reference")
        return True
    return runnable and not envvars.get_flag("SPECVERIFY_DISABLE_TRITON") and tensors[0].dtype != torch.float64


def _check(op, name, t, dim):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT:
        raise TypeError(f"{op}: {name} must be bfloat16, float16 or float32, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{op}: {name} must have {dim} dims, got shape {list(t.shape)}")


def rmsnorm(x, weight, eps: float, residual=None, *, impl: str = "auto"):
    """RMSNorm over the last dimension, optionally after adding a residual.

    Parameters
    ----------
    x : Tensor [..., N], bf16/fp16/fp32
    weight : Tensor [N]
    eps : float
    residual : Tensor like x, optional
        When given, ``s = x + residual`` (rounded to x's dtype) is normalised and returned as well.

    Returns
    -------
    y, or (y, s) when ``residual`` is given; new tensors of x's shape and dtype.

    Raises
    ------
    ValueError
        ``weight`` not of shape [N], an unknown ``impl``, or ``impl="triton"`` on CPU tensors without
        ``TRITON_INTERPRET=1``.

    Notes
    -----
    One launch; CUDA-graph capturable. Source: RMSNorm (Zhang & Sennrich, 2019), fused with the residual add
    the way serving engines fuse it after the tensor-parallel allreduce.

    Examples
    --------
    >>> import torch
    >>> x = torch.ones(2, 4)
    >>> rmsnorm(x, torch.full((4,), 2.0), 1e-6, impl="reference").round(decimals=3)
    tensor([[2., 2., 2., 2.],
            [2., 2., 2., 2.]])
    """
    from specverify.reference import fused_ops as ref

    if not _use_triton(impl, x):
        return ref.rmsnorm_reference(x, weight, eps) if residual is None else ref.add_rmsnorm_reference(
            x, residual, weight, eps)
    from specverify.kernels.fused_ops import _rmsnorm_kernel

    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rmsnorm: weight must have shape [{n}], got {list(weight.shape)}")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = triton_next_pow2(n)
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    if residual is None:
        _rmsnorm_kernel[(x2.shape[0],)](x2, x2, weight, y, y, x2.stride(0), x2.stride(0), y.stride(0), y.stride(0),
                                        n, eps, HAS_RES=False, BLOCK=block, num_warps=warps)
        return y.view(x.shape)
    r2 = residual.reshape(-1, n)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    s = torch.empty_like(y)
    _rmsnorm_kernel[(x2.shape[0],)](x2, r2, weight, y, s, x2.stride(0), r2.stride(0), y.stride(0), s.stride(0), n,
                                    eps, HAS_RES=True, BLOCK=block, num_warps=warps)
    return y.view(x.shape), s.view(x.shape)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def mla_kv_prep(q, kv, positions, norm_weight, cache, page_table, prefix_lens, *, eps: float, theta: float,
                nope_dim: int, impl: str = "auto"):
    """Absorbed-MLA KV preparation in one launch: RMSNorm of the latent, RoPE of the rope key, both written into
    the paged cache at ``prefix_lens[b] + i``, and RoPE of every head's query rope part in place.

    Parameters
    ----------
    q : Tensor [batch, k, heads, nope_dim + rope_dim]; the last ``rope_dim`` entries are rotated in place.
    kv : Tensor [batch, k, kv_lora_rank + rope_dim]: the kv_a projection output.
    positions : int Tensor [batch, k]: RoPE positions (prefix_len + depth).
    norm_weight : Tensor [kv_lora_rank]
    cache : Tensor [num_pages, page_size, kv_lora_rank + rope_dim]
    page_table : int32 [batch, max_pages]; prefix_lens : int32 [batch]

    Returns ``q`` (mutated). Graph-capturable; page ids are not range-checked here (see the verify API).
    """
    from specverify.reference import fused_ops as ref

    if not _use_triton(impl, q, kv, cache):
        return ref.mla_kv_prep_reference(q, kv, positions, norm_weight, cache, page_table, prefix_lens, eps, theta,
                                         nope_dim)
    from specverify.kernels.fused_ops import _mla_kv_prep_kernel

    b, k, heads, qd = q.shape
    r = norm_weight.shape[0]
    dr = kv.shape[-1] - r
    if q.stride(-1) != 1 or kv.stride(-1) != 1 or not cache.is_contiguous():
        raise ValueError("mla_kv_prep: q, kv need a unit last stride and the cache must be contiguous")
    kv2 = kv.reshape(b * k, kv.shape[-1])
    pos = positions.reshape(-1)
    _mla_kv_prep_kernel[(b * k,)](
        kv2, norm_weight, q, pos, page_table, prefix_lens, cache,
        kv2.stride(0), q.stride(1), q.stride(2), page_table.stride(0), cache.stride(0), cache.stride(1),
        k, cache.shape[1], heads, eps, math.log2(theta),
        R=r, DR=dr, NOPE=nope_dim, BLOCK_R=triton_next_pow2(r), BLOCK_H=triton_next_pow2(heads), num_warps=4)
    return q


def gqa_prep(q, k, v, positions, q_norm, k_norm, k_cache, v_cache, page_table, prefix_lens, *, eps: float,
             theta: float, impl: str = "auto"):
    """GQA preparation in one launch: optional per-head RMSNorm of q and k, RoPE of q (in place) and k, and k, v
    written into their paged caches at ``prefix_lens[b] + i``.

    q [batch, k, hq, d] (mutated), k and v [batch, k, hkv, d]; caches [num_pages, page_size, hkv, d].
    Returns ``q``. Graph-capturable.
    """
    from specverify.reference import fused_ops as ref

    if not _use_triton(impl, q, k_cache):
        return ref.gqa_prep_reference(q, k, v, positions, q_norm, k_norm, k_cache, v_cache, page_table,
                                      prefix_lens, eps, theta)
    from specverify.kernels.fused_ops import _gqa_prep_kernel

    b, kk, hq, d = q.shape
    hkv = k.shape[2]
    t = b * kk
    q3, k3, v3 = q.view(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
    qn = q_norm if q_norm is not None else q3
    kn = k_norm if k_norm is not None else q3
    _gqa_prep_kernel[(t, hq + hkv)](
        q3, k3, v3, qn, kn, positions.reshape(-1), page_table, prefix_lens, k_cache, v_cache,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1), page_table.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), kk, k_cache.shape[1], hq, eps, math.log2(theta), D=d, QK_NORM=q_norm is not None,
        num_warps=1)
    return q


def silu_mul(gate_up, *, impl: str = "auto"):
    """``silu(gate) * up`` for gate_up [T, 2I] (gate first); returns [T, I] in the input dtype."""
    from specverify.reference import fused_ops as ref

    if not _use_triton(impl, gate_up):
        return ref.silu_mul_reference(gate_up)
    from specverify.kernels.fused_ops import _silu_mul_kernel

    t, two_i = gate_up.shape
    inter = two_i // 2
    act = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton_next_pow2(inter))
    _silu_mul_kernel[(t, triton_cdiv(inter, block))](gate_up, act, gate_up.stride(0), act.stride(0), inter,
                                                     BLOCK=block, num_warps=4)
    return act


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
