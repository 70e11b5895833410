"""Triton kernel for in-place KV compaction of the accepted path of each request, for a run of caches at once.

Math: for request b with prefix length P_b, accepted nodes n_0 = 0 < n_1 < ... < n_A (A = accept_len[b]),
``cache[slot(b, P_b + d)] <- cache[slot(b, P_b + n_d)]`` for d = 1..A, where
``slot(b, t) = page_table[b, t // page_size] * stride_page + (t % page_size) * stride_slot``.

Grid: (request, column block, cache of the run). One launch serves a run of caches of one layout spaced
``stride_cache`` elements apart (the layers of one buffer): cache z starts at ``cache_ptr + z * stride_cache``. The
launcher forms runs only of caches that do not overlap, so the programs of different caches touch disjoint memory.

Overlap safety: one program owns request b's copies for a block of columns of one cache and performs them in
increasing d. Since n_d >= d and n is strictly increasing, the destination of copy d (position P_b + d) is never the
source of a later copy d' > d (n_d' > n_d >= d), so no source is overwritten before it is read.

Tensors:

| name           | shape                               | dtype        | meaning                                    |
| -------------- | ----------------------------------- | ------------ | ------------------------------------------ |
| cache          | [num_pages, page_size, *row]        | any          | the run's first KV pool (row = 576 for     |
|                |                                     |              | MLA, [Hkv, D]); pool z at + z*stride_cache |
| page_table     | [batch, max_pages]                  | int32/int64  | page of each position block                |
| prefix_lens    | [batch]                             | int32/int64  | verified tokens before node 0              |
| accepted_nodes | [batch, L]                          | int64        | accepted path, node 0 first, -1 padding    |
| accept_len     | [batch]                             | int64        | accepted proposed tokens                   |
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["L", "row_elems", "stride_cache", "stride_page", "stride_slot", "stride_pt"])
def _kv_compact_kernel(cache_ptr, page_table_ptr, prefix_ptr, nodes_ptr, len_ptr,
                       L, row_elems, stride_cache, stride_page, stride_slot, stride_pt,
                       PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    cache_ptr += tl.program_id(2).to(tl.int64) * stride_cache  # int64: a many-layer buffer spans past 2^31 elements
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    prefix = tl.load(prefix_ptr + b).to(tl.int64)
    alen = tl.load(len_ptr + b).to(tl.int64)
    for d in range(1, L):
        n = tl.load(nodes_ptr + b * L + d).to(tl.int64)
        live = (d <= alen) & (n >= 0) & (n != d)
        src = prefix + tl.where(live, n, 0)
        dst = prefix + tl.where(live, d, 0)
        sp = tl.load(page_table_ptr + b * stride_pt + src // PAGE_SIZE).to(tl.int64)
        dp = tl.load(page_table_ptr + b * stride_pt + dst // PAGE_SIZE).to(tl.int64)
        s_off = sp * stride_page + (src % PAGE_SIZE) * stride_slot
        d_off = dp * stride_page + (dst % PAGE_SIZE) * stride_slot
        m = cols < tl.where(live, row_elems, 0)
        v = tl.load(cache_ptr + s_off + cols, mask=m)
        tl.store(cache_ptr + d_off + cols, v, mask=m)
