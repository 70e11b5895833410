"""Fused small ops of the verify forward (RMSNorm with residual, MLA/GQA KV preparation, SiLU-and-multiply, the
per-head projections of absorbed MLA).

Each replaces a string of tiny torch kernels with one Triton launch: at verify sizes their cost is the launch.
All are CUDA-graph capturable (no host sync, no allocation besides the returned tensors) and validate shapes and
dtypes only (no value checks). On sm_90+ each launches as a programmatic dependent
(:func:`specverify.fit.pdl_launch`). ``impl="reference"`` runs the torch composition in
:mod:`specverify.reference.fused_ops`; ``auto`` uses Triton on CUDA tensors (or under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import logging
import math

import torch

from specverify import envvars
from specverify.fit import first_fitting, pdl_kwargs

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
                                        n, eps, HAS_RES=False, BLOCK=block, num_warps=warps, **pdl_kwargs(x.device))
        return y.view(x.shape)
    r2 = residual.reshape(-1, n)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    s = torch.empty_like(y)
    _rmsnorm_kernel[(x2.shape[0],)](x2, r2, weight, y, s, x2.stride(0), r2.stride(0), y.stride(0), s.stride(0), n,
                                    eps, HAS_RES=True, BLOCK=block, num_warps=warps, **pdl_kwargs(x.device))
    return y.view(x.shape), s.view(x.shape)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _check_cos_sin(op, cos_sin, dr):
    """A rotary table of the MLA preparation: None or float [max_position, rope_dim]."""
    if cos_sin is not None and (cos_sin.dim() != 2 or cos_sin.shape[1] != dr or not cos_sin.is_floating_point()):
        raise ValueError(f"{op}: cos_sin must be a float table [max_position, rope_dim = {dr}], got "
                         f"{cos_sin.dtype} {list(cos_sin.shape)}")


def mla_kv_prep(q, kv, positions, norm_weight, cache, page_table, prefix_lens, *, eps: float, theta: float,
                nope_dim: int, cos_sin=None, interleaved: bool = False, impl: str = "auto"):
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
    theta : float
        RoPE base, used when ``cos_sin`` is None.
    cos_sin : float Tensor [max_position, rope_dim] or None
        A model's rotary table (cos of the rope_dim / 2 frequencies, then their sin), read at ``positions``
        instead of angles from ``theta``: the YaRN tables of DeepSeek-V3 / Kimi-K2 as SGLang's rotary embedding
        holds them (``cos_sin_cache``). Positions must lie in ``[0, max_position)`` (not checked here).
    interleaved : bool
        Rotate the pairs (2j, 2j + 1) (GPT-J layout, DeepSeek's checkpoints) instead of (j, j + rope_dim / 2).

    Returns ``q`` (mutated). Graph-capturable; page ids are not range-checked here (see the verify API).

    Raises
    ------
    ValueError
        A strided q / kv last dim, a non-contiguous cache, or a ``cos_sin`` table whose width is not rope_dim.
    """
    from specverify.reference import fused_ops as ref

    r = norm_weight.shape[0]
    dr = kv.shape[-1] - r
    _check_cos_sin("mla_kv_prep", cos_sin, dr)
    if not _use_triton(impl, q, kv, cache):
        return ref.mla_kv_prep_reference(q, kv, positions, norm_weight, cache, page_table, prefix_lens, eps, theta,
                                         nope_dim, cos_sin=cos_sin, interleaved=interleaved)
    from specverify.kernels.fused_ops import _mla_kv_prep_kernel

    b, k, heads, qd = q.shape
    if q.stride(-1) != 1 or kv.stride(-1) != 1 or not cache.is_contiguous():
        raise ValueError("mla_kv_prep: q, kv need a unit last stride and the cache must be contiguous")
    kv2 = kv.reshape(b * k, kv.shape[-1])
    pos = positions.reshape(-1)
    table = kv2 if cos_sin is None else cos_sin
    _mla_kv_prep_kernel[(b * k,)](
        kv2, norm_weight, q, pos, page_table, prefix_lens, cache, table,
        kv2.stride(0), q.stride(1), q.stride(2), page_table.stride(0), cache.stride(0), cache.stride(1),
        table.stride(0), k, cache.shape[1], heads, eps, math.log2(theta),
        R=r, DR=dr, NOPE=nope_dim, BLOCK_R=triton_next_pow2(r), BLOCK_H=triton_next_pow2(heads),
        TABLE=cos_sin is not None, INTERLEAVED=bool(interleaved), num_warps=4, **pdl_kwargs(q.device))
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
        num_warps=1, **pdl_kwargs(q.device))
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
                                                     BLOCK=block, num_warps=4, **pdl_kwargs(gate_up.device))
    return act


