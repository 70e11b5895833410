"""MoE routing (scores, bias, group mask, top-k, renormalise, scale) fused with the token→expert block alignment.

Math, for token row ``m`` of ``logits`` [M, E] (fp32 arithmetic throughout):

* ``s[e] = sigmoid(x[e])`` or ``softmax(x)[e]``; ``c[e] = s[e] + bias[e]``; a non-finite ``c[e]`` becomes -inf
  (it never wins). Softmax reads a NaN logit as -inf (probability 0); a row with +inf logits gives each of them
  1 / their count and every other expert 0; a row with no finite logit left has NaN scores (no candidate).
* With ``N_GROUP > 1`` (equal groups of ``GSIZE`` experts): ``g[j] = c(1) + c(2)`` over the two best ``c`` in
  group ``j``; the ``TOPK_GROUP`` best groups stay (ties: lowest group id), the other experts' ``c`` become -inf.
* One bitonic top-k (``tl.topk``) of the int64 keys below: the ``TOP_K`` largest, largest first (ties: lowest
  expert id). A winner whose ``c`` is -inf (the finite candidates ran out) is a filler: every -inf key ties in value,
  so those slots take the lowest expert ids not chosen yet, with weight 0; every id is a distinct expert in [0, E)
  and is aligned like any other.
* ``w[k] = s[id_k]`` (unbiased score); with ``RENORM`` ``w /= sum(w)`` where the sum is > 0; ``w *= scale``.
* With ``OUT_K = TOP_K + 1`` (routing without alignment only) each output row has one more slot, the shared expert:
  ``id[TOP_K] = shared_id``, ``w[TOP_K] = 1.0`` (not scaled, not renormalised), so the expert pass reads routed and
  shared experts from one [M, TOP_K + 1] table.

The top-k (and the group choice, rounds of argmax) uses one int64 key per expert: high word = the fp32 value's bits
mapped to an order-preserving int32, low word = ``EP - 1 - e``; the largest key is the largest value and, among
equals, the lowest expert id.

Alignment (one launch with the routing): each routed slot ``s = m * TOP_K + k`` takes its rank inside its expert
with an atomic add on a per-expert counter; the last program to finish (a ticket counter) turns the counts into
block-padded offsets and scatters. The order of slots inside an expert is the order of the atomics (free: the
expert GEMM computes each slot's row independently, so its output does not depend on it). The counters and the
ticket are reset by that last program, so the workspace is zero again for the next call (CUDA-graph replays
included).

Tensors (S = M * TOP_K; B = BLOCK_SIZE; MAXB = number of blocks the buffers hold; OUT_K = TOP_K, or TOP_K + 1
with the shared slot, routing alone):

| name            | shape          | dtype        | meaning                                                      |
| --------------- | -------------- | ------------ | ------------------------------------------------------------ |
| logits          | [M, E]         | bf16/fp16/fp32 | router logits, row stride ``stride_lm``, unit column stride |
| bias            | [E]            | fp32         | correction bias (only when HAS_BIAS)                         |
| topk_ids        | [M, OUT_K]     | int32        | out (routing; in [0, E), column TOP_K: shared_id) or in (alignment: -1 none) |
| topk_weights    | [M, OUT_K]     | fp32         | out: routed weights (column TOP_K: 1.0)                      |
| rank            | [S]            | int32        | scratch: slot's rank inside its expert                       |
| sorted_ids      | [MAXB * B]     | int32        | out: slots grouped by expert, padded with S                  |
| expert_ids      | [MAXB]         | int32        | out: expert of each block, -1 for blocks past the used part  |
| num_post_pad    | [1]            | int32        | out: used length of sorted_ids (a multiple of B)             |
| ws_count        | [>= EA]        | int32        | workspace: per-expert counters, zero between calls           |
| ws_mask         | [>= EA]        | int64        | workspace (fast MASK path): per-expert row masks, zero between calls |
| ws_offs         | [>= EA]        | int32        | workspace: padded start offset of each expert                |
| ws_ticket       | [1]            | int32        | workspace: programs finished, zero between calls             |

``_moe_route_align_fast_kernel`` (end of this file) routes and aligns up to 1024 slots, choosing its alignment by the
size (one program in registers, or a last program that sorts, reads per-expert row masks or scatters by atomic
ranks) and writing nothing past the used part of sorted_ids; ``_moe_route_align_kernel`` (above it) serves the
router alone, larger calls and alignment-only calls of more than 32 slots.
"""
from __future__ import annotations

import triton
import triton.language as tl

from specverify.kernels.pdl import pdl_enter

# order-preserving int32 image of -inf: bits 0xFF800000 with the magnitude bits flipped (see _order_key)
_NEG_INF_ORDERED = tl.constexpr(-2139095041)
_REMOVED = tl.constexpr(-9223372036854775807)


