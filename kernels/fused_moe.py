"""SwiGLU experts built for small M (the verify pass): each activated expert's weights streamed from HBM once.

Math, for a routed slot ``s = m * TOP_K + k`` with expert ``e = topk_ids[m, k]`` and weight ``r = topk_w[m, k]``:

    gate_up[s] = hidden[m] @ w13[e]^T                      (fp32 accumulate; w13[e] rows 0..I-1 gate, I..2I-1 up)
    act[s]     = silu(gate_up[s, :I]) * gate_up[s, I:]     (stored in the weights' dtype)
    part[s]    = r * (act[s] @ w2[e]^T)                    (fp32)
    out[m]     = sum_k part[m * TOP_K + k]                 (fixed k order: deterministic; slots with id -1 skipped)

Three launches: ``_moe_gate_up_kernel`` (grid: blocks x I-tiles x SPLIT_K), ``_moe_down_kernel`` (grid: blocks x H-tiles),
``_moe_topk_sum_kernel`` (grid: M x H-tiles). A program owns one block of BLOCK_M slots of one expert (from the
alignment) and one tile of output columns, so every weight element of an activated expert is loaded by exactly one
program per block: with tiny M an expert has one block and its weights are read once. Narrow I-tiles in the first
GEMM (gate and up tiles of BLOCK_N rows each) give enough programs to stream the weights at small M. Blocks past
the used part (expert id -1) exit at once, so the grid is fixed for a given M (CUDA-graph capturable). At tiny M
(one block per expert) the gate/up GEMM also splits H over ``SPLIT_K`` programs so that enough weight loads are in
flight; their fp32 partials ``gu`` [SPLIT_K, S, 2I] are summed by the down kernel in a fixed order (deterministic).

An opt-in GEMV variant for M <= 4 (``_moe_gemv_gate_up_kernel`` + ``_moe_gemv_down_sum_kernel``, end of this
file) uses no tl.dot, needs no ``part`` buffer and sums over top_k inside the down GEMV (two launches).

The weight-streaming variant, the default for M <= 6 (``_moe_stream_gate_up_kernel`` + ``_moe_stream_down_kernel``,
end of this file, section "Stream variant"), is built to keep enough weight bytes in flight at a few tokens: small
programs, FMA GEMVs, a prefetched H loop, and the down projection of every slot plus the top-k sum in one gather.

Weight tiles come from ``_load_w_tile``; a quantised format (W4A16, group 32) is meant to add a branch there that
loads packed nibbles and scales and dequantises into the same [BLOCK_N, BLOCK_K] tile, leaving the callers as is.

Tensors (S = M * TOP_K; NB = number of blocks; B = BLOCK_M):

| name        | shape        | dtype      | meaning                                                        |
| ----------- | ------------ | ---------- | -------------------------------------------------------------- |
| hidden      | [M, H]       | bf16/fp16  | token activations, unit column stride                          |
| w13         | [E, 2I, H]   | as hidden  | gate rows then up rows of each expert, unit column stride      |
| w2          | [E, H, I]    | as hidden  | down projection, unit column stride                            |
| sorted_ids  | [NB * B]     | int32      | slots grouped by expert; S = padding                           |
| expert_ids  | [NB]         | int32      | expert of each block; -1 = unused block                        |
| num_post_pad| [1]          | int32      | used length of sorted_ids                                      |
| topk_ids    | [M, TOP_K]   | int32      | expert of each slot (-1 or >= E: none)                         |
| topk_w      | [M, TOP_K]   | fp32       | routed weight of each slot                                     |
| act         | [S, I]       | as hidden  | SwiGLU output per slot (SPLIT_K == 1)                          |
| gu          | [SPLIT_K, S, 2I] | fp32   | partial gate/up sums per H split (SPLIT_K > 1), in act's place |
| part        | [S, H]       | fp32       | weighted expert output per slot                                |
| out         | [M, H]       | as hidden  | result                                                         |
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _load_w_tile(w_ptr, rows, cols, row_mask, col_mask, stride_row):
    """A [len(rows), len(cols)] tile of an expert's weight matrix (unquantised)."""
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_row + cols[None, :],
                   mask=row_mask[:, None] & col_mask[None, :], other=0.0)