def _head_matmul(op, a, w, out, t, heads, prep=None):
    """OUT[t, h, :] = A[t, h, :KDIM] @ W[h] through ``_head_matmul_kernel`` (A and OUT given as [T, H, *] views).

    ``prep``: ``(args, constexprs)`` of the MLA preparation of the same tokens, run by ``t`` more programs of the
    same grid (``_mla_prep_absorb_kernel``; A is then the query, whose rope columns those programs rotate)."""
    from specverify.kernels.fused_ops import _head_matmul_kernel, _mla_prep_absorb_kernel

    kernel = _head_matmul_kernel if prep is None else _mla_prep_absorb_kernel
    kdim, ndim = w.shape[1], w.shape[2]
    if kdim & (kdim - 1) or ndim % 16 or kdim < 16:
        raise ValueError(f"{op}: the per-head matrix must be [H, K, N] with K a power of two >= 16 and N a "
                         f"multiple of 16, got {list(w.shape)}")
    if w.stride(-1) != 1:
        w = w.contiguous()
    block_n = 64 if ndim % 64 == 0 else 32 if ndim % 32 == 0 else 16
    # more, narrower column tiles where the heads alone give few programs (the weights are what is read)
    while block_n > 16 and heads * (ndim // block_n) < 64 and ndim % (block_n // 2) == 0:
        block_n //= 2
    block_t = 16 if t <= 16 else 32 if t <= 32 else 64
    upcast = envvars.triton_interpret() or a.dtype == torch.float32
    args = (a, w, out, t, a.stride(0), a.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1))
    grid = (heads, ndim // block_n)
    extra = {}
    if prep is not None:
        args, extra = args + prep[0], prep[1]
        grid = (heads * (ndim // block_n) + t,)
    # the weight tile stays in shared memory and the row tiles are pipelined: at kv_lora_rank 512 and 64 rows
    # (DeepSeek-V3 batch 4 x k 16) Triton's default 3 stages need 228 KiB, over the H200's 227; fewer stages, then
    # fewer rows per tile, until it fits the device
    cands = [{"BLOCK_T": bt, "num_stages": st} for bt in (block_t, 32, 16) if bt <= block_t for st in (3, 2, 1)]
    pdl = pdl_kwargs(a.device)
    cfg = first_fitting(kernel, grid, args, [dict(c, KDIM=kdim, NDIM=ndim, BLOCK_N=block_n, UPCAST=upcast,
                                                  PDL=pdl["PDL"], num_warps=4, **extra) for c in cands],
                        device=a.device, key=(kdim, ndim, block_n, block_t, a.dtype, upcast, pdl["PDL"],
                                              tuple(sorted(extra.items()))), what=op)
    kernel[grid](*args, **cfg, **({"launch_pdl": True} if pdl["PDL"] else {}))
    return out


def _check_out(op, out, shape, like):
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: out must be a tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device \
            or not out.is_contiguous():
        raise ValueError(f"{op}: out must be a contiguous {list(shape)} {like.dtype} tensor on {like.device}, got "
                         f"{list(out.shape)} {out.dtype} on {out.device} (contiguous: {out.is_contiguous()}); pass "
                         f"out=None to allocate")
    return out


def _check_absorb(op, q, w_uk, nope_dim):
    """q [b, k, h, d] and w_uk [h, nope_dim, R] of the query absorption; returns q's shape."""
    _check(op, "q", q, 4)
    _check(op, "w_uk", w_uk, 3)
    b, k, h, d = q.shape
    if w_uk.shape[0] != h or w_uk.shape[1] != nope_dim or not 0 < nope_dim <= d or w_uk.dtype != q.dtype:
        raise ValueError(f"{op}: w_uk must be [{h}, {nope_dim}, R] in {q.dtype} for q {list(q.shape)}, got "
                         f"{list(w_uk.shape)} {w_uk.dtype}")
    return b, k, h, d


def mla_absorb_q(q, w_uk, nope_dim: int, *, out=None, impl: str = "auto"):
    """The query of absorbed MLA in the latent space: ``q_latent[b, k, h] = q[b, k, h, :nope_dim] @ w_uk[h]``.

    Parameters
    ----------
    q : Tensor [batch, k, heads, nope_dim + rope_dim], bf16/fp16/fp32
        Query after q_b; any strides with a unit last stride (the rope part is not read).
    w_uk : Tensor [heads, nope_dim, kv_lora_rank], q's dtype
        The key half of kv_b, per head (DeepSeek-V3's weight absorption).
    nope_dim : int
        qk_nope_head_dim (a power of two, 128 for DeepSeek-V3 / Kimi-K2).
    out : Tensor [batch, k, heads, kv_lora_rank], optional
        Contiguous, q's dtype; written and returned (a graph keeps its address).

    Returns
    -------
    Tensor [batch, k, heads, kv_lora_rank], contiguous, q's dtype (fp32 accumulation, one rounding).

    Raises
    ------
    TypeError, ValueError
        Dtypes or shapes that do not match.

    One launch (a program per head and column tile); CUDA-graph capturable. Replaces permute + bmm + copy.
    """
    from specverify.reference import fused_ops as ref

    op = "mla_absorb_q"
    b, k, h, d = _check_absorb(op, q, w_uk, nope_dim)
    out = _check_out(op, out, (b, k, h, w_uk.shape[2]), q)
    if not _use_triton(impl, q, w_uk):
        return out.copy_(ref.mla_absorb_q_reference(q, w_uk, nope_dim))
    q3 = q.reshape(b * k, h, d)
    if q3.stride(-1) != 1:
        q3 = q3.contiguous()
    _head_matmul(op, q3, w_uk, out.view(b * k, h, -1), b * k, h)
    return out


def _check_q_sumsq(op, q_sumsq, q_dim, tokens, like):
    """The sums of squares of q_a (``q_sumsq`` fp32 [P, tokens]) and their divisor ``q_dim`` (an int >= 1)."""
    if not isinstance(q_sumsq, torch.Tensor):
        raise TypeError(f"{op}: q_sumsq must be None or a tensor (gemv_sumsq's partials), got "
                        f"{type(q_sumsq).__name__}")
    if q_sumsq.dtype != torch.float32:
        raise TypeError(f"{op}: q_sumsq must be float32 [P, batch * k = {tokens}] (gemv_sumsq's partials), got "
                        f"{q_sumsq.dtype}")
    if q_sumsq.dim() != 2 or q_sumsq.shape[0] < 1 or q_sumsq.shape[1] != tokens:
        raise ValueError(f"{op}: q_sumsq must be float32 [P >= 1, batch * k = {tokens}] (one column per token of q), "
                         f"got {list(q_sumsq.shape)}")
    if q_sumsq.device != like.device:
        raise ValueError(f"{op}: q_sumsq must be on q's device {like.device}, got {q_sumsq.device}")
    if isinstance(q_dim, bool) or not isinstance(q_dim, int):
        raise TypeError(f"{op}: with q_sumsq, q_dim must be the int q_lora_rank (the mean's divisor), got "
                        f"{type(q_dim).__name__}")
    if q_dim < 1:
        raise ValueError(f"{op}: with q_sumsq, q_dim must be the int q_lora_rank (>= 1; the mean's divisor), got "
                         f"{q_dim!r}")


def mla_prep_absorb(q, kv, positions, norm_weight, w_uk, cache, page_table, prefix_lens, *, eps: float,
                    theta: float, nope_dim: int, cos_sin=None, interleaved: bool = False, out=None,
                    q_sumsq=None, q_dim: int | None = None, impl: str = "auto"):
    """:func:`mla_kv_prep` and :func:`mla_absorb_q` in one launch: the query absorbed into the latent space, the
    latent KV normalised, the rope key and the query's rope part rotated, the KV written into the paged cache.

    The two read disjoint columns of ``q`` (the absorption its nope part, the preparation rotates its rope part in
    place), so one grid runs both: the absorption's (head, column tile) programs, then one program per draft token.
    Saves one launch of the verify pass per layer against the two ops.

    With ``q_sumsq``, ``q`` is q_b's output over the folded weight (q_b times q_a's norm weight along q_lora) from
    the un-normed q_a, and every program applies q_a's RMSNorm scale ``s_t = rsqrt(sum_p q_sumsq[p, t] / q_dim +
    eps)`` per token: to the absorbed query's fp32 accumulator and to the rope part before its rotation. q_b, the
    absorption and RoPE are linear in q per token, so the result is the normed chain's, and q_a's RMSNorm kernel
    leaves the pass (one launch fewer per layer; the sums come from the qkv_a GEMV's epilogue,
    :func:`specverify.gemv.gemv_sumsq`).

    Parameters
    ----------
    q, kv, positions, norm_weight, cache, page_table, prefix_lens, eps, theta, cos_sin, interleaved
        As in :func:`mla_kv_prep`. ``q`` [batch, k, heads, nope_dim + rope_dim] must be viewable as
        [batch * k, heads, nope_dim + rope_dim] with a unit last stride (the q_b projection's output is).
    w_uk, nope_dim, out
        As in :func:`mla_absorb_q`.
    q_sumsq : fp32 Tensor [P, batch * k] or None
        Partial sums of squares of each token's q_a (rows summed; any strides), as :func:`specverify.gemv.gemv_sumsq`
        returns them. None (default): no scale, the kernel of before (a compile-time switch).
    q_dim : int
        q_lora_rank, the divisor of the mean; required with ``q_sumsq``. ``eps`` is q_a's RMSNorm eps too.

    Returns
    -------
    q_latent : Tensor [batch, k, heads, kv_lora_rank], contiguous, q's dtype. ``q`` and ``cache`` are mutated (with
    ``q_sumsq``, q's rope part holds the scaled and rotated values, as the attention reads them; its nope part
    stays the folded q_b's unscaled output, read by nothing after this op).

    Raises
    ------
    TypeError, ValueError
        As the two ops raise; ValueError also for a ``q`` that cannot be viewed as [batch * k, heads, dim]; for
        ``q_sumsq``: TypeError unless a float32 tensor or for a non-int ``q_dim``, ValueError for a shape other
        than [P, batch * k], another device, a non-positive ``q_dim``, or ``q_dim`` without ``q_sumsq``.

    Notes
    -----
    CUDA-graph capturable (``q_sumsq`` is read on the device; its address is the GEMV's persistent buffer); a
    programmatic dependent on sm_90+. Page ids are not range-checked here (see the verify API).
    ``impl="reference"``: :func:`specverify.reference.fused_ops.mla_prep_absorb_reference` (the two references in
    turn).
    """
    from specverify.reference import fused_ops as ref

    op = "mla_prep_absorb"
    b, k, h, d = _check_absorb(op, q, w_uk, nope_dim)
    r = norm_weight.shape[0]
    dr = kv.shape[-1] - r
    _check_cos_sin(op, cos_sin, dr)
    if q_sumsq is not None:
        _check_q_sumsq(op, q_sumsq, q_dim, b * k, q)
    elif q_dim is not None:
        raise ValueError(f"{op}: q_dim is read only with q_sumsq, got q_dim={q_dim!r} and no q_sumsq; pass both or "
                         "neither")
    out = _check_out(op, out, (b, k, h, w_uk.shape[2]), q)
    if not _use_triton(impl, q, kv, cache, w_uk):
        return out.copy_(ref.mla_prep_absorb_reference(
            q, kv, positions, norm_weight, w_uk, cache, page_table, prefix_lens, eps, theta, nope_dim,
            cos_sin=cos_sin, interleaved=interleaved, q_sumsq=q_sumsq, q_dim=q_dim))
    if q.stride(-1) != 1 or kv.stride(-1) != 1 or not cache.is_contiguous():
        raise ValueError(f"{op}: q, kv need a unit last stride and the cache must be contiguous")
    try:
        q3 = q.view(b * k, h, d)
    except RuntimeError as exc:
        raise ValueError(f"{op}: q must be viewable as [batch * k, heads, dim] (its rope part is rotated in place), "
                         f"got strides {tuple(q.stride())}; pass a contiguous q") from exc
    kv2 = kv.reshape(b * k, kv.shape[-1])
    pos = positions.reshape(-1)
    table = kv2 if cos_sin is None else cos_sin
    scaled = q_sumsq is not None
    qss = q_sumsq if scaled else kv2  # unread without Q_SCALE
    n_part = q_sumsq.shape[0] if scaled else 1
    prep = ((kv2, norm_weight, pos, page_table, prefix_lens, cache, table, kv2.stride(0), page_table.stride(0),
             cache.stride(0), cache.stride(1), table.stride(0), k, cache.shape[1], h, eps, math.log2(theta),
             qss, qss.stride(0) if scaled else 0, qss.stride(1) if scaled else 0, n_part, q_dim if scaled else 1),
            dict(R=r, DR=dr, BLOCK_R=triton_next_pow2(r), BLOCK_H=triton_next_pow2(h), TABLE=cos_sin is not None,
                 INTERLEAVED=bool(interleaved), Q_SCALE=scaled, BLOCK_P=triton_next_pow2(n_part)))
    _head_matmul(op, q3, w_uk, out.view(b * k, h, -1), b * k, h, prep=prep)
    return out


def mla_up_v(o_latent, w_uv, *, out=None, impl: str = "auto"):
    """Attention output of absorbed MLA out of the latent space: ``o[b, k, h*V + :] = o_latent[b, k, h] @ w_uv[h]``.

    Parameters
    ----------
    o_latent : Tensor [batch, k, heads, kv_lora_rank], bf16/fp16/fp32; unit last stride
    w_uv : Tensor [heads, kv_lora_rank, v_head_dim], o_latent's dtype
    out : Tensor [batch, k, heads * v_head_dim], optional
        Contiguous, o_latent's dtype; written and returned.

    Returns
    -------
    Tensor [batch, k, heads * v_head_dim], contiguous (ready for o_proj), o_latent's dtype.

    Raises
    ------
    TypeError, ValueError
        Dtypes or shapes that do not match.

    One launch; CUDA-graph capturable. Replaces permute + bmm + copy.
    """
    from specverify.reference import fused_ops as ref

    op = "mla_up_v"
    _check(op, "o_latent", o_latent, 4)
    _check(op, "w_uv", w_uv, 3)
    b, k, h, r = o_latent.shape
    if w_uv.shape[:2] != (h, r) or w_uv.dtype != o_latent.dtype:
        raise ValueError(f"{op}: w_uv must be [{h}, {r}, V] in {o_latent.dtype}, got {list(w_uv.shape)} "
                         f"{w_uv.dtype}")
    v = w_uv.shape[2]
    out = _check_out(op, out, (b, k, h * v), o_latent)
    if not _use_triton(impl, o_latent, w_uv):
        return out.copy_(ref.mla_up_v_reference(o_latent, w_uv))
    a = o_latent.reshape(b * k, h, r)
    if a.stride(-1) != 1:
        a = a.contiguous()
    _head_matmul(op, a, w_uv, out.view(b * k, h, v), b * k, h)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
