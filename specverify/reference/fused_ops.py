"""References of the fused small ops (:mod:`specverify.fused_ops`): the same maths as separate torch ops."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specverify.reference.kv import write_draft_kv


def rmsnorm_reference(x, weight, eps):
    """RMSNorm over the last dim in fp32 (fp64 stays fp64), result in x's dtype."""
    xf = x.float() if x.dtype != torch.float64 else x
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.to(out.dtype)).to(x.dtype)


def add_rmsnorm_reference(x, residual, weight, eps):
    """(rmsnorm(x + residual), x + residual); the sum is rounded to x's dtype first."""
    s = x + residual
    return rmsnorm_reference(s, weight, eps), s


def apply_rope(x, positions, theta):
    """Rotate-half RoPE. x [b, k, heads, d] (or [b, k, d]); positions int [b, k]."""
    d = x.shape[-1]
    ctype = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=ctype) / d))
    ang = positions.to(ctype).unsqueeze(-1) * inv  # [b, k, d/2]
    if x.dim() == 4:
        ang = ang.unsqueeze(2)
    cos, sin = torch.cos(ang), torch.sin(ang)
    xf = x.to(ctype)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def apply_table_rope(x, positions, cos_sin, interleaved: bool):
    """RoPE from a ``[max_position, rot]`` table (cos half, then sin half), as SGLang's rotary embeddings hold it.

    x [b, k, heads, rot] or [b, k, rot]; positions int [b, k]. ``interleaved``: rotate the pairs (2j, 2j + 1)
    (GPT-J, DeepSeek's layout), else the halves. Computed in fp32 (fp64 stays fp64), result in x's dtype.
    """
    ctype = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = cos_sin[positions.long()].to(ctype).chunk(2, dim=-1)  # [b, k, rot / 2]
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    xf = x.to(ctype)
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else xf.chunk(2, dim=-1)
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.stack([o1, o2], -1).flatten(-2) if interleaved else torch.cat([o1, o2], -1)
    return out.to(x.dtype)


def mla_kv_prep_reference(q, kv, positions, norm_weight, cache, page_table, prefix_lens, eps, theta, nope_dim,
                          cos_sin=None, interleaved=False, q_scale=None):
    """q [b, k, h, nope + rope] (rope part rotated in place); kv [b, k, R + rope]; writes the cache. RoPE from
    ``theta`` (rotate-half), or from the table ``cos_sin`` (see :func:`apply_table_rope`). ``q_scale`` (float
    [b, k, 1, 1], optional): multiplies q's rope part before the rotation, in its precision (one rounding into q)."""
    def rope(x):
        if cos_sin is None:
            return apply_rope(x, positions, theta)
        return apply_table_rope(x, positions, cos_sin, interleaved)

    r = norm_weight.shape[0]
    latent = rmsnorm_reference(kv[..., :r], norm_weight, eps)
    k_pe = rope(kv[..., r:])
    write_draft_kv(cache, page_table, prefix_lens, torch.cat([latent, k_pe], -1))
    q[..., nope_dim:] = rope(q[..., nope_dim:] if q_scale is None else q[..., nope_dim:].to(q_scale.dtype) * q_scale)
    return q


def rms_scale(q_sumsq, q_dim, eps, dtype=torch.float32):
    """[T]: ``rsqrt(sum_p q_sumsq[p, t] / q_dim + eps)``, RMSNorm's per-token scale from partial sums of squares."""
    return torch.rsqrt(q_sumsq.to(dtype).sum(0) / q_dim + eps)


def mla_prep_absorb_reference(q, kv, positions, norm_weight, w_uk, cache, page_table, prefix_lens, eps, theta,
                              nope_dim, cos_sin=None, interleaved=False, q_sumsq=None, q_dim=None):
    """:func:`mla_kv_prep_reference` then :func:`mla_absorb_q_reference`; returns q_latent [b, k, h, R] in q's dtype.

    With ``q_sumsq`` (fp32 [P, b * k], partial sums of squares of q_a) and ``q_dim`` (q_lora_rank), q is q_b's output
    over the folded weight from the un-normed q_a: both q's rope part (before RoPE) and the absorbed query are
    multiplied by q_a's RMSNorm scale :func:`rms_scale` per token, in fp32 (fp64 for fp64 q), then rounded once
    into q's dtype. That is the normed chain, as q_b, the absorption and RoPE are linear in q per token."""
    if q_sumsq is None:
        mla_kv_prep_reference(q, kv, positions, norm_weight, cache, page_table, prefix_lens, eps, theta, nope_dim,
                              cos_sin=cos_sin, interleaved=interleaved)
        return mla_absorb_q_reference(q, w_uk, nope_dim)
    b, k = q.shape[:2]
    ctype = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = rms_scale(q_sumsq, q_dim, eps, ctype).view(b, k, 1, 1)
    mla_kv_prep_reference(q, kv, positions, norm_weight, cache, page_table, prefix_lens, eps, theta, nope_dim,
                          cos_sin=cos_sin, interleaved=interleaved, q_scale=s)
    return (mla_absorb_q_reference(q.to(ctype), w_uk.to(ctype), nope_dim) * s).to(q.dtype)


def gqa_prep_reference(q, k, v, positions, q_norm, k_norm, k_cache, v_cache, page_table, prefix_lens, eps, theta):
    """q [b, k, hq, d] rotated in place (after the optional qk-norm); k, v written into their caches."""
    if q_norm is not None:
        q.copy_(rmsnorm_reference(q, q_norm, eps))
        k = rmsnorm_reference(k, k_norm, eps)
    q.copy_(apply_rope(q, positions, theta))
    write_draft_kv(k_cache, page_table, prefix_lens, apply_rope(k, positions, theta))
    write_draft_kv(v_cache, page_table, prefix_lens, v)
    return q


def silu_mul_reference(gate_up):
    """[T, 2I] → [T, I]: silu(gate) * up in fp32, result in the input dtype."""
    inter = gate_up.shape[-1] // 2
    ctype = torch.float64 if gate_up.dtype == torch.float64 else torch.float32
    return (F.silu(gate_up[..., :inter].to(ctype)) * gate_up[..., inter:].to(ctype)).to(gate_up.dtype)


def mla_absorb_q_reference(q, w_uk, nope_dim):
    """q [b, k, h, nope + rope], w_uk [h, nope, R] -> q_latent [b, k, h, R] = q[..., :nope] @ w_uk[h] per head."""
    return torch.einsum("bkhd,hdr->bkhr", q[..., :nope_dim], w_uk)


def mla_up_v_reference(o_latent, w_uv):
    """o_latent [b, k, h, R], w_uv [h, R, V] -> [b, k, h * V]: each head's output out of the latent space."""
    b, k, h, _ = o_latent.shape
    return torch.einsum("bkhr,hrd->bkhd", o_latent, w_uv).reshape(b, k, h * w_uv.shape[-1])