@triton.jit
def _order_key(v, idx, IDX_P: tl.constexpr):
    """int64 key: larger value first, then lower index. ``v`` fp32 without NaN, ``idx`` int32 in [0, IDX_P)."""
    v = tl.where(v == 0.0, 0.0, v)  # -0.0 and +0.0 compare equal, as in torch
    u = v.to(tl.int32, bitcast=True)
    ordered = u ^ ((u >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (IDX_P - 1 - idx).to(tl.int64)


@triton.jit
def _key_index(key, IDX_P: tl.constexpr):
    return IDX_P - 1 - (key & 65535).to(tl.int32)


@triton.jit
def _key_is_finite(key):
    return (key >> 32).to(tl.int32) > _NEG_INF_ORDERED


@triton.jit
def _softmax_num(x, mx):
    """Softmax numerators of a NaN-free [ROWS, N] logit tile with row maxima ``mx``: ``exp(x - mx)``, or, in a row
    whose maximum is +inf, 1 for each +inf logit and 0 for the rest (the +inf logits share the probability)."""
    inf_row = (mx == float("inf"))[:, None]
    return tl.where(inf_row, tl.where(x == float("inf"), 1.0, 0.0), tl.exp(x - mx[:, None]))


@triton.jit
def _scores(x, emask, SOFTMAX: tl.constexpr):
    """fp32 scores of a [ROWS, EP] logit tile (padding columns hold -inf); returns (scores, row max, row sum)."""
    if SOFTMAX:
        x = tl.where(x != x, float("-inf"), x)  # a NaN logit: probability 0
        mx = tl.max(x, axis=1)
        p = _softmax_num(x, mx)
        p = tl.where(emask[None, :], p, 0.0)
        den = tl.sum(p, axis=1)
        s = p / den[:, None]  # no finite logit (mx = -inf): exp(-inf - -inf) = NaN everywhere, so no candidate
    else:
        mx = tl.zeros([x.shape[0]], tl.float32)
        den = mx
        s = 1.0 / (1.0 + tl.exp(-x))
    return s, mx, den


@triton.jit
def _store_winners(logits_ptr, row_off, ids, won, kmask, mx, den, scale, out_off, ids_ptr, w_ptr,
                   SOFTMAX: tl.constexpr, RENORM: tl.constexpr):
    """Store the chosen ids [ROWS, TOPK_P] and their weights: the unbiased scores of the winners (``won``; the
    fillers weigh 0), recomputed from their logits (``row_off`` [ROWS, 1] into the logits) with the same formula,
    renormalised where the sum is > 0, times the routed scaling factor."""
    valid = won & kmask
    safe = tl.where(valid, ids, 0)
    xv = tl.load(logits_ptr + row_off + safe, mask=valid, other=0.0).to(tl.float32)
    if SOFTMAX:
        xv = tl.where(xv != xv, float("-inf"), xv)
        sv = _softmax_num(xv, mx) / den[:, None]
    else:
        sv = 1.0 / (1.0 + tl.exp(-xv))
    w = tl.where(valid, sv, 0.0)
    if RENORM:
        tot = tl.sum(w, axis=1)
        w = tl.where(tot[:, None] > 0, w / tl.where(tot > 0, tot, 1.0)[:, None], w)
    w = w * scale
    tl.store(ids_ptr + out_off, ids, mask=kmask)
    tl.store(w_ptr + out_off, w, mask=kmask)


@triton.jit
def _route_rows(logits_ptr, bias_ptr, ids_ptr, w_ptr, count_ptr, rank_ptr, row0, M, stride_lm, scale, shared_id,
                E: tl.constexpr, EP: tl.constexpr, ROWS: tl.constexpr, TOP_K: tl.constexpr,
                TOPK_P: tl.constexpr, N_GROUP: tl.constexpr, NG_P: tl.constexpr, GSIZE: tl.constexpr,
                TOPK_GROUP: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                DO_ALIGN: tl.constexpr, OUT_K: tl.constexpr, MASK: tl.constexpr = False):
    """Route rows ``row0 .. row0 + ROWS - 1``; returns their ids [ROWS, TOPK_P] (-1 for padding lanes and rows past
    M; a slot past the row's finite candidates holds a filler: the lowest expert id not chosen yet, weight 0).
    The winners by one bitonic top-k of the keys (tl.topk). DO_ALIGN: each slot's rank by an atomic add on
    ``count_ptr`` (int32 per expert), stored at ``rank_ptr``; with MASK instead bit ``row`` of ``count_ptr``'s int64
    row mask of each chosen expert is set (rows < 64).

    The outputs have rows of OUT_K slots: TOP_K, or TOP_K + 1 (no DO_ALIGN) where slot TOP_K of each row is the
    shared expert, ``shared_id`` with weight 1.0 (the returned ids hold the routed slots only).
    """
    tl.static_assert(OUT_K == TOP_K or (OUT_K == TOP_K + 1 and not DO_ALIGN),
                     "OUT_K is TOP_K, or TOP_K + 1 (the shared slot) without the alignment")
    rows = row0 + tl.arange(0, ROWS)
    rmask = rows < M
    e = tl.arange(0, EP)
    emask = e < E
    row_off = rows.to(tl.int64) * stride_lm
    if HAS_BIAS:  # issued with the logits load: one round trip for both
        b = tl.load(bias_ptr + e, mask=emask, other=0.0).to(tl.float32)
    x = tl.load(logits_ptr + row_off[:, None] + e[None, :], mask=rmask[:, None] & emask[None, :],
                other=float("-inf")).to(tl.float32)
    s, mx, den = _scores(x, emask, SOFTMAX)
    c = s
    if HAS_BIAS:
        c = s + b[None, :]
    finite = (c == c) & (tl.abs(c) != float("inf")) & emask[None, :]
    c = tl.where(finite, c, float("-inf"))

    if N_GROUP > 1:
        gid = e // GSIZE
        g_ar = tl.arange(0, NG_P)
        RESHAPE: tl.constexpr = (EP == N_GROUP * GSIZE) and (GSIZE >= 2)
        if RESHAPE:
            # no padding lane and power-of-two groups: every group's two best at once, reduced along a [ROWS,
            # N_GROUP, GSIZE] view (three reductions instead of three per group)
            c3 = tl.reshape(c, [ROWS, N_GROUP, GSIZE])
            m1 = tl.max(c3, axis=2)
            n1 = tl.sum((c3 == m1[:, :, None]).to(tl.int32), axis=2)
            m2 = tl.max(tl.where(c3 < m1[:, :, None], c3, float("-inf")), axis=2)
            sc = m1 + tl.where(n1 >= 2, m1, m2)
            gscore = tl.where(sc == sc, sc, float("-inf"))  # [ROWS, NG_P]: NG_P == N_GROUP here
        else:
            gscore = tl.full([ROWS, NG_P], float("-inf"), tl.float32)
            for g in tl.static_range(N_GROUP):
                inside = (gid == g)[None, :]
                v = tl.where(inside, c, float("-inf"))
                m1 = tl.max(v, axis=1)
                if GSIZE >= 2:
                    n1 = tl.sum(((v == m1[:, None]) & inside).to(tl.int32), axis=1)
                    m2 = tl.max(tl.where(v < m1[:, None], v, float("-inf")), axis=1)
                    sc = m1 + tl.where(n1 >= 2, m1, m2)
                else:
                    sc = m1
                sc = tl.where(sc == sc, sc, float("-inf"))
                gscore = tl.where(g_ar[None, :] == g, sc[:, None], gscore)
        gkey = _order_key(gscore, g_ar[None, :], NG_P)
        allowed = tl.zeros([ROWS, EP], tl.int32)
        for t in tl.static_range(TOPK_GROUP):
            best = tl.max(gkey, axis=1)
            gsel = _key_index(best, NG_P)
            allowed = allowed | (gid[None, :] == gsel[:, None]).to(tl.int32)
            gkey = tl.where(g_ar[None, :] == gsel[:, None], _REMOVED, gkey)
        c = tl.where(allowed != 0, c, float("-inf"))

    key = _order_key(c, e[None, :], EP)
    kk = tl.arange(0, TOPK_P)
    # every -inf key ties in value, so once the finite candidates run out the keys go on with the lowest expert ids
    # not chosen yet (padding lanes e >= E come after every real expert, and TOP_K <= E): those are the fillers
    top = tl.topk(key, TOPK_P, dim=1)  # [ROWS, TOPK_P], largest key first
    ids = tl.where((kk < TOP_K)[None, :], _key_index(top, EP), -1)
    won = _key_is_finite(top)

    kmask = (kk < TOP_K)[None, :] & rmask[:, None]
    out_off = rows[:, None] * OUT_K + kk[None, :]
    valid = (ids >= 0) & kmask  # every routed slot, fillers included: they are aligned (weight 0) like the others
    # the alignment's atomics go out before the weights' logit reload, so the two round trips overlap
    if DO_ALIGN:
        safe = tl.where(valid, ids, 0)
        if MASK:  # this row's bit in each chosen expert's row mask (no value returned: a fire-and-forget reduction)
            bit = tl.full([ROWS, TOPK_P], 1, tl.int64) << tl.where(rmask, rows, 0)[:, None].to(tl.int64)
            tl.atomic_or(count_ptr + safe, bit, mask=valid, sem="relaxed")
        else:
            rank = tl.atomic_add(count_ptr + safe, 1, mask=valid, sem="relaxed")
    # weights: the unbiased scores of the winners, recomputed from their logits with the same formula
    _store_winners(logits_ptr, row_off[:, None], ids, won, kmask, mx, den, scale, out_off, ids_ptr, w_ptr, SOFTMAX,
                   RENORM)
    if DO_ALIGN and not MASK:
        tl.store(rank_ptr + out_off, rank, mask=valid)
    if OUT_K > TOP_K:  # the shared expert: every row's last slot, weight 1
        sh = rows * OUT_K + TOP_K
        tl.store(ids_ptr + sh, tl.full([ROWS], 0, tl.int32) + shared_id, mask=rmask)
        tl.store(w_ptr + sh, tl.full([ROWS], 1.0, tl.float32), mask=rmask)
    return tl.where(valid, ids, -1)  # [ROWS, TOPK_P]: -1 for padding lanes and rows past M


@triton.jit
def _pad_offsets(cnt, B: tl.constexpr):
    """From per-expert counts ``cnt`` [EAP]: (padded, offs, total) = each count rounded up to a multiple of B, the
    exclusive cumsum of those (each expert's start) and their sum (the used length)."""
    padded = (cnt + B - 1) // B * B
    return padded, tl.cumsum(padded, axis=0) - padded, tl.sum(padded, axis=0)


@triton.jit
def _expert_blocks(cnt, e, emask, npad_ptr, offs_ptr, eids_ptr, B: tl.constexpr):
    """From per-expert counts ``cnt`` [EAP] (experts ``e``, ``emask`` the real ones): each expert's padded length and
    start offset, stored with the used length ``num_post_pad``, and the expert id of each used block (a block of
    expert e starts at offs[e] / B). Returns (padded, offs, total)."""
    padded, offs, total = _pad_offsets(cnt, B)
    tl.store(npad_ptr, total)
    tl.store(offs_ptr + e, offs, mask=emask)
    nblk = padded // B
    for j in range(0, tl.max(nblk, axis=0)):
        tl.store(eids_ptr + offs // B + j, e, mask=emask & (j < nblk))
    return padded, offs, total


@triton.jit
def _align_finish(ids_ptr, rank_ptr, sorted_ptr, eids_ptr, npad_ptr, count_ptr, offs_ptr, S, max_blocks,
                  EA: tl.constexpr, EAP: tl.constexpr, B: tl.constexpr, CHUNK: tl.constexpr):
    """Run by one program once every slot has its rank: offsets, expert of each block, sentinels, scatter."""
    e = tl.arange(0, EAP)
    emask = e < EA
    cnt = tl.load(count_ptr + e, mask=emask, other=0, cache_modifier=".cg")
    padded, offs, total = _expert_blocks(cnt, e, emask, npad_ptr, offs_ptr, eids_ptr, B)
    # sentinels: the unused blocks (-1) and everything past the used part, then each expert's padding
    _fill_tails(sorted_ptr, eids_ptr, total, S, max_blocks, B, CHUNK, True)
    for j in tl.static_range(B - 1):
        tl.store(sorted_ptr + offs + cnt + j, S, mask=emask & (j < padded - cnt))
    ob = tl.arange(0, CHUNK)
    tl.debug_barrier()  # offsets visible to every thread; counters read before they are reset
    for s0 in range(0, S, CHUNK):
        sl = s0 + ob
        ids = tl.load(ids_ptr + sl, mask=sl < S, other=-1, cache_modifier=".cg")
        ok = (sl < S) & (ids >= 0) & (ids < EA)
        rk = tl.load(rank_ptr + sl, mask=ok, other=0, cache_modifier=".cg")
        base = tl.load(offs_ptr + tl.where(ok, ids, 0), mask=ok, other=0, cache_modifier=".cg")
        tl.store(sorted_ptr + base + rk, sl, mask=ok)
    tl.store(count_ptr + e, tl.zeros([EAP], tl.int32), mask=emask)


@triton.jit(do_not_specialize=["M", "S", "max_blocks", "shared_id"])
def _moe_route_align_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, rank_ptr, sorted_ptr, eids_ptr, npad_ptr,
                            count_ptr, offs_ptr, ticket_ptr, M, S, max_blocks, stride_lm, scale, shared_id,
                            E: tl.constexpr, EP: tl.constexpr, ROWS: tl.constexpr, TOP_K: tl.constexpr,
                            OUT_K: tl.constexpr, TOPK_P: tl.constexpr, N_GROUP: tl.constexpr, NG_P: tl.constexpr,
                            GSIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, SOFTMAX: tl.constexpr,
                            HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, DO_ROUTE: tl.constexpr,
                            DO_ALIGN: tl.constexpr, EA: tl.constexpr, EAP: tl.constexpr, B: tl.constexpr,
                            CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """Routing of ROWS rows per program (DO_ROUTE) and/or the alignment (DO_ALIGN; the last program finishes it).

    Without DO_ROUTE the grid must be (1,): the one program ranks every slot itself. OUT_K = TOP_K + 1 (routing
    alone): each output row ends with the shared expert's slot (``shared_id``, weight 1); else OUT_K = TOP_K.
    """
    pdl_enter(PDL)  # logits (and the workspace) belong to earlier kernels
    pid = tl.program_id(0)
    if DO_ROUTE:
        _route_rows(logits_ptr, bias_ptr, ids_ptr, w_ptr, count_ptr, rank_ptr, pid * ROWS, M, stride_lm, scale,
                    shared_id, E, EP, ROWS, TOP_K, TOPK_P, N_GROUP, NG_P, GSIZE, TOPK_GROUP, SOFTMAX, HAS_BIAS,
                    RENORM, DO_ALIGN, OUT_K)
    if DO_ALIGN:
        if DO_ROUTE:
            tl.debug_barrier()  # this program's ids, ranks and counter updates precede its ticket
            ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
            last = ticket == tl.num_programs(0) - 1
        else:
            o = tl.arange(0, CHUNK)
            for s0 in range(0, S, CHUNK):
                sl = s0 + o
                ids = tl.load(ids_ptr + sl, mask=sl < S, other=-1)
                ok = (sl < S) & (ids >= 0) & (ids < EA)
                rk = tl.atomic_add(count_ptr + tl.where(ok, ids, 0), 1, mask=ok, sem="relaxed")
                tl.store(rank_ptr + sl, rk, mask=ok)
            tl.debug_barrier()
            last = pid == 0
        if last:
            _align_finish(ids_ptr, rank_ptr, sorted_ptr, eids_ptr, npad_ptr, count_ptr, offs_ptr, S, max_blocks,
                          EA, EAP, B, CHUNK)
            if DO_ROUTE:
                tl.atomic_xchg(ticket_ptr, 0)


# ------------------------------------------------------------------------------------------------------------------
# Fast kernel (``_moe_route_align_fast_kernel``): no global round trip between the routing and the alignment when
# one program holds every slot, and nothing written past the used part except the (short) expert_ids tail.
#
#   ONE (grid (1,), all M rows routed at once as one [ROWS, EP] tile, or DO_ROUTE off: the ids loaded once): the
#   slots stay in registers as a flat [SP] vector and the alignment is a pairwise [SP, SP] comparison:
#       cnt[s]  = #{s' : id[s'] == id[s]}            rank[s] = #{s' < s : id[s'] == id[s]}
#       first[s] = rank[s] == 0                        pad[s]  = ceil(cnt[s] / B) * B
#       offs[s] = sum over first s' with id[s'] < id[s] of pad[s']
#       sorted_ids[offs[s] + rank[s]] = s;  the first slot of each expert writes its padding and its block ids.
#     Slots inside an expert come in increasing slot id (align_reference's order: exact match).
#   not ONE (grid (ceil(M / ROWS),)): ranks by atomics as in _moe_route_align_kernel; the last program (ticket)
#     loads the ids, ranks and counters in one round trip, scans the counters and scatters (each slot's expert start
#     gathered from the offsets in registers).
#     SORTED: no atomic ranks; the last program loads the ids once and aligns by one sort (_align_sorted: sorted
#     (expert, slot) keys, run ranks and lengths by a segmented count from both ends, pad offsets by a cumsum), so
#     the order inside an expert is exact here too.
#
#     MASK (M <= 64): no atomic ranks either; each routing program ORs its row's bit into the int64 row mask of each
#     chosen expert (a reduction with no value returned), and the last program aligns from the masks and the ids
#     (_align_masks: counts and ranks by bit counts, exact order), one round trip after the ticket.
#
#   sorted_ids past num_post_pad is left unwritten (consumers read only the used part); expert_ids past the used
#   blocks are always set to -1 (short).
# ------------------------------------------------------------------------------------------------------------------
@triton.jit
def _align_pairwise(ids_v, slot_v, sorted_ptr, eids_ptr, npad_ptr, S, max_blocks, B: tl.constexpr,
                    PJ: tl.constexpr, CHUNK: tl.constexpr):
    """Alignment of the flat [SP] slot vector ``slot_v`` with experts ``ids_v`` (-1: skipped), all in registers."""
    ok = ids_v >= 0
    same = (ids_v[:, None] == ids_v[None, :]) & ok[:, None] & ok[None, :]
    cnt = tl.sum(same.to(tl.int32), axis=1)
    rank = tl.sum((same & (slot_v[None, :] < slot_v[:, None])).to(tl.int32), axis=1)
    first = ok & (rank == 0)
    padded = (cnt + B - 1) // B * B
    lower = (ids_v[None, :] < ids_v[:, None]) & first[None, :]
    offs = tl.sum(tl.where(lower, padded[None, :], 0), axis=1)
    total = tl.sum(tl.where(first, padded, 0), axis=0)
    _write_runs(sorted_ptr, eids_ptr, npad_ptr, offs, rank, cnt, padded, first, ok, slot_v, ids_v, total, S,
                max_blocks, B, PJ, CHUNK)


@triton.jit
def _write_runs(sorted_ptr, eids_ptr, npad_ptr, start, rank, cnt, padded, first, ok, slot, expert, total, S,
                max_blocks, B: tl.constexpr, PJ: tl.constexpr, CHUNK: tl.constexpr):
    """Write an alignment from per-slot vectors: each slot's place ``start + rank`` (``start``: its expert's first
    padded entry; ``ok``: the slot has an expert), and, from the first slot of each expert (``first``), the
    expert's padding (``padded - cnt`` sentinels) and its block ids; then the used length and the expert_ids
    tail."""
    tl.store(sorted_ptr + start + rank, slot, mask=ok)
    _write_pads(sorted_ptr, start, cnt, padded, first, S, B, PJ)  # each expert's padding, by its first slot
    nblk = padded // B
    for j in range(0, tl.max(tl.where(first, nblk, 0), axis=0)):
        tl.store(eids_ptr + start // B + j, expert, mask=first & (j < nblk))
    tl.store(npad_ptr, total)
    _fill_tails(sorted_ptr, eids_ptr, total, S, max_blocks, B, CHUNK, False)


@triton.jit
def _write_pads(sorted_ptr, start, cnt, padded, lead, S, B: tl.constexpr, PJ: tl.constexpr):
    """The sentinel S over each run's padding, sorted_ids[start + cnt .. start + padded), for the entries of the
    per-run vectors where ``lead`` is set (one entry per expert), PJ sentinels per store."""
    oj = tl.arange(0, PJ)
    for j0 in range(0, B - 1, PJ):
        jj = j0 + oj
        tl.store(sorted_ptr + (start + cnt)[:, None] + jj[None, :], S,
                 mask=lead[:, None] & (jj[None, :] < (padded - cnt)[:, None]))


@triton.jit
def _fill_tails(sorted_ptr, eids_ptr, total, S, max_blocks, B: tl.constexpr, CHUNK: tl.constexpr,
                FILL_TAIL: tl.constexpr):
    """-1 over expert_ids past the used blocks; with FILL_TAIL (the general kernel) also the sentinel S over
    sorted_ids past the used part."""
    ob = tl.arange(0, CHUNK)
    for b0 in range(total // B, max_blocks, CHUNK):
        tl.store(eids_ptr + b0 + ob, -1, mask=b0 + ob < max_blocks)
    if FILL_TAIL:
        for t0 in range(total, max_blocks * B, CHUNK):
            tl.store(sorted_ptr + t0 + ob, S, mask=t0 + ob < max_blocks * B)


@triton.jit
def _run_count(ka, ca, kb, cb):
    """Combine of a segmented count over sorted keys: (key of the right part, its trailing run's count, plus the left
    part's when both end in the same key). Associative because equal keys are contiguous."""
    return kb, tl.where(ka == kb, ca + cb, cb)


@triton.jit
def _align_sorted(ids_v, sorted_ptr, eids_ptr, npad_ptr, S, max_blocks, EA: tl.constexpr, B: tl.constexpr,
                  SP: tl.constexpr, PJ: tl.constexpr, CHUNK: tl.constexpr):
    """Alignment of the flat [SP] slot vector (slot s has expert ``ids_v[s]``, -1 or >= EA: none) by one sort:

        key[s] = id[s] * SP + s, sorted ascending (slots without an expert last)
        rank = position inside its expert's run (forward segmented count - 1), cnt = run length (+ backward count)
        pad = ceil(cnt / B) * B;  base = sum of pad over the earlier runs (cumsum of pad at each run's first slot)
        sorted_ids[base + rank] = s

    O(SP log^2 SP) work in registers, no atomics, slots in increasing slot id inside an expert (exact order)."""
    pos = tl.arange(0, SP)
    ok0 = (ids_v >= 0) & (ids_v < EA)
    key = tl.sort(tl.where(ok0, ids_v * SP + pos, EA * SP + pos))
    sid = key // SP
    slot = key % SP
    ok = sid < EA
    one = tl.full([SP], 1, tl.int32)
    _, fwd = tl.associative_scan((sid, one), 0, _run_count)
    # the same count from the other end (on the flipped keys): the run's slots at and after this one
    _, bwd = tl.associative_scan((tl.flip(sid, 0), one), 0, _run_count)
    bwd = tl.flip(bwd, 0)
    rank = fwd - 1
    cnt = fwd + bwd - 1
    padded = (cnt + B - 1) // B * B
    first = ok & (rank == 0)
    lead = tl.where(first, padded, 0)
    base = tl.cumsum(lead, axis=0) - padded  # the run's own pad is in the inclusive sum from its first slot on
    total = tl.sum(lead, axis=0)
    _write_runs(sorted_ptr, eids_ptr, npad_ptr, base, rank, cnt, padded, first, ok, slot, sid, total, S, max_blocks,
                B, PJ, CHUNK)


@triton.jit
def _popc64(x):
    """Set bits of each int64 in ``x`` (int32), by the SWAR bit count on its uint64 image."""
    u = x.to(tl.uint64, bitcast=True)
    u = u - ((u >> 1) & 0x5555555555555555)
    u = (u & 0x3333333333333333) + ((u >> 2) & 0x3333333333333333)
    u = (u + (u >> 4)) & 0x0F0F0F0F0F0F0F0F
    return ((u * 0x0101010101010101) >> 56).to(tl.int32)


@triton.jit
def _mask_rank(mk, safe, row):
    """Each slot's rank inside its expert from the row masks ``mk`` [EAP]: the rows below ``row`` (int, < 64) in the
    mask of its expert ``safe``."""
    below = (tl.full(safe.shape, 1, tl.int64) << row.to(tl.int64)) - 1
    return _popc64(tl.gather(mk, safe, 0) & below)


@triton.jit
def _align_masks(ids_ptr, mask_ptr, sorted_ptr, eids_ptr, npad_ptr, offs_ptr, S, max_blocks, TOP_K: tl.constexpr,
                 EA: tl.constexpr, EAP: tl.constexpr, B: tl.constexpr, SP: tl.constexpr, PJ: tl.constexpr,
                 CHUNK: tl.constexpr):
    """Alignment from the per-expert row masks (bit r of ``mask[e]``: row r chose expert e; M <= 64) and the slots'
    ids, both loaded once (independent loads, one round trip):

        cnt[e] = popc(mask[e]);  offs = exclusive cumsum of ceil(cnt / B) * B
        slot s = r * TOP_K + k with expert e:  rank = popc(mask[e] & (2^r - 1)),  sorted_ids[offs[e] + rank] = s

    A row chooses an expert at most once, so the slots inside an expert come in increasing slot id (exact order).
    The masks are zeroed again for the next call."""
    e = tl.arange(0, EAP)
    emask = e < EA
    mk = tl.load(mask_ptr + e, mask=emask, other=0, cache_modifier=".cg")
    sl = tl.arange(0, SP)
    ids = tl.load(ids_ptr + sl, mask=sl < S, other=-1, cache_modifier=".cg")
    ok = (sl < S) & (ids >= 0) & (ids < EA)
    cnt = _popc64(mk)
    safe = tl.where(ok, ids, 0)
    rank = _mask_rank(mk, safe, tl.where(ok, sl // TOP_K, 0))
    padded, offs, total = _expert_blocks(cnt, e, emask, npad_ptr, offs_ptr, eids_ptr, B)
    _write_pads(sorted_ptr, offs, cnt, padded, emask, S, B, PJ)
    _fill_tails(sorted_ptr, eids_ptr, total, S, max_blocks, B, CHUNK, False)
    tl.store(sorted_ptr + tl.gather(offs, safe, 0) + rank, sl, mask=ok)
    tl.debug_barrier()  # every thread's reads of the masks precede their reset
    tl.store(mask_ptr + e, tl.zeros([EAP], tl.int64), mask=emask)


@triton.jit(do_not_specialize=["M", "S", "max_blocks"])
def _moe_route_align_fast_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, rank_ptr, sorted_ptr, eids_ptr, npad_ptr,
                                 count_ptr, offs_ptr, ticket_ptr, M, S, max_blocks, stride_lm, scale,
                                 E: tl.constexpr, EP: tl.constexpr, ROWS: tl.constexpr, TOP_K: tl.constexpr,
                                 TOPK_P: tl.constexpr, N_GROUP: tl.constexpr, NG_P: tl.constexpr,
                                 GSIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, SOFTMAX: tl.constexpr,
                                 HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, DO_ROUTE: tl.constexpr,
                                 EA: tl.constexpr, EAP: tl.constexpr, B: tl.constexpr, SP: tl.constexpr,
                                 ONE: tl.constexpr, PJ: tl.constexpr, CHUNK: tl.constexpr,
                                 RELOAD: tl.constexpr = False, SORTED: tl.constexpr = False,
                                 MASK: tl.constexpr = False, PDL: tl.constexpr = False):
    """ONE: grid (1,), ROWS >= M (routing) or SP >= S (alignment only). Not ONE: routing on, grid (ceil(M/ROWS),),
    SP >= S; the ticket (and, without SORTED, the workspace counters) are zero on entry and left at zero.

    SORTED (not ONE): the routing programs only store their ids; the last one (ticket) loads every slot's id once
    and aligns by one sort in registers (_align_sorted: no atomic ranks, exact slot order). MASK (not ONE, M <= 64):
    the routing programs set their row's bit in each chosen expert's int64 row mask (``count_ptr``, zero between
    calls); the last one loads masks and ids once and aligns from them (_align_masks: exact slot order). Otherwise:
    atomic ranks in the routing programs, and the last program scans the counters and scatters."""
    pdl_enter(PDL)  # logits (and the workspace) belong to earlier kernels
    pid = tl.program_id(0)
    if ONE:
        if DO_ROUTE:
            ids2 = _route_rows(logits_ptr, bias_ptr, ids_ptr, w_ptr, count_ptr, rank_ptr, 0, M, stride_lm, scale,
                               0, E, EP, ROWS, TOP_K, TOPK_P, N_GROUP, NG_P, GSIZE, TOPK_GROUP, SOFTMAX, HAS_BIAS,
                               RENORM, False, TOP_K)
            if RELOAD:
                # read the stored winners back as one flat vector (see RELOAD in the launcher)
                tl.debug_barrier()
                slot_v = tl.arange(0, SP)
                ids_v = tl.load(ids_ptr + slot_v, mask=slot_v < S, other=-1, cache_modifier=".cg")
                ids_v = tl.where((ids_v >= 0) & (ids_v < EA), ids_v, -1)
            else:
                ids2 = tl.where(ids2 < EA, ids2, -1)
                slot2 = tl.arange(0, ROWS)[:, None] * TOP_K + tl.arange(0, TOPK_P)[None, :]
                ids_v = tl.reshape(ids2, [SP])
                slot_v = tl.reshape(slot2, [SP])
        else:
            slot_v = tl.arange(0, SP)
            ids_v = tl.load(ids_ptr + slot_v, mask=slot_v < S, other=-1)
            ids_v = tl.where((ids_v >= 0) & (ids_v < EA), ids_v, -1)
        _align_pairwise(ids_v, slot_v, sorted_ptr, eids_ptr, npad_ptr, S, max_blocks, B, PJ, CHUNK)
    else:
        _route_rows(logits_ptr, bias_ptr, ids_ptr, w_ptr, count_ptr, rank_ptr, pid * ROWS, M, stride_lm, scale,
                    0, E, EP, ROWS, TOP_K, TOPK_P, N_GROUP, NG_P, GSIZE, TOPK_GROUP, SOFTMAX, HAS_BIAS, RENORM,
                    not SORTED, TOP_K, MASK)
        tl.debug_barrier()  # this program's ids (and ranks and counter updates) precede its ticket
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
        if ticket == tl.num_programs(0) - 1:
            sl = tl.arange(0, SP)
            if MASK:
                _align_masks(ids_ptr, count_ptr, sorted_ptr, eids_ptr, npad_ptr, offs_ptr, S, max_blocks, TOP_K, EA,
                             EAP, B, SP, PJ, CHUNK)
            elif SORTED:
                ids = tl.load(ids_ptr + sl, mask=sl < S, other=-1, cache_modifier=".cg")
                _align_sorted(ids, sorted_ptr, eids_ptr, npad_ptr, S, max_blocks, EA, B, SP, PJ, CHUNK)
            else:
                e = tl.arange(0, EAP)
                emask = e < EA
                # one round trip: ids, ranks and counters are independent loads
                ids = tl.load(ids_ptr + sl, mask=sl < S, other=-1, cache_modifier=".cg")
                cnt = tl.load(count_ptr + e, mask=emask, other=0, cache_modifier=".cg")
                ok = (sl < S) & (ids >= 0) & (ids < EA)
                rk = tl.load(rank_ptr + sl, mask=ok, other=0, cache_modifier=".cg")
                padded, offs, total = _expert_blocks(cnt, e, emask, npad_ptr, offs_ptr, eids_ptr, B)
                _write_pads(sorted_ptr, offs, cnt, padded, emask, S, B, PJ)
                _fill_tails(sorted_ptr, eids_ptr, total, S, max_blocks, B, CHUNK, False)
                base = tl.gather(offs, tl.where(ok, ids, 0), 0)  # each slot's expert start, from registers
                tl.store(sorted_ptr + base + rk, sl, mask=ok)
                tl.store(count_ptr + e, tl.zeros([EAP], tl.int32), mask=emask)
            tl.atomic_xchg(ticket_ptr, 0)


@triton.jit(do_not_specialize=["M", "shared_id"])
def _append_shared_kernel(ids_ptr, w_ptr, out_ids_ptr, out_w_ptr, M, shared_id, stride_ids, stride_w,
                          TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out_ids[m] = [ids[m, :TOP_K], shared_id], out_w[m] = [w[m, :TOP_K], 1.0]: the shared expert as one more slot
    of every token, so one expert pass serves routed and shared experts."""
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * (TOP_K + 1)
    row = offs // (TOP_K + 1)
    col = offs % (TOP_K + 1)
    routed = mask & (col < TOP_K)
    i = tl.load(ids_ptr + row * stride_ids + col, mask=routed, other=0).to(tl.int32)
    w = tl.load(w_ptr + row * stride_w + col, mask=routed, other=0.0).to(tl.float32)
    tl.store(out_ids_ptr + offs, tl.where(col < TOP_K, i, shared_id), mask=mask)
    tl.store(out_w_ptr + offs, tl.where(col < TOP_K, w, 1.0), mask=mask)
