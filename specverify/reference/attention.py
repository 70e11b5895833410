"""Reference tree attention over a paged KV cache (GQA/MHA and absorbed MLA), in plain torch.

Request b's KV sequence has ``prefix_lens[b] + k`` tokens; token t lives at page ``page_table[b, t // page_size]``,
slot ``t % page_size``. Draft token i sees every prefix token and draft token j iff bit j of row i of the tree mask
is set (``tree_mask=None``: a chain, i.e. causal). Slots outside a request's sequence are never used, even if they
hold NaN. Batched, no per-token loops.

Precision and batch invariance: by default (``compute_dtype=None``) scores, softmax and the value sum are computed in
fp64 and rounded once to the output dtype (lse to fp32). A row's result then does not depend on how many rows the
call has (k, batch, heads) nor on where its visible tokens sit: a verify row equals, bit for bit, the k = 1 decode
row of the same query over the same visible tokens. fp32 products would not: a matmul's reduction order follows its
shape (the BLAS kernel and blocking chosen for the row count), which moves a bf16 output by an ulp now and then and
can flip a near-tie argmax downstream. In fp64 the orders differ by ~1e-16 relative, far below the rounding step of
fp32/bf16 outputs, so the rounded results agree (unless a value lies within that distance of a rounding boundary).
``compute_dtype`` bf16/fp16 computes as torch does in that dtype (to measure torch's own low-precision error) and
fp32 as torch does in fp32; neither is batch-invariant.
"""
from __future__ import annotations

import torch

from specverify.tree import unpack_mask


def gather_positions(page_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat slot index ``page * page_size + slot`` for positions ``[batch, L]`` (positions must be in range)."""
    pages = torch.gather(page_table.long(), 1, positions // page_size)
    return pages * page_size + positions % page_size


def _visible(prefix_lens: torch.Tensor, tree_mask: torch.Tensor | None, k: int, length: int) -> torch.Tensor:
    """bool [batch, k, length]: which KV positions each draft token sees."""
    batch = prefix_lens.shape[0]
    device = prefix_lens.device
    pos = torch.arange(length, device=device)
    prefix = prefix_lens.long().view(batch, 1, 1)
    in_prefix = pos.view(1, 1, length) < prefix  # [b, 1, L]
    if tree_mask is None:
        tree = torch.tril(torch.ones(k, k, dtype=torch.bool, device=device)).expand(batch, k, k)
    else:
        tree = unpack_mask(tree_mask.to(device), k)
        if tree.dim() == 2:
            tree = tree.expand(batch, k, k)
    rel = pos.view(1, 1, length) - prefix  # draft index j at position prefix + j
    in_draft = (rel >= 0) & (rel < k)
    j = rel.clamp(0, k - 1).expand(batch, k, length)
    tree_vis = torch.gather(tree, 2, j)
    return in_prefix.expand(batch, k, length) | (in_draft & tree_vis)


def _gather_kv(cache: torch.Tensor, page_table: torch.Tensor, prefix_lens: torch.Tensor, k: int):
    """Gather [batch, L, ...] from a paged cache; positions past the request's length are zero-filled."""
    batch = page_table.shape[0]
    page_size = cache.shape[1]
    total = prefix_lens.long() + k
    length = page_table.shape[1] * page_size  # static (no host sync), so the reference is graph-capturable
    pos = torch.arange(length, device=page_table.device).expand(batch, length)
    valid = pos < total.view(batch, 1)
    safe_pos = torch.where(valid, pos, torch.zeros_like(pos))
    flat = gather_positions(page_table, safe_pos, page_size)
    flat_cache = cache.reshape(cache.shape[0] * page_size, *cache.shape[2:])
    out = flat_cache[flat.clamp(min=0)]
    shape = (batch, length) + (1,) * (out.dim() - 2)
    out = torch.where(valid.view(shape), out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out, length


def _accumulation_dtype(dtype: torch.dtype, compute_dtype: torch.dtype | None) -> torch.dtype:
    """fp64 for fp64 inputs and by default (batch-invariant, see the module docstring), else ``compute_dtype``."""
    return torch.float64 if dtype == torch.float64 or compute_dtype is None else compute_dtype


def _softmax_attend(scores: torch.Tensor, visible: torch.Tensor, v: torch.Tensor, return_lse: bool):
    # scores [b, h, k, L]; visible [b, k, L]; v [b, h, L, Dv]
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [b, h, k]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = probs @ v
    return out, lse


def tree_attention_reference(q, k_cache, v_cache, page_table, prefix_lens, tree_mask, sm_scale,
                             return_lse=False, compute_dtype=None):
    """GQA/MHA tree attention. q [batch, k, Hq, D]; caches [num_pages, page_size, Hkv, D].

    Returns out [batch, k, Hq, D] in q's dtype (and lse fp32 [batch, k, Hq], natural log, of the scaled scores).
    ``compute_dtype``: None (fp64, rounded once: batch-invariant) or a dtype to compute in (module docstring).
    """
    compute_dtype = _accumulation_dtype(q.dtype, compute_dtype)
    batch, k, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    keys, length = _gather_kv(k_cache, page_table, prefix_lens, k)  # [b, L, Hkv, D]
    vals, _ = _gather_kv(v_cache, page_table, prefix_lens, k)
    keys = keys.to(compute_dtype).repeat_interleave(group, dim=2).permute(0, 2, 1, 3)  # [b, Hq, L, D]
    vals = vals.to(compute_dtype).repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    qf = q.to(compute_dtype).permute(0, 2, 1, 3)  # [b, Hq, k, D]
    scores = (qf @ keys.transpose(-1, -2)) * sm_scale
    visible = _visible(prefix_lens, tree_mask, k, length)
    out, lse = _softmax_attend(scores, visible, vals, return_lse)
    out = out.permute(0, 2, 1, 3).to(q.dtype)
    if return_lse:
        return out, lse.permute(0, 2, 1).float()
    return out


def tree_attention_mla_reference(q_latent, q_rope, kv_cache, page_table, prefix_lens, tree_mask, sm_scale,
                                 return_lse=False, compute_dtype=None):
    """Absorbed MLA tree attention. q_latent [b, k, H, R], q_rope [b, k, H, Dr]; kv_cache [P, page, R + Dr].

    score = (q_latent · c + q_rope · k_rope) * sm_scale, V = c (the latent part). Returns [b, k, H, R] in
    q_latent's dtype (and lse fp32 [b, k, H]). ``compute_dtype``: None (fp64, rounded once: batch-invariant) or a
    dtype to compute in (module docstring).
    """
    compute_dtype = _accumulation_dtype(q_latent.dtype, compute_dtype)
    batch, k, h, r = q_latent.shape
    kv, length = _gather_kv(kv_cache, page_table, prefix_lens, k)  # [b, L, R + Dr]
    kv = kv.to(compute_dtype)
    latent = kv[..., :r]
    rope = kv[..., r:]
    ql = q_latent.to(compute_dtype).permute(0, 2, 1, 3)  # [b, H, k, R]
    qr = q_rope.to(compute_dtype).permute(0, 2, 1, 3)
    scores = (ql @ latent.unsqueeze(1).transpose(-1, -2) + qr @ rope.unsqueeze(1).transpose(-1, -2)) * sm_scale
    visible = _visible(prefix_lens, tree_mask, k, length)
    out, lse = _softmax_attend(scores, visible, latent.unsqueeze(1).expand(batch, h, length, r), return_lse)
    out = out.permute(0, 2, 1, 3).to(q_latent.dtype)
    if return_lse:
        return out, lse.permute(0, 2, 1).float()
    return out