@triton.jit
def _mma(a, w, acc, UPCAST: tl.constexpr):
    """acc += a @ w^T. UPCAST (interpreter only: its bf16 dot is wrong) multiplies in fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
    return tl.dot(a, tl.trans(w), acc)


@triton.jit(do_not_specialize=["S"])
def _moe_gate_up_kernel(hidden_ptr, w13_ptr, act_ptr, sorted_ptr, eids_ptr, npad_ptr, S, stride_hm, stride_we,
                        stride_wn, stride_am, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                        SPLIT_K: tl.constexpr = 1):
    """SPLIT_K == 1: act[s] = silu(gate) * up. SPLIT_K > 1: program ``ks`` of a tile writes its fp32 partial gate and
    up sums over its share of H to ``act_ptr`` viewed as gu [SPLIT_K, S, 2I] (row stride ``stride_am`` = 2I); the
    down kernel adds the partials in a fixed order and applies the activation (deterministic, no atomics)."""
    pid = tl.program_id(0)
    n_tiles: tl.constexpr = (I + BLOCK_N - 1) // BLOCK_N
    ks = pid % SPLIT_K
    blk = pid // (n_tiles * SPLIT_K)
    pid_n = (pid // SPLIT_K) % n_tiles
    if blk * BLOCK_M >= tl.load(npad_ptr):
        return
    e = tl.load(eids_ptr + blk)
    if e < 0:
        return
    om = tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + blk * BLOCK_M + om)
    valid = slots < S
    tok = tl.where(valid, slots // TOP_K, 0)
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = on < I
    ok = tl.arange(0, BLOCK_K)
    w_base = w13_ptr + e.to(tl.int64) * stride_we
    a_base = hidden_ptr + tok[:, None].to(tl.int64) * stride_hm
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_per: tl.constexpr = ((H + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    k_lo = ks * k_per
    for k0 in range(k_lo, tl.minimum(k_lo + k_per, H), BLOCK_K):
        kc = k0 + ok
        kmask = kc < H
        a = tl.load(a_base + kc[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
        wg = _load_w_tile(w_base, on, kc, nmask, kmask, stride_wn)
        wu = _load_w_tile(w_base, on + I, kc, nmask, kmask, stride_wn)
        acc_g = _mma(a, wg, acc_g, UPCAST)
        acc_u = _mma(a, wu, acc_u, UPCAST)
    srow = tl.where(valid, slots, 0)[:, None].to(tl.int64)
    smask = valid[:, None] & nmask[None, :]
    if SPLIT_K == 1:
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(act_ptr + srow * stride_am + on[None, :], act.to(act_ptr.dtype.element_ty), mask=smask)
    else:
        dst = act_ptr + (ks * S + srow) * stride_am + on[None, :]
        tl.store(dst, acc_g, mask=smask)
        tl.store(dst + I, acc_u, mask=smask)


@triton.jit(do_not_specialize=["S"])
def _moe_down_kernel(act_ptr, w2_ptr, part_ptr, tw_ptr, sorted_ptr, eids_ptr, npad_ptr, S, stride_am, stride_we,
                     stride_wn, stride_pm, H: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, SPLIT_K: tl.constexpr = 1):
    """SPLIT_K == 1: ``act_ptr`` is act [S, I]. SPLIT_K > 1: it is the fp32 gu [SPLIT_K, S, 2I] partials of the
    gate/up kernel; they are summed in split order and the activation is applied (rounded to the weights' dtype,
    as the SPLIT_K == 1 path stores it)."""
    pid = tl.program_id(0)
    n_tiles: tl.constexpr = (H + BLOCK_N - 1) // BLOCK_N
    blk = pid // n_tiles
    pid_n = pid % n_tiles
    if blk * BLOCK_M >= tl.load(npad_ptr):
        return
    e = tl.load(eids_ptr + blk)
    if e < 0:
        return
    om = tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + blk * BLOCK_M + om)
    valid = slots < S
    srow = tl.where(valid, slots, 0)
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = on < H
    ok = tl.arange(0, BLOCK_K)
    w_base = w2_ptr + e.to(tl.int64) * stride_we
    a_base = act_ptr + srow[:, None].to(tl.int64) * stride_am
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kc = k0 + ok
        kmask = kc < I
        amask = valid[:, None] & kmask[None, :]
        if SPLIT_K == 1:
            a = tl.load(a_base + kc[None, :], mask=amask, other=0.0)
        else:
            g = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
            u = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
            for t in tl.static_range(SPLIT_K):
                g += tl.load(a_base + (S * t).to(tl.int64) * stride_am + kc[None, :], mask=amask, other=0.0)
                u += tl.load(a_base + (S * t).to(tl.int64) * stride_am + I + kc[None, :], mask=amask, other=0.0)
            a = (g / (1.0 + tl.exp(-g)) * u).to(w2_ptr.dtype.element_ty)
        w = _load_w_tile(w_base, on, kc, nmask, kmask, stride_wn)
        acc = _mma(a, w, acc, UPCAST)
    r = tl.load(tw_ptr + srow, mask=valid, other=0.0).to(tl.float32)
    acc = acc * r[:, None]
    dst = part_ptr + srow[:, None].to(tl.int64) * stride_pm + on[None, :]
    tl.store(dst, acc, mask=valid[:, None] & nmask[None, :])


@triton.jit
def _moe_topk_sum_kernel(part_ptr, ids_ptr, out_ptr, stride_pm, stride_om, E: tl.constexpr, H: tl.constexpr,
                         TOP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    m = tl.program_id(0)
    on = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = on < H
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k in tl.static_range(TOP_K):
        s = m * TOP_K + k
        eid = tl.load(ids_ptr + s + tl.zeros([BLOCK_N], tl.int32))  # as a vector: mask of the row load
        v = tl.load(part_ptr + s.to(tl.int64) * stride_pm + on, mask=nmask & (eid >= 0) & (eid < E), other=0.0)
        acc += v
    tl.store(out_ptr + m.to(tl.int64) * stride_om + on, acc.to(out_ptr.dtype.element_ty), mask=nmask)


# ------------------------------------------------------------------------------------------------------------------
# GEMV variant (opt-in, small M): no tl.dot. Two launches, no ``part`` buffer:
#
#   _moe_gemv_gate_up_kernel  grid (NB * n_tiles,): program (blk, t) streams rows [t*BLOCK_N, (t+1)*BLOCK_N) of the
#       gate and of the up half of w13[e] over all of H in [BLOCK_N, BLOCK_K] tiles (unit stride along K: 16-byte
#       vector loads) and computes act[s] = silu(gate) * up for the block's slots, MP slots at a time (an expert
#       normally holds <= M slots, so one pass; more slots, e.g. a token listing an expert twice, take more passes).
#       ALIGNED: blocks come from the alignment (each activated expert's weights read once). Not ALIGNED: a "block"
#       is one slot s with expert topk_ids[s] (no alignment needed; an expert chosen by several tokens is read
#       once per slot, mostly from L2).
#   _moe_gemv_down_sum_kernel grid (M * n_tiles2,): program (m, t) computes
#       out[m, tile] = sum_k r[m, k] * (w2[e_k][tile, :] @ act[m * TOP_K + k])  in fixed k order (deterministic),
#       skipping slots whose id is -1 or >= E: the routed weight and the top-k reduction live in the down GEMV.
#
# fp32 products and sums; act is stored in the weights' dtype as in the tl.dot path. UPCAST is not needed (no dot).
# ------------------------------------------------------------------------------------------------------------------
@triton.jit
def _unit_expert(unit, sorted_ptr, eids_ptr, npad_ptr, ids_ptr, S, B: tl.constexpr, ALIGNED: tl.constexpr):
    """(expert, real slots) of one work unit of the GEMV-style kernels: an alignment block, or one routed slot
    without alignment. A block past the used part gets expert -1 (its program exits) and no slot load."""
    if ALIGNED:
        npad = tl.load(npad_ptr)  # a multiple of B: a block lies wholly before it or wholly past it
        e = tl.where(unit * B < npad, tl.load(eids_ptr + unit), -1)  # the grid never passes expert_ids' length
        # a block's real slots come first, its padding (the sentinel S) after: count them with one load
        pos = unit * B + tl.arange(0, B)
        n_valid = tl.sum((tl.load(sorted_ptr + pos, mask=pos < npad, other=S) < S).to(tl.int32), axis=0)
    else:
        e = tl.load(ids_ptr + unit)
        n_valid = 1
    return e, n_valid


@triton.jit
def _unit_slots(unit, p0, om, n_valid, sorted_ptr, S, B: tl.constexpr, ALIGNED: tl.constexpr):
    """Slot ids p0 + om of a work unit (the sentinel S past its real slots)."""
    if ALIGNED:
        slots = tl.load(sorted_ptr + unit * B + p0 + om, mask=p0 + om < n_valid, other=S)
    else:
        slots = tl.where(om == 0, unit, S)
    return slots


@triton.jit(do_not_specialize=["S"])
def _moe_gemv_gate_up_kernel(hidden_ptr, w13_ptr, act_ptr, sorted_ptr, eids_ptr, npad_ptr, ids_ptr, S, stride_hm,
                             stride_we, stride_wn, stride_am, E: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                             TOP_K: tl.constexpr, B: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles: tl.constexpr = (I + BLOCK_N - 1) // BLOCK_N
    blk = pid // n_tiles
    pid_n = pid % n_tiles
    om = tl.arange(0, MP)
    e, n_valid = _unit_expert(blk, sorted_ptr, eids_ptr, npad_ptr, ids_ptr, S, B, ALIGNED)
    if (e < 0) | (e >= E):
        return
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = on < I
    ok = tl.arange(0, BLOCK_K)
    w_base = w13_ptr + e.to(tl.int64) * stride_we
    for p0 in range(0, n_valid, MP):  # one pass unless the expert holds more than MP slots
        slots = _unit_slots(blk, p0, om, n_valid, sorted_ptr, S, B, ALIGNED)
        valid = slots < S
        tok = tl.where(valid, slots // TOP_K, 0)
        a_base = hidden_ptr + tok.to(tl.int64) * stride_hm
        acc_g = tl.zeros([MP, BLOCK_N, BLOCK_K], tl.float32)
        acc_u = tl.zeros([MP, BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kc = k0 + ok
            kmask = kc < H
            a = tl.load(a_base[:, None] + kc[None, :], mask=valid[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            wg = _load_w_tile(w_base, on, kc, nmask, kmask, stride_wn).to(tl.float32)
            wu = _load_w_tile(w_base, on + I, kc, nmask, kmask, stride_wn).to(tl.float32)
            acc_g += a[:, None, :] * wg[None, :, :]
            acc_u += a[:, None, :] * wu[None, :, :]
        g = tl.sum(acc_g, axis=2)
        u = tl.sum(acc_u, axis=2)
        act = g / (1.0 + tl.exp(-g)) * u
        srow = tl.where(valid, slots, 0).to(tl.int64)
        tl.store(act_ptr + srow[:, None] * stride_am + on[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=valid[:, None] & nmask[None, :])


@triton.jit
def _moe_gemv_down_sum_kernel(act_ptr, w2_ptr, ids_ptr, tw_ptr, out_ptr, stride_am, stride_we, stride_wn,
                              stride_om, E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles: tl.constexpr = (H + BLOCK_N - 1) // BLOCK_N
    m = pid // n_tiles
    on = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = on < H
    ok = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in tl.static_range(TOP_K):
        s = m * TOP_K + k
        e = tl.load(ids_ptr + s)
        use = (e >= 0) & (e < E)
        r = tl.where(use, tl.load(tw_ptr + s).to(tl.float32), 0.0)
        ev = tl.load(ids_ptr + s + tl.zeros([BLOCK_K], tl.int32))  # as a vector: the interpreter's masks need one
        use_v = (ev >= 0) & (ev < E)
        w_base = w2_ptr + tl.where(use, e, 0).to(tl.int64) * stride_we
        for k0 in range(0, I, BLOCK_K):
            kc = k0 + ok
            kmask = (kc < I) & use_v
            a = tl.load(act_ptr + s.to(tl.int64) * stride_am + kc, mask=kmask, other=0.0).to(tl.float32) * r
            w = _load_w_tile(w_base, on, kc, nmask, kmask, stride_wn).to(tl.float32)
            acc += w * a[None, :]
    res = tl.sum(acc, axis=1)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + on, res.to(out_ptr.dtype.element_ty), mask=nmask)


# ------------------------------------------------------------------------------------------------------------------
# Fused variant (``_moe_fused_kernel`` + ``_moe_partial_sum_kernel``): every activated expert's w13 and w2 streamed
# exactly once, in one launch, with no intermediate buffer between the two projections.
#
#   _moe_fused_kernel  grid (NB * NC,), NC = ceil(I / BI): program (blk, c) owns the block's slots and the
#       intermediate columns J = [c*BI, (c+1)*BI):
#           g, u      = hidden[tok] @ w13[e][J]^T, hidden[tok] @ w13[e][I + J]^T      (over all of H, BK at a time)
#           act       = silu(g) * u                                                 (rounded to the weights' dtype)
#           part[s, c, h-tile] = r[s] * act @ w2[e][h-tile, J]^T                     (fp32, BH rows of H at a time)
#       DOT: tl.dot on the block's B rows (B >= 16). Not DOT (GEMV form, small M): MP slots per pass, products and
#       sums in fp32 registers (an expert holding more than MP slots of the block takes more passes).
#   _moe_partial_sum_kernel grid (M, ceil(H / BN)):
#           out[m, tile] = sum_k sum_c part[m * TOP_K + k, c, tile]   in fixed (k, c) order; slots whose id is -1
#           or >= E are skipped (they have no block, so their rows of part are never written).
#
# w2's slice [H, BI] is strided: BI contiguous elements (2 * BI bytes) per row of H; BI >= 32 keeps whole 64-byte
# segments. Extra tensor: part [S, NC, H] fp32 (weighted partial outputs, one per slot and column chunk).
# ------------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["S"])
def _moe_fused_kernel(hidden_ptr, w13_ptr, w2_ptr, part_ptr, tw_ptr, sorted_ptr, eids_ptr, npad_ptr, S, stride_hm,
                      stride_w13e, stride_w13n, stride_w2e, stride_w2n, stride_ps, stride_pc, H: tl.constexpr,
                      I: tl.constexpr, TOP_K: tl.constexpr, B: tl.constexpr, MP: tl.constexpr, BI: tl.constexpr,
                      BK: tl.constexpr, BH: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    NC: tl.constexpr = (I + BI - 1) // BI
    blk = pid // NC
    c = pid % NC
    if blk * B >= tl.load(npad_ptr):
        return
    e = tl.load(eids_ptr + blk)
    if e < 0:
        return
    oi = c * BI + tl.arange(0, BI)
    imask = oi < I
    ok = tl.arange(0, BK)
    oh = tl.arange(0, BH)
    w13_base = w13_ptr + e.to(tl.int64) * stride_w13e
    w2_base = w2_ptr + e.to(tl.int64) * stride_w2e
    if DOT:
        om = tl.arange(0, B)
        slots = tl.load(sorted_ptr + blk * B + om)
        valid = slots < S
        tok = tl.where(valid, slots // TOP_K, 0)
        a_base = hidden_ptr + tok[:, None].to(tl.int64) * stride_hm
        acc_g = tl.zeros([B, BI], tl.float32)
        acc_u = tl.zeros([B, BI], tl.float32)
        for k0 in range(0, H, BK):
            kc = k0 + ok
            kmask = kc < H
            a = tl.load(a_base + kc[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
            wg = _load_w_tile(w13_base, oi, kc, imask, kmask, stride_w13n)
            wu = _load_w_tile(w13_base, oi + I, kc, imask, kmask, stride_w13n)
            acc_g = _mma(a, wg, acc_g, UPCAST)
            acc_u = _mma(a, wu, acc_u, UPCAST)
        act = (acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(w2_ptr.dtype.element_ty)
        srow = tl.where(valid, slots, 0).to(tl.int64)
        r = tl.load(tw_ptr + srow, mask=valid, other=0.0).to(tl.float32)
        dst = part_ptr + srow[:, None] * stride_ps + c * stride_pc
        for h0 in range(0, H, BH):
            hc = h0 + oh
            hmask = hc < H
            w = _load_w_tile(w2_base, hc, oi, hmask, imask, stride_w2n)
            y = _mma(act, w, tl.zeros([B, BH], tl.float32), UPCAST) * r[:, None]
            tl.store(dst + hc[None, :], y, mask=valid[:, None] & hmask[None, :])
    else:
        om = tl.arange(0, MP)
        # a block's real slots come first, its padding (the sentinel S) after: count them with one load
        n_valid = tl.sum((tl.load(sorted_ptr + blk * B + tl.arange(0, B)) < S).to(tl.int32), axis=0)
        for p0 in range(0, n_valid, MP):
            slots = tl.load(sorted_ptr + blk * B + p0 + om, mask=p0 + om < n_valid, other=S)
            valid = slots < S
            tok = tl.where(valid, slots // TOP_K, 0)
            a_base = hidden_ptr + tok.to(tl.int64) * stride_hm
            acc_g = tl.zeros([MP, BI, BK], tl.float32)
            acc_u = tl.zeros([MP, BI, BK], tl.float32)
            for k0 in range(0, H, BK):
                kc = k0 + ok
                kmask = kc < H
                a = tl.load(a_base[:, None] + kc[None, :], mask=valid[:, None] & kmask[None, :],
                            other=0.0).to(tl.float32)
                wg = _load_w_tile(w13_base, oi, kc, imask, kmask, stride_w13n).to(tl.float32)
                wu = _load_w_tile(w13_base, oi + I, kc, imask, kmask, stride_w13n).to(tl.float32)
                acc_g += a[:, None, :] * wg[None, :, :]
                acc_u += a[:, None, :] * wu[None, :, :]
            g = tl.sum(acc_g, axis=2)
            u = tl.sum(acc_u, axis=2)
            act = (g / (1.0 + tl.exp(-g)) * u).to(w2_ptr.dtype.element_ty).to(tl.float32)  # [MP, BI]
            srow = tl.where(valid, slots, 0).to(tl.int64)
            r = tl.load(tw_ptr + srow, mask=valid, other=0.0).to(tl.float32)
            act = act * r[:, None]
            dst = part_ptr + srow[:, None] * stride_ps + c * stride_pc
            for h0 in range(0, H, BH):
                hc = h0 + oh
                hmask = hc < H
                w = _load_w_tile(w2_base, hc, oi, hmask, imask, stride_w2n).to(tl.float32)  # [BH, BI]
                y = tl.sum(act[:, None, :] * w[None, :, :], axis=2)  # [MP, BH]
                tl.store(dst + hc[None, :], y, mask=valid[:, None] & hmask[None, :])


@triton.jit
def _moe_partial_sum_kernel(part_ptr, ids_ptr, out_ptr, stride_ps, stride_pc, stride_om, E: tl.constexpr,
                            H: tl.constexpr, TOP_K: tl.constexpr, NC: tl.constexpr, BN: tl.constexpr):
    m = tl.program_id(0)
    on = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = on < H
    acc = tl.zeros([BN], tl.float32)
    for k in tl.static_range(TOP_K):
        s = m * TOP_K + k
        eid = tl.load(ids_ptr + s + tl.zeros([BN], tl.int32))  # as a vector: mask of the row loads
        use = nmask & (eid >= 0) & (eid < E)
        row = part_ptr + s.to(tl.int64) * stride_ps + on
        for c in range(NC):
            acc += tl.load(row + c * stride_pc, mask=use, other=0.0)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + on, acc.to(out_ptr.dtype.element_ty), mask=nmask)


# ------------------------------------------------------------------------------------------------------------------
# Stream variant (the default at M <= 6, see _STREAM_CONFIG): pure weight streaming at a few tokens.
#
# At M = 1 the expert GEMM is a GEMV: ~11 MB of weights per activated expert, 2 FLOPs per weight element. Its time
# is set by how many weight bytes are in flight (Little's law: ~4.2 TB/s x ~1 us loaded latency = ~4 MB GPU-wide,
# ~32 KB per SM), not by arithmetic. So: no tl.dot, fp32 FMA into element-wise accumulators (one reduction at the
# end), 16-byte vector loads along the contiguous H (or I) axis, small programs (few rows, 2-4 warps) so that
# several are resident per SM, and an explicitly double-buffered H loop (PREFETCH) so each program keeps two
# weight tiles in flight.
#
#   _moe_stream_gate_up_kernel  grid (U * NT,), NT = ceil(I / R). Program (u, t) streams gate rows
#       [t*R, (t+1)*R) and the same up rows of expert e over all of H in [R, BK] tiles and stores
#           act[s, rows] = silu(hidden[tok(s)] @ gate^T) * (hidden[tok(s)] @ up^T)     (fp32 sums, act in w's dtype)
#       ALIGNED: unit u is an alignment block (expert_ids[u]; its slots MP at a time, so an expert chosen by both
#       tokens is read once). Not ALIGNED: unit u is slot u with expert topk_ids[u] (no alignment needed; an expert
#       shared by two tokens is read twice, the second time mostly from L2 since all programs run in one wave).
#       With PDL it lets the down kernel launch at once (gdc_launch_dependents). With PDL_WAIT it is itself launched
#       as a programmatic dependent of the kernel before it (the router) and waits (gdc_wait) before anything else,
#       so the down kernel, whose w2 gather reads the ids before its own wait, cannot launch before the ids exist.
#   _moe_stream_down_kernel     grid (ceil(H / BH),). Program p owns output rows h in [p*BH, (p+1)*BH) and every
#       slot of every token at once (SP >= M * TOP_K lanes): one gathered [SP, BH, BI] load of w2[e_s][h, i] (each
#       activated expert's w2 rows read once), then
#           out[m, h] = sum_{s of token m} sum_i (r_s * act[s, i]) * w2[e_s][h, i]
#       (slots whose id is -1 or >= E masked out; fixed reduction order: deterministic, no atomics).
#       With PDL it is launched as a programmatic dependent: the w2 gather (independent of the gate/up kernel) is
#       issued before ``gdc_wait``, so the down grid's weight reads overlap the gate/up kernel's tail.
#
# Weight loads go through ``_load_w_tile`` (gate/up) and ``_load_w_gather`` (down): a W4A16 group-32 format would add
# a branch in those two helpers (packed nibbles + one scale per 32 elements along H or I), callers unchanged.
# ------------------------------------------------------------------------------------------------------------------
@triton.jit
def _load_w_gather(w_ptr, e, rows, cols, e_mask, row_mask, col_mask, stride_e, stride_row):
    """A [len(e), len(rows), len(cols)] gather of rows ``rows`` of experts ``e`` (unquantised)."""
    off = e[:, None, None].to(tl.int64) * stride_e + rows[None, :, None].to(tl.int64) * stride_row
    mask = e_mask[:, None, None] & row_mask[None, :, None] & col_mask[None, None, :]
    return tl.load(w_ptr + off + cols[None, None, :], mask=mask, other=0.0)


@triton.jit(do_not_specialize=["S"])
def _moe_stream_gate_up_kernel(hidden_ptr, w13_ptr, act_ptr, sorted_ptr, eids_ptr, npad_ptr, ids_ptr, S, stride_hm,
                               stride_we, stride_wn, stride_am, E: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                               TOP_K: tl.constexpr, B: tl.constexpr, MP: tl.constexpr, R: tl.constexpr,
                               BK: tl.constexpr, ALIGNED: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
                               PDL_WAIT: tl.constexpr = False):
    if PDL_WAIT:  # launched as a programmatic dependent itself: the router's ids (and the previous act) come first
        gdc_wait()
    if PDL:  # the down kernel may launch now: it gathers w2 first and waits (gdc_wait) before reading act
        gdc_launch_dependents()
    pid = tl.program_id(0)
    NT: tl.constexpr = (I + R - 1) // R
    unit = pid // NT
    t = pid % NT
    om = tl.arange(0, MP)
    e, n_valid = _unit_expert(unit, sorted_ptr, eids_ptr, npad_ptr, ids_ptr, S, B, ALIGNED)
    if (e < 0) | (e >= E):
        return
    rows = t * R + tl.arange(0, R)
    rmask = rows < I
    ok = tl.arange(0, BK)
    w_base = w13_ptr + e.to(tl.int64) * stride_we
    for p0 in range(0, n_valid, MP):  # one pass unless the expert holds more than MP slots of the block
        slots = _unit_slots(unit, p0, om, n_valid, sorted_ptr, S, B, ALIGNED)
        valid = slots < S
        tok = tl.where(valid, slots // TOP_K, 0)
        a_base = hidden_ptr + tok.to(tl.int64) * stride_hm
        acc_g = tl.zeros([MP, R, BK], tl.float32)
        acc_u = tl.zeros([MP, R, BK], tl.float32)
        if PREFETCH:  # two [R, BK] tiles of gate and of up in flight: the next one is requested before this one is used
            wg = _load_w_tile(w_base, rows, ok, rmask, ok < H, stride_wn)
            wu = _load_w_tile(w_base, rows + I, ok, rmask, ok < H, stride_wn)
            for k0 in range(0, H, BK):
                kc = k0 + ok
                kn = kc + BK
                wg_next = _load_w_tile(w_base, rows, kn, rmask, kn < H, stride_wn)
                wu_next = _load_w_tile(w_base, rows + I, kn, rmask, kn < H, stride_wn)
                a = tl.load(a_base[:, None] + kc[None, :], mask=valid[:, None] & (kc < H)[None, :],
                            other=0.0).to(tl.float32)
                acc_g += a[:, None, :] * wg.to(tl.float32)[None, :, :]
                acc_u += a[:, None, :] * wu.to(tl.float32)[None, :, :]
                wg = wg_next
                wu = wu_next
        else:
            for k0 in range(0, H, BK):
                kc = k0 + ok
                kmask = kc < H
                wg = _load_w_tile(w_base, rows, kc, rmask, kmask, stride_wn)
                wu = _load_w_tile(w_base, rows + I, kc, rmask, kmask, stride_wn)
                a = tl.load(a_base[:, None] + kc[None, :], mask=valid[:, None] & kmask[None, :],
                            other=0.0).to(tl.float32)
                acc_g += a[:, None, :] * wg.to(tl.float32)[None, :, :]
                acc_u += a[:, None, :] * wu.to(tl.float32)[None, :, :]
        g = tl.sum(acc_g, axis=2)
        u = tl.sum(acc_u, axis=2)
        act = g / (1.0 + tl.exp(-g)) * u
        srow = tl.where(valid, slots, 0).to(tl.int64)
        tl.store(act_ptr + srow[:, None] * stride_am + rows[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=valid[:, None] & rmask[None, :])


@triton.jit
def _moe_stream_down_kernel(act_ptr, w2_ptr, ids_ptr, tw_ptr, out_ptr, stride_am, stride_we, stride_wn, stride_om,
                            E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                            MT: tl.constexpr, SP: tl.constexpr, BH: tl.constexpr, BI: tl.constexpr,
                            PDL: tl.constexpr):
    pid = tl.program_id(0)
    oh = pid * BH + tl.arange(0, BH)
    hmask = oh < H
    sl = tl.arange(0, SP)  # slot s = m * TOP_K + k of token m (ids and weights are contiguous [M, TOP_K])
    smask = sl < MT * TOP_K
    # ids and weights come from before the gate/up kernel: safe to read ahead of gdc_wait
    e = tl.load(ids_ptr + sl, mask=smask, other=-1)
    use = smask & (e >= 0) & (e < E)
    r = tl.load(tw_ptr + sl, mask=use, other=0.0).to(tl.float32)
    e = tl.where(use, e, 0)
    oi = tl.arange(0, BI)
    part = tl.zeros([SP, BH], tl.float32)
    for i0 in range(0, I, BI):  # one step when I <= BI (Kimi-K2: I = 256)
        ic = i0 + oi
        imask = ic < I
        w = _load_w_gather(w2_ptr, e, oh, ic, use, hmask, imask, stride_we, stride_wn)  # [SP, BH, BI]
        if PDL:  # act is the gate/up kernel's output: wait for it (the w2 gather above is already in flight)
            gdc_wait()
        a = tl.load(act_ptr + sl[:, None].to(tl.int64) * stride_am + ic[None, :], mask=use[:, None] & imask[None, :],
                    other=0.0).to(tl.float32) * r[:, None]
        part += tl.sum(w.to(tl.float32) * a[:, None, :], axis=2)
    tok = sl // TOP_K
    for m in tl.static_range(MT):  # the top-k sum of token m, in the fixed order of one reduction
        y = tl.sum(tl.where((tok == m)[:, None], part, 0.0), axis=0)
        tl.store(out_ptr + m * stride_om + oh, y.to(out_ptr.dtype.element_ty), mask=hmask)
