"""Reference paged-KV helpers: write the draft tokens' KV into their slots, and compact the accepted path.

A cache is ``[num_pages, page_size, ...]``; request b's position t lives at page ``page_table[b, t // page_size]``,
slot ``t % page_size``. During verify, node i of request b sits at position ``prefix_lens[b] + i``. After
acceptance, compaction moves node ``accepted_nodes[b, d]`` to position ``prefix_lens[b] + d`` for
``d <= accept_len[b]``; nothing else in the pool changes.
"""
from __future__ import annotations

import torch

from specverify.reference.attention import gather_positions


def write_draft_kv(cache, page_table, prefix_lens, values):
    """cache[...] at positions prefix_lens[b] + i ← values[b, i] (values [batch, k, ...]). In place, capturable."""
    batch, k = values.shape[:2]
    page_size = cache.shape[1]
    pos = prefix_lens.long().view(batch, 1) + torch.arange(k, device=values.device).view(1, k)
    flat = gather_positions(page_table, pos, page_size).reshape(-1)
    flat_cache = cache.view(cache.shape[0] * page_size, *cache.shape[2:])
    flat_cache.index_copy_(0, flat, values.reshape(batch * k, *values.shape[2:]).to(cache.dtype))


def compact_kv_reference(caches, page_table, prefix_lens, accepted_nodes, accept_len):
    """Move each request's accepted path to contiguous positions, in place, for every cache in ``caches``.

    accepted_nodes int [batch, L] (node 0 first, -1 padding); accept_len int [batch]. Gathers every source
    before writing, so overlapping ranges are safe. Only positions ``prefix_lens[b] + d`` with
    ``d <= accept_len[b]`` are written.
    """
    batch, length = accepted_nodes.shape
    device = accepted_nodes.device
    d = torch.arange(length, device=device).view(1, length)
    live = d <= accept_len.long().view(batch, 1)
    dst_pos = prefix_lens.long().view(batch, 1) + d
    # positions past the accepted path copy onto themselves: fixed shapes, no host sync (graph-capturable)
    src_pos = torch.where(live, prefix_lens.long().view(batch, 1) + accepted_nodes.long().clamp(min=0), dst_pos)
    for cache in caches:
        page_size = cache.shape[1]
        flat_cache = cache.view(cache.shape[0] * page_size, *cache.shape[2:])
        src = gather_positions(page_table, src_pos, page_size).reshape(-1)
        dst = gather_positions(page_table, dst_pos, page_size).reshape(-1)
        flat_cache.index_copy_(0, dst, flat_cache.index_select(0, src))
