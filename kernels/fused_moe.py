"""SwiGLU experts built for small M (the verify pass): each activated expert's weights streamed from HBM once.

Math, for a routed slot ``s = m * TOP_K + k`` with expert ``e = topk_ids[m, k]`` and weight ``r = topk_w[m, k]``:

    gate_up[s] = hidden[m] @ w13[e]^T                      (fp32 accumulate; w13[e] rows 0..I-1 gate, I..2I-1 up)
    act[s]     = silu(gate_up[s, :I]) * gate_up[s, I:]     (stored in hidden's dtype)
    part[s]    = r * (act[s] @ w2[e]^T)                    (fp32)
    out[m]     = sum_k part[m * TOP_K + k]                 (fixed k order: deterministic; slots with id -1 skipped)

The dot path, the default above M = 6, is three launches: ``_moe_gate_up_kernel`` (grid: blocks x I-tiles),
``_moe_down_kernel`` (grid: blocks x H-tiles), ``_moe_topk_sum_kernel`` (grid: M x H-tiles). A program owns one
block of BLOCK_M slots of one expert (from the alignment) and one tile of output columns, so every weight element of
an activated expert is loaded by exactly one program per block: with tiny M an expert has one block and its weights
are read once. Narrow I-tiles in the first GEMM (gate and up tiles of BLOCK_N rows each) give enough programs to
stream the weights at small M. Blocks past the used part (expert id -1) exit at once, so the grid is fixed for a
given M (CUDA-graph capturable).

The weight-streaming experts, the default for M <= 6 (``_moe_stream_gate_up_kernel`` + ``_moe_stream_down_kernel``,
end of this file, section "Stream experts"), are built to keep enough weight bytes in flight at a few tokens: small
programs, FMA GEMVs, one program per routed slot (no alignment), and the down projection of every slot plus the
top-k sum in one gather.

Every weight tile comes from ``_load_w`` (or its two halves, ``_load_w_raw`` then ``_dequant_w``, where a loop loads
one tile ahead), which also reads the two quantised formats (``QUANT``; definitions in
``specverify.reference.quant``) and dequantises in registers: int4 (W4A16, ``QUANT`` 1: two codes a byte along the
reduced dimension, one scale per ``QG`` columns; ``QUANT`` 3: the same codes and scales in row quads, see
``_moe_stream_gate_up_q4_kernel``) and fp8 (W8A16, ``QUANT`` 2: float8_e4m3fn, one fp32 scale per ``QN`` x ``QG``
block). The FMA kernels multiply in fp32; the tl.dot kernels round the dequantised tile to hidden's dtype first.
Activations are never quantised. With int4 in row quads the stream experts are the two ``_q4`` kernels, whose
arithmetic is inline PTX (``_q4_asm``; in the interpreter, Triton arithmetic: ``_q4_sums``).

Tensors (S = M * TOP_K; NB = number of blocks; B = BLOCK_M):

| name        | shape        | dtype      | meaning                                                        |
| ----------- | ------------ | ---------- | -------------------------------------------------------------- |
| hidden      | [M, H]       | bf16/fp16  | token activations, unit column stride                          |
| w13         | [E, 2I, H]   | as hidden  | gate rows then up rows of each expert, unit column stride      |
|             |              |            | (int4: uint8 [E, 2I, H/2]; fp8: float8_e4m3fn)                 |
| w2          | [E, H, I]    | as hidden  | down projection, unit column stride (int4: uint8 [E, H, I/2])  |
| s13, s2     | [E, 2I, H/QG]| float      | scales (int4; fp8: [E, ceil(2I/QN), ceil(H/QG)], w2's alike);  |
|             |              |            | unread when QUANT is 0                                         |
| sorted_ids  | [NB * B]     | int32      | slots grouped by expert; S = padding                           |
| expert_ids  | [NB]         | int32      | expert of each block; -1 = unused block                        |
| num_post_pad| [1]          | int32      | used length of sorted_ids                                      |
| topk_ids    | [M, TOP_K]   | int32      | expert of each slot (-1 or >= E: none)                         |
| topk_w      | [M, TOP_K]   | fp32       | routed weight of each slot                                     |
| act         | [S, I]       | as hidden  | SwiGLU output per slot                                         |
| part        | [S, H]       | fp32       | weighted expert output per slot                                |
| out         | [M, H]       | as hidden  | result                                                         |
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _load_w_raw(w_ptr, s_ptr, e, rows, k0, e_mask, row_mask, stride_e, stride_row, stride_se, stride_srow,
                K: tl.constexpr, BK: tl.constexpr, QUANT: tl.constexpr, QG: tl.constexpr, QN: tl.constexpr):
    """The loads of ``_load_w`` without its arithmetic: (stored tile, scales). The stored tile is [len(e),
    len(rows), BK] in w's dtype (QUANT 1 and 3: [.., BK // 2] bytes, two codes each, 0x88 = two zeros past K and
    outside the masks); the scales [len(e), len(rows), BK // min(QG, BK)] (0 outside the masks; a zero scalar when
    QUANT is 0)."""
    m2 = e_mask[:, None, None] & row_mask[None, :, None]
    if QUANT == 3:  # row quads: byte j of row n at (n // 4) * 4 * stride_row + (j // 4) * 16 + (n % 4) * 4 + j % 4
        row_off = ((rows // 4) * 4 * stride_row + (rows % 4) * 4).to(tl.int64)
    else:
        row_off = rows.to(tl.int64) * stride_row
    base = w_ptr + e[:, None, None].to(tl.int64) * stride_e + row_off[None, :, None]
    if QUANT == 1 or QUANT == 3:
        pc = k0 // 2 + tl.arange(0, BK // 2)
        if QUANT == 3:
            col = (pc // 4) * 16 + pc % 4
        else:
            col = pc
        p = tl.load(base + col[None, None, :], mask=m2 & (pc < K // 2)[None, None, :], other=0x88)
    else:
        kc = k0 + tl.arange(0, BK)
        p = tl.load(base + kc[None, None, :], mask=m2 & (kc < K)[None, None, :], other=0.0)
    if QUANT != 0:
        GW: tl.constexpr = QG if QG < BK else BK  # columns of one group inside the tile
        NGT: tl.constexpr = BK // GW
        gc = (k0 + tl.arange(0, NGT) * GW) // QG
        if QUANT == 3:  # scales in row quads too: group g of row n at (n // 4) * 4 * stride_srow + g * 4 + n % 4
            srow = (rows // 4) * 4 * stride_srow + rows % 4
            goff = gc * 4
        else:
            srow = (rows // QN) * stride_srow
            goff = gc
        sb = s_ptr + e[:, None, None].to(tl.int64) * stride_se + srow[None, :, None].to(tl.int64)
        s = tl.load(sb + goff[None, None, :], mask=m2 & (gc < (K + QG - 1) // QG)[None, None, :], other=0.0)
    else:
        s = 0.0
    return p, s


@triton.jit
def _dequant_w(p, s, BK: tl.constexpr, QUANT: tl.constexpr, QG: tl.constexpr):
    """The arithmetic of ``_load_w`` on what ``_load_w_raw`` loaded: the [len(e), len(rows), BK] tile."""
    if QUANT == 1 or QUANT == 3:
        w = tl.interleave((p & 0xF).to(tl.float32), (p >> 4).to(tl.float32)) - 8.0
    else:
        w = p
    if QUANT != 0:
        GW: tl.constexpr = QG if QG < BK else BK
        NGT: tl.constexpr = BK // GW
        w = tl.reshape(w.to(tl.float32), (w.shape[0], w.shape[1], NGT, GW)) * s.to(tl.float32)[:, :, :, None]
        w = tl.reshape(w, (p.shape[0], p.shape[1], BK))
    return w


@triton.jit
def _load_w(w_ptr, s_ptr, e, rows, k0, e_mask, row_mask, stride_e, stride_row, stride_se, stride_srow,
            K: tl.constexpr, BK: tl.constexpr, QUANT: tl.constexpr, QG: tl.constexpr, QN: tl.constexpr):
    """W[e][rows, k0:k0 + BK] of every expert in ``e``: a [len(e), len(rows), BK] tile, zero past K and outside
    the masks. QUANT 0: as stored. QUANT 1 (int4): byte ``k // 2`` of a row holds column k's code q (even k in the
    low nibble), the value is ``(q - 8) * S[e][row, k // QG]`` (fp32). QUANT 2 (fp8): ``W * S[e][row // QN, k //
    QG]`` (fp32). ``stride_row`` counts stored elements (bytes for int4); k0 is a multiple of BK, and BK and QG are
    powers of two, so a tile holds whole groups or lies inside one."""
    p, s = _load_w_raw(w_ptr, s_ptr, e, rows, k0, e_mask, row_mask, stride_e, stride_row, stride_se, stride_srow, K,
                       BK, QUANT, QG, QN)
    return _dequant_w(p, s, BK, QUANT, QG)


@triton.jit
def _load_w_tile(w_ptr, s_ptr, e, rows, k0, row_mask, stride_e, stride_row, stride_se, stride_srow, K: tl.constexpr,
                 BK: tl.constexpr, QUANT: tl.constexpr, QG: tl.constexpr, QN: tl.constexpr):
    """W[e][rows, k0:k0 + BK] of one expert ``e`` (a scalar) as a [len(rows), BK] tile (``_load_w``)."""
    ev = e + tl.zeros([1], tl.int32)
    w = _load_w(w_ptr, s_ptr, ev, rows, k0, ev >= 0, row_mask, stride_e, stride_row, stride_se, stride_srow, K, BK,
                QUANT, QG, QN)
    return tl.reshape(w, (rows.shape[0], BK))


@triton.jit
def _mma(a, w, acc, UPCAST: tl.constexpr):
    """acc += a @ w^T. UPCAST (interpreter only: its bf16 dot is wrong) multiplies in fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
    return tl.dot(a, tl.trans(w), acc)


@triton.jit(do_not_specialize=["S"])
def _moe_gate_up_kernel(hidden_ptr, w13_ptr, s13_ptr, act_ptr, sorted_ptr, eids_ptr, npad_ptr, S, stride_hm,
                        stride_we, stride_wn, stride_se, stride_sn, stride_am, H: tl.constexpr, I: tl.constexpr,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        UPCAST: tl.constexpr, QUANT: tl.constexpr, QG: tl.constexpr, QN: tl.constexpr):
    """act[s] = silu(gate) * up for the slots of one block and BLOCK_N columns of I."""
    pid = tl.program_id(0)
    n_tiles: tl.constexpr = (I + BLOCK_N - 1) // BLOCK_N
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
    tok = tl.where(valid, slots // TOP_K, 0)
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = on < I
    ok = tl.arange(0, BLOCK_K)
    a_base = hidden_ptr + tok[:, None].to(tl.int64) * stride_hm
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kc = k0 + ok
        kmask = kc < H
        a = tl.load(a_base + kc[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
        wg = _load_w_tile(w13_ptr, s13_ptr, e, on, k0, nmask, stride_we, stride_wn, stride_se, stride_sn, H, BLOCK_K,
                          QUANT, QG, QN)
        wu = _load_w_tile(w13_ptr, s13_ptr, e, on + I, k0, nmask, stride_we, stride_wn, stride_se, stride_sn, H,
                          BLOCK_K, QUANT, QG, QN)
        if not UPCAST:  # a dequantised tile into the MMA's dtype (the interpreter multiplies in fp32 instead)
            wg = wg.to(a.dtype)
            wu = wu.to(a.dtype)
        acc_g = _mma(a, wg, acc_g, UPCAST)
        acc_u = _mma(a, wu, acc_u, UPCAST)
    srow = tl.where(valid, slots, 0)[:, None].to(tl.int64)
    smask = valid[:, None] & nmask[None, :]
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(act_ptr + srow * stride_am + on[None, :], act.to(act_ptr.dtype.element_ty), mask=smask)


@triton.jit(do_not_specialize=["S"])
def _moe_down_kernel(act_ptr, w2_ptr, s2_ptr, part_ptr, tw_ptr, sorted_ptr, eids_ptr, npad_ptr, S, stride_am,
                     stride_we, stride_wn, stride_se, stride_sn, stride_pm, H: tl.constexpr, I: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                     QUANT: tl.constexpr, QG: tl.constexpr, QN: tl.constexpr):
    """part[s] = r * (act[s] @ w2[e]^T) for the slots of one block and BLOCK_N columns of H."""
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
    a_base = act_ptr + srow[:, None].to(tl.int64) * stride_am
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kc = k0 + ok
        kmask = kc < I
        a = tl.load(a_base + kc[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
        w = _load_w_tile(w2_ptr, s2_ptr, e, on, k0, nmask, stride_we, stride_wn, stride_se, stride_sn, I, BLOCK_K,
                         QUANT, QG, QN)
        if not UPCAST:
            w = w.to(a.dtype)
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
# Stream experts (the default at M <= 6, see _STREAM_CONFIG): pure weight streaming at a few tokens.
#
# At M = 1 the expert GEMM is a GEMV: ~11 MB of weights per activated expert, 2 FLOPs per weight element. Its time
# is set by how many weight bytes are in flight (Little's law: ~4.2 TB/s x ~1 us loaded latency = ~4 MB GPU-wide,
# ~32 KB per SM), not by arithmetic. So: no tl.dot, fp32 FMA into element-wise accumulators (one reduction at the
# end), 16-byte vector loads along the contiguous H (or I) axis, and small programs (few rows, 2-4 warps) so that
# several are resident per SM.
#
#   _moe_stream_gate_up_kernel  grid (S * NT,), NT = ceil(I / R). Program (s, t) streams gate rows
#       [t*R, (t+1)*R) and the same up rows of slot s's expert e = topk_ids[s] over all of H in [R, BK] tiles and
#       stores
#           act[s, rows] = silu(hidden[tok(s)] @ gate^T) * (hidden[tok(s)] @ up^T)     (fp32 sums, act in w's dtype)
#       (no alignment needed; an expert shared by two tokens is read twice, the second time mostly from L2 since all
#       programs run in one wave). With PDL it lets the down kernel launch (gdc_launch_dependents) once its own
#       gdc_wait has seen the routing finish.
#   _moe_stream_down_kernel     grid (ceil(H / BH),). Program p owns output rows h in [p*BH, (p+1)*BH) and every
#       slot of every token at once (SP >= M * TOP_K lanes): one gathered [SP, BH, BI] load of w2[e_s][h, i] (each
#       activated expert's w2 rows read once), then
#           out[m, h] = sum_{s of token m} sum_i (r_s * act[s, i]) * w2[e_s][h, i]
#       (slots whose id is -1 or >= E masked out; fixed reduction order: deterministic, no atomics).
#       With PDL it is launched as a programmatic dependent: the w2 gather (independent of the gate/up kernel, but
#       after the routing, which the gate/up kernel waits for before it lets the down kernel launch) is
#       issued before ``gdc_wait``, so the down grid's weight reads overlap the gate/up kernel's tail.
#
# Weight loads go through ``_load_w`` (quantised weights: int4 codes or fp8 values and their scales, dequantised in
# registers; the FMA and the sums stay fp32). With ``QPF`` (int4: half a byte a weight, so a [R, BK] tile is few
# bytes a thread) the gate/up loop issues the next tile's loads (``_load_w_raw``) before this tile's arithmetic
# (``_dequant_w``), two tiles in flight a program. Otherwise the loop is a ``tl.range`` of ``LSTAGES`` stages (None: a
# plain loop): Triton's pipeliner copies each step's code, scale and activation tiles into shared memory LSTAGES - 1
# steps ahead (fp8 from 4 tokens; see ``LS`` in ``specverify.moe._STREAM_CONFIG``).
# ------------------------------------------------------------------------------------------------------------------
@triton.jit
def _moe_stream_gate_up_kernel(hidden_ptr, w13_ptr, s13_ptr, act_ptr, ids_ptr, stride_hm, stride_we, stride_wn,
                               stride_se, stride_sn, stride_am, E: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                               TOP_K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
                               QUANT: tl.constexpr, QG: tl.constexpr, QN: tl.constexpr, QPF: tl.constexpr = False,
                               LSTAGES: tl.constexpr = None):
    if PDL:  # wait for the routing (ids) and the norm (hidden) first: the down kernel reads ids and weights
        gdc_wait()  # before its own wait, so it may launch (and gather w2) only once the routing has finished
        gdc_launch_dependents()
    pid = tl.program_id(0)
    NT: tl.constexpr = (I + R - 1) // R
    slot = pid // NT
    t = pid % NT
    e = tl.load(ids_ptr + slot)
    if (e < 0) | (e >= E):
        return
    rows = t * R + tl.arange(0, R)
    rmask = rows < I
    ok = tl.arange(0, BK)
    slots = slot + tl.arange(0, 1)  # [1]: this program's slot, as a leading axis of the [1, R, BK] accumulators
    ev = e + tl.zeros([1], tl.int32)
    tok = slots // TOP_K
    a_base = hidden_ptr + tok.to(tl.int64) * stride_hm
    acc_g = tl.zeros([1, R, BK], tl.float32)
    acc_u = tl.zeros([1, R, BK], tl.float32)
    if QPF:  # the next tile's loads issued before this tile's arithmetic (two tiles in flight a program)
        pg, sg = _load_w_raw(w13_ptr, s13_ptr, ev, rows, 0, ev >= 0, rmask, stride_we, stride_wn, stride_se,
                             stride_sn, H, BK, QUANT, QG, QN)
        pu, su = _load_w_raw(w13_ptr, s13_ptr, ev, rows + I, 0, ev >= 0, rmask, stride_we, stride_wn, stride_se,
                             stride_sn, H, BK, QUANT, QG, QN)
        for k0 in range(0, H, BK):
            kc = k0 + ok
            kmask = kc < H
            # past H the codes' loads are masked off (no memory traffic); a scale past H may be read (its group
            # still lies inside the row's scales when QG > BK) and is never used
            pg_n, sg_n = _load_w_raw(w13_ptr, s13_ptr, ev, rows, k0 + BK, ev >= 0, rmask, stride_we, stride_wn,
                                     stride_se, stride_sn, H, BK, QUANT, QG, QN)
            pu_n, su_n = _load_w_raw(w13_ptr, s13_ptr, ev, rows + I, k0 + BK, ev >= 0, rmask, stride_we, stride_wn,
                                     stride_se, stride_sn, H, BK, QUANT, QG, QN)
            a = tl.load(a_base[:, None] + kc[None, :], mask=kmask[None, :], other=0.0).to(tl.float32)
            acc_g += a[:, None, :] * _dequant_w(pg, sg, BK, QUANT, QG).to(tl.float32)
            acc_u += a[:, None, :] * _dequant_w(pu, su, BK, QUANT, QG).to(tl.float32)
            pg, sg, pu, su = pg_n, sg_n, pu_n, su_n
    else:  # LSTAGES, a loop attribute, lets Triton's pipeliner copy every tile into shared memory LSTAGES - 1 steps
        # ahead; None: no attribute, the same code as a plain range
        for k0 in tl.range(0, H, BK, num_stages=LSTAGES):
            kc = k0 + ok
            kmask = kc < H
            wg = _load_w(w13_ptr, s13_ptr, ev, rows, k0, ev >= 0, rmask, stride_we, stride_wn, stride_se, stride_sn,
                         H, BK, QUANT, QG, QN)
            wu = _load_w(w13_ptr, s13_ptr, ev, rows + I, k0, ev >= 0, rmask, stride_we, stride_wn, stride_se,
                         stride_sn, H, BK, QUANT, QG, QN)
            a = tl.load(a_base[:, None] + kc[None, :], mask=kmask[None, :], other=0.0).to(tl.float32)
            acc_g += a[:, None, :] * wg.to(tl.float32)
            acc_u += a[:, None, :] * wu.to(tl.float32)
    g = tl.sum(acc_g, axis=2)
    u = tl.sum(acc_u, axis=2)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + slots[:, None].to(tl.int64) * stride_am + rows[None, :], act.to(act_ptr.dtype.element_ty),
             mask=rmask[None, :])


def _q4_asm(f16: bool, mats: int) -> str:
    """PTX of one step of the row-quad int4 kernels for 4 rows (a row quad) x one 32-bit code word (8 columns) of
    ``mats`` code matrices (2: gate and up; 1: down): ``acc += scale * sum_j (q_j - 8) * x_j``. A code becomes the
    float ``128 + q`` in one ``prmt`` (the nibble into the mantissa under the exponent of 128), so the sum is
    ``sum_j (128 + q_j) x_j - 136 sum_j x_j``, one FMA a weight; the activations' conversion and sum serve every row
    and matrix. Operands, one 32-bit register each (``pack=1``: every operand is its own tensor, so the PTX is
    elementwise whatever Triton's register layout), in order: the accumulators out (4 a matrix: rows 0-3), the code
    words of rows 0-3 (4 a matrix), the 8 activations as 4 pairs (bf16 or fp16, column 2j in the low half), the
    fp32 scales (4 a matrix), the accumulators in (4 a matrix)."""
    act = 8 * mats
    a = ["{", ".reg .f32 e<4>, o<4>, xs, t;", ".reg .b32 mg, lo, hi, f;"]
    if f16:
        a.append(".reg .b16 hl, hh;")
    for b in range(4):
        if f16:
            a.append(f"mov.b32 {{hl, hh}}, ${act + b}; cvt.f32.f16 e{b}, hl; cvt.f32.f16 o{b}, hh;")
        else:
            a.append(f"shl.b32 e{b}, ${act + b}, 16; and.b32 o{b}, ${act + b}, 0xFFFF0000;")
    a.append("add.f32 xs, e0, o0; add.f32 xs, xs, e1; add.f32 xs, xs, o1; add.f32 xs, xs, e2;")
    a.append("add.f32 xs, xs, o2; add.f32 xs, xs, e3; add.f32 xs, xs, o3;")
    a.append("mul.f32 xs, xs, 0fC3080000; mov.b32 mg, 0x43000000;")  # -136 * sum(x); 128.0's bits
    for i in range(mats):
        codes, scales, acc_in, acc_out = 4 * mats + 4 * i, act + 4 + 4 * i, act + 4 + 4 * mats + 4 * i, 4 * i
        for r in range(4):
            a.append(f"and.b32 lo, ${codes + r}, 0x0F0F0F0F; shr.b32 hi, ${codes + r}, 4; and.b32 hi, hi, 0x0F0F0F0F;")
            a.append("mov.f32 t, xs;")
            for b in range(4):  # byte b of lo / hi into byte 2 of 0x43000000: the float 128 + q
                sel = 0x7054 | (b << 8)
                a.append(f"prmt.b32 f, lo, mg, {sel:#x}; fma.rn.f32 t, f, e{b}, t;")
                a.append(f"prmt.b32 f, hi, mg, {sel:#x}; fma.rn.f32 t, f, o{b}, t;")
            a.append(f"fma.rn.f32 ${acc_out + r}, t, ${scales + r}, ${acc_in + r};")
    a.append("}")
    return "\n".join(a)


_Q4_ASM2_BF16 = tl.constexpr(_q4_asm(False, 2))
_Q4_ASM2_F16 = tl.constexpr(_q4_asm(True, 2))
_Q4_ASM1_BF16 = tl.constexpr(_q4_asm(False, 1))
_Q4_ASM1_F16 = tl.constexpr(_q4_asm(True, 1))
_Q4_CONSTRAINTS2 = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 28))
_Q4_CONSTRAINTS1 = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 16))


@triton.jit
def _split4(x):
    """[..., 4] -> its 4 elements along the last axis as 4 tensors [...] (element i of x is the i-th result)."""
    a, b = tl.split(tl.reshape(x, x.shape[:-1] + [2, 2]))  # a: elements 0 and 2, b: 1 and 3
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def _join4(x0, x1, x2, x3):
    """The inverse of :func:`_split4`: 4 tensors [...] -> [..., 4] (x_i is element i)."""
    return tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), x0.shape + [4])


@triton.jit
def _q4_sums(c, xe, xo):
    """The interpreter's form of the PTX: code words ``c`` [...] of one row against their 8 activations ``xe`` /
    ``xo`` [..., 4] (fp32; column 8w + 2b / 8w + 2b + 1 of byte b), ``sum_j (q_j - 8) x_j`` over each word."""
    sh = 8 * tl.arange(0, 4)
    c = tl.expand_dims(c, -1)
    return tl.sum((((c >> sh) & 0xF).to(tl.float32) - 8.0) * xe + (((c >> (sh + 4)) & 0xF).to(tl.float32) - 8.0) * xo,
                  axis=-1)


# ------------------------------------------------------------------------------------------------------------------
# int4 experts in row quads (``MoEQuant(layout="quads")``, QUANT 3): the stream experts' gate/up and down without a
# layout change. A 16-byte load holds one 32-bit code word (8 columns) of 4 rows, and the same thread's 16-byte
# activation load holds those 8 columns, so codes and activations meet in registers; the arithmetic is the PTX of
# ``_q4_asm`` (about 3 instructions a weight: one prmt and one FMA a code, the masks, the activations' conversion
# and sum shared by the 4 rows and by gate and up).
#
#   _moe_stream_gate_up_q4_kernel  grid (S * NT,), NT = ceil(I / (4 * RQ)). Program (s, t) streams row quads
#       [t*RQ, (t+1)*RQ) of slot s's gate rows and the same quads of its up rows over all of H in [RQ, BKW, 4]
#       code-word tiles (BKW words = 8 * BKW columns) and stores act[s, rows] as the stream gate/up does.
#       Codes: w13 viewed as int32 words, word w of row n at (n // 4) * (H / 2) + 4 * w + n % 4 (words); scales
#       group g of row n at (n // 4) * 4 * (H / QG) + 4 * g + n % 4. ASM False (the interpreter): the same sums in
#       Triton arithmetic, codes read nibble by nibble.
#       SHARED: an unquantised shared expert (w13 [2I, H] in hidden's dtype, weight 1) rides in the same grid: its
#       M * ceil(I / SR) programs come first (``_shared_gate_up_rows``: SR gate + SR up rows, SBK columns a step)
#       and store act rows S + token; the down kernel then adds its output to every token's.
# ------------------------------------------------------------------------------------------------------------------
@triton.jit
def _shared_gate_up_rows(hidden_ptr, sw_ptr, act_ptr, tok, t, S, stride_hm, stride_sw, stride_am, H: tl.constexpr,
                         I: tl.constexpr, SR: tl.constexpr, SBK: tl.constexpr):
    """One program of the shared expert in the q4 gate/up grid: gate rows [t*SR, (t+1)*SR) and the same up rows of
    the unquantised shared w13 [2I, H] (hidden's dtype) against token ``tok``, FMA over all of H in SBK columns a
    step; act[S + tok, rows] = silu(gate) * up."""
    rows = t * SR + tl.arange(0, SR)
    rmask = rows < I
    oc = tl.arange(0, SBK)
    xb = hidden_ptr + tok.to(tl.int64) * stride_hm
    wg = sw_ptr + rows[:, None].to(tl.int64) * stride_sw
    wu = wg + I * stride_sw
    ag = tl.zeros([SR, SBK], tl.float32)
    au = tl.zeros([SR, SBK], tl.float32)
    for k0 in range(0, H, SBK):
        c = k0 + oc
        cm = c < H
        x = tl.load(xb + c, mask=cm, other=0.0).to(tl.float32)[None, :]
        m2 = rmask[:, None] & cm[None, :]
        ag += tl.load(wg + c[None, :], mask=m2, other=0.0).to(tl.float32) * x
        au += tl.load(wu + c[None, :], mask=m2, other=0.0).to(tl.float32) * x
    g = tl.sum(ag, axis=1)
    u = tl.sum(au, axis=1)
    tl.store(act_ptr + (S + tok).to(tl.int64) * stride_am + rows, (g / (1.0 + tl.exp(-g)) * u).to(
        act_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _q4_store_act(ptrs, g, u, mask):
    """act = silu(g) * u of one row of each quad: the gate / up accumulators [RQ, BKW] summed over the words."""
    g = tl.sum(g, axis=1)
    u = tl.sum(u, axis=1)
    tl.store(ptrs, (g / (1.0 + tl.exp(-g)) * u).to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _moe_stream_gate_up_q4_kernel(hidden_ptr, w13_ptr, s13_ptr, act_ptr, ids_ptr, stride_hm, stride_we, stride_wn,
                                  stride_se, stride_sn, stride_am, E: tl.constexpr, H: tl.constexpr,
                                  I: tl.constexpr, TOP_K: tl.constexpr, RQ: tl.constexpr, BKW: tl.constexpr,
                                  PDL: tl.constexpr, QG: tl.constexpr, ASM: tl.constexpr, F16: tl.constexpr,
                                  LSTAGES: tl.constexpr = None, sw_ptr=None, stride_sw=0, S=0,
                                  SHARED: tl.constexpr = False, SR: tl.constexpr = 2, SBK: tl.constexpr = 512):
    if PDL:  # as the stream gate/up: wait for the routing and the norm, then let the down kernel launch
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    if SHARED:  # programs [0, M * ceil(I / SR)): the unquantised shared expert, into act rows S + token
        NTS: tl.constexpr = (I + SR - 1) // SR
        if pid < (S // TOP_K) * NTS:
            _shared_gate_up_rows(hidden_ptr, sw_ptr, act_ptr, pid // NTS, pid % NTS, S, stride_hm, stride_sw,
                                 stride_am, H, I, SR, SBK)
            return
        pid -= (S // TOP_K) * NTS
    NQ: tl.constexpr = I // 4
    NT: tl.constexpr = (NQ + RQ - 1) // RQ
    HW: tl.constexpr = H // 8  # code words a row
    WPG: tl.constexpr = QG // 8  # code words a scale group
    slot = pid // NT
    t = pid % NT
    e = tl.load(ids_ptr + slot)
    if (e < 0) | (e >= E):
        return
    q = t * RQ + tl.arange(0, RQ)
    qmask = q < NQ
    ow = tl.arange(0, BKW)
    orr = tl.arange(0, 4)
    tok = slot // TOP_K
    wb = w13_ptr.to(tl.pointer_type(tl.int32)) + e.to(tl.int64) * (stride_we // 4)
    sb = s13_ptr + e.to(tl.int64) * stride_se
    xb = hidden_ptr + tok.to(tl.int64) * stride_hm
    q_off = q[:, None, None] * stride_wn + orr[None, None, :]  # words: 4 rows of H / 2 bytes = stride_wn words
    s_off = q[:, None, None] * (4 * stride_sn) + orr[None, None, :]
    # one accumulator a row of the quad (gate g0-g3, up u0-u3), [RQ, BKW] each: the PTX is elementwise over them
    g0 = tl.zeros([RQ, BKW], tl.float32)
    g1, g2, g3, u0, u1, u2, u3 = g0, g0, g0, g0, g0, g0, g0
    for w0 in tl.range(0, HW, BKW, num_stages=LSTAGES):
        wc = w0 + ow
        wmask = (wc < HW)[None, :, None]
        m3 = wmask & qmask[:, None, None]
        c_off = q_off + (wc * 4)[None, :, None]
        cg0, cg1, cg2, cg3 = _split4(tl.load(wb + c_off, mask=m3, other=0))  # [RQ, BKW, 4 rows] -> 4 x [RQ, BKW]
        cu0, cu1, cu2, cu3 = _split4(tl.load(wb + NQ * stride_wn + c_off, mask=m3, other=0))
        g_off = s_off + ((wc // WPG) * 4)[None, :, None]
        sg0, sg1, sg2, sg3 = _split4(tl.load(sb + g_off, mask=m3, other=0.0).to(tl.float32))
        su0, su1, su2, su3 = _split4(tl.load(sb + NQ * 4 * stride_sn + g_off, mask=m3, other=0.0).to(tl.float32))
        if ASM:  # the word's 8 activations as 4 pairs, loaded in the codes' shape (so in their register layout)
            x0, x1, x2, x3 = _split4(tl.load(xb.to(tl.pointer_type(tl.int32)) + (wc * 4)[None, :, None]
                                             + orr[None, None, :] + 0 * q[:, None, None], mask=m3, other=0))
            g0, g1, g2, g3, u0, u1, u2, u3 = tl.inline_asm_elementwise(
                _Q4_ASM2_F16 if F16 else _Q4_ASM2_BF16, _Q4_CONSTRAINTS2,
                [cg0, cg1, cg2, cg3, cu0, cu1, cu2, cu3, x0, x1, x2, x3, sg0, sg1, sg2, sg3, su0, su1, su2, su3,
                 g0, g1, g2, g3, u0, u1, u2, u3],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32),
                is_pure=True, pack=1)
        else:  # [1, BKW, 4 bytes]: byte b of a row's word holds columns 8w + 2b (low nibble) and 8w + 2b + 1
            col = (wc * 8)[None, :, None] + 2 * orr[None, None, :]
            xe = tl.load(xb + col, mask=wmask, other=0.0).to(tl.float32)
            xo = tl.load(xb + col + 1, mask=wmask, other=0.0).to(tl.float32)
            g0 += sg0 * _q4_sums(cg0, xe, xo)
            g1 += sg1 * _q4_sums(cg1, xe, xo)
            g2 += sg2 * _q4_sums(cg2, xe, xo)
            g3 += sg3 * _q4_sums(cg3, xe, xo)
            u0 += su0 * _q4_sums(cu0, xe, xo)
            u1 += su1 * _q4_sums(cu1, xe, xo)
            u2 += su2 * _q4_sums(cu2, xe, xo)
            u3 += su3 * _q4_sums(cu3, xe, xo)
    a_row = act_ptr + slot.to(tl.int64) * stride_am + q * 4  # row 4q + r of the quads
    _q4_store_act(a_row, g0, u0, qmask)
    _q4_store_act(a_row + 1, g1, u1, qmask)
    _q4_store_act(a_row + 2, g2, u2, qmask)
    _q4_store_act(a_row + 3, g3, u3, qmask)


@triton.jit
def _q4_store_down(ptrs, part, of_token, mask, shared):
    """One token's output on one row of each quad: the sum of ``part`` [SP, RQ] over its slots (``of_token``), plus
    ``shared`` (the shared expert's output on those rows [RQ], or 0.0)."""
    y = tl.sum(tl.where(of_token[:, None], part, 0.0), axis=0) + shared
    tl.store(ptrs, y.to(ptrs.dtype.element_ty), mask=mask)


#   _moe_stream_down_q4_kernel  grid (ceil(H / (4 * RQ)),). The stream down kernel's work on w2 in row quads:
#       program p owns output row quads [p*RQ, (p+1)*RQ) and every slot (SP lanes) at once: [SP, RQ, BW, 4] code-word
#       tiles over I (BW words a step, one step when I <= 8 * BW), gathered before ``gdc_wait`` as in the stream
#       down kernel; the activations [SP, RQ, BW, 4] pairs (one load a row quad: the codes' register layout), then
#           out[m, h] = sum_{s of token m} r_s * sum_i act[s, i] * w2[e_s][h, i]       (fixed order, no atomics)
#       SHARED: + sum_i act[S + m, i] * shared_w2[h, i] (the program's [RQ, 4, BIS] rows of the unquantised shared
#       w2, read before the wait like the codes).
@triton.jit
def _moe_stream_down_q4_kernel(act_ptr, w2_ptr, s2_ptr, ids_ptr, tw_ptr, out_ptr, stride_am, stride_we, stride_wn,
                               stride_se, stride_sn, stride_om, E: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                               TOP_K: tl.constexpr, MT: tl.constexpr, SP: tl.constexpr, RQ: tl.constexpr,
                               BW: tl.constexpr, PDL: tl.constexpr, QG: tl.constexpr, ASM: tl.constexpr,
                               F16: tl.constexpr, sw2_ptr=None, stride_sw2=0, SHARED: tl.constexpr = False,
                               BIS: tl.constexpr = 16, ONE_SUM: tl.constexpr = False):
    pid = tl.program_id(0)
    IW: tl.constexpr = I // 8  # code words a row
    WPG: tl.constexpr = QG // 8
    q = pid * RQ + tl.arange(0, RQ)
    qmask = q < H // 4
    sl = tl.arange(0, SP)
    smask = sl < MT * TOP_K
    e = tl.load(ids_ptr + sl, mask=smask, other=-1)  # the routing had finished before gate/up let this grid launch
    use = smask & (e >= 0) & (e < E)
    r = tl.load(tw_ptr + sl, mask=use, other=0.0).to(tl.float32)
    e = tl.where(use, e, 0)
    ow = tl.arange(0, BW)
    orr = tl.arange(0, 4)
    wb = w2_ptr.to(tl.pointer_type(tl.int32)) + e.to(tl.int64)[:, None, None, None] * (stride_we // 4)
    sb = s2_ptr + e.to(tl.int64)[:, None, None, None] * stride_se
    q_off = q[None, :, None, None] * stride_wn + orr[None, None, None, :]
    s_off = q[None, :, None, None] * (4 * stride_sn) + orr[None, None, None, :]
    a_rows = sl.to(tl.int64)[:, None, None, None] * stride_am
    if SHARED:  # the unquantised shared w2 [H, I] on this program's rows [RQ, 4, BIS], read before the wait
        oi = tl.arange(0, BIS)
        s_rows = (q[:, None] * 4 + orr[None, :]).to(tl.int64)
        ws = tl.load(sw2_ptr + s_rows[:, :, None] * stride_sw2 + oi[None, None, :],
                     mask=qmask[:, None, None] & (oi < I)[None, None, :], other=0.0)
    a0 = tl.zeros([SP, RQ, BW], tl.float32)  # one accumulator a row of the quad
    a1, a2, a3 = a0, a0, a0
    for w0 in range(0, IW, BW):  # one step when I <= 8 * BW (Kimi-K2: I = 256, 32 words)
        wc = w0 + ow
        m4 = use[:, None, None, None] & qmask[None, :, None, None] & (wc < IW)[None, None, :, None]
        c0, c1, c2, c3 = _split4(tl.load(wb + q_off + (wc * 4)[None, None, :, None], mask=m4, other=0))
        s0, s1, s2, s3 = _split4(tl.load(sb + s_off + ((wc // WPG) * 4)[None, None, :, None], mask=m4,
                                         other=0.0).to(tl.float32))
        if PDL:  # act is the gate/up kernel's output: wait for it (the w2 gather above is already in flight)
            gdc_wait()
        if ASM:  # the activation pairs in the codes' shape (a load a row quad), so in their register layout
            x0, x1, x2, x3 = _split4(tl.load(act_ptr.to(tl.pointer_type(tl.int32)) + a_rows // 2
                                             + (wc * 4)[None, None, :, None] + orr[None, None, None, :]
                                             + 0 * q[None, :, None, None], mask=m4, other=0))
            a0, a1, a2, a3 = tl.inline_asm_elementwise(_Q4_ASM1_F16 if F16 else _Q4_ASM1_BF16, _Q4_CONSTRAINTS1,
                                                       [c0, c1, c2, c3, x0, x1, x2, x3, s0, s1, s2, s3,
                                                        a0, a1, a2, a3],
                                                       dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                                       is_pure=True, pack=1)
        else:
            col = a_rows + (wc * 8)[None, None, :, None] + 2 * orr[None, None, None, :]  # [SP, 1, BW, 4 bytes]
            xm = use[:, None, None, None] & (wc < IW)[None, None, :, None]
            xe = tl.load(act_ptr + col, mask=xm, other=0.0).to(tl.float32)
            xo = tl.load(act_ptr + col + 1, mask=xm, other=0.0).to(tl.float32)
            a0 += s0 * _q4_sums(c0, xe, xo)
            a1 += s1 * _q4_sums(c1, xe, xo)
            a2 += s2 * _q4_sums(c2, xe, xo)
            a3 += s3 * _q4_sums(c3, xe, xo)
    tok = sl // TOP_K
    p0 = tl.sum(a0, axis=2) * r[:, None]  # [SP, RQ]: each slot's weighted output on row 4q + r
    p1 = tl.sum(a1, axis=2) * r[:, None]
    p2 = tl.sum(a2, axis=2) * r[:, None]
    p3 = tl.sum(a3, axis=2) * r[:, None]
    if ONE_SUM:  # TOP_K a power of two: slot s = m * TOP_K + k, so one reduction over k serves every token and row
        MTP: tl.constexpr = SP // TOP_K
        mt = tl.arange(0, MTP)
        y = tl.sum(tl.reshape(_join4(p0, p1, p2, p3), [MTP, TOP_K, RQ, 4]), axis=1)  # [MTP, RQ, 4 rows]
        if SHARED:  # act rows MT * TOP_K + m: the shared expert's (after the loop's wait)
            xs = tl.load(act_ptr + (MT * TOP_K + mt).to(tl.int64)[:, None] * stride_am + oi[None, :],
                         mask=(mt < MT)[:, None] & (oi < I)[None, :], other=0.0).to(tl.float32)  # [MTP, BIS]
            y += tl.sum(ws.to(tl.float32)[None, :, :, :] * xs[:, None, None, :], axis=3)
        o_ptrs = out_ptr + mt[:, None, None] * stride_om + (q[:, None] * 4 + orr[None, :])[None, :, :]
        tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=(mt < MT)[:, None, None] & qmask[None, :, None])
    else:
        o_row = out_ptr + q * 4
        for m in tl.static_range(MT):  # the top-k sum of token m, in the fixed order of one reduction
            if SHARED:  # act row MT * TOP_K + m: the shared expert's (after the loop's wait)
                xs = tl.load(act_ptr + (MT * TOP_K + m) * stride_am + oi, mask=oi < I, other=0.0).to(tl.float32)
                y0, y1, y2, y3 = _split4(tl.sum(ws.to(tl.float32) * xs[None, None, :], axis=2))
            else:
                y0, y1, y2, y3 = 0.0, 0.0, 0.0, 0.0
            _q4_store_down(o_row + m * stride_om, p0, tok == m, qmask, y0)
            _q4_store_down(o_row + m * stride_om + 1, p1, tok == m, qmask, y1)
            _q4_store_down(o_row + m * stride_om + 2, p2, tok == m, qmask, y2)
            _q4_store_down(o_row + m * stride_om + 3, p3, tok == m, qmask, y3)


@triton.jit
def _moe_stream_down_kernel(act_ptr, w2_ptr, s2_ptr, ids_ptr, tw_ptr, out_ptr, stride_am, stride_we, stride_wn,
                            stride_se, stride_sn, stride_om, E: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                            TOP_K: tl.constexpr, MT: tl.constexpr, SP: tl.constexpr, BH: tl.constexpr,
                            BI: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr, QG: tl.constexpr,
                            QN: tl.constexpr):
    pid = tl.program_id(0)
    oh = pid * BH + tl.arange(0, BH)
    hmask = oh < H
    sl = tl.arange(0, SP)  # slot s = m * TOP_K + k of token m (ids and weights are contiguous [M, TOP_K])
    smask = sl < MT * TOP_K
    # ids and weights come from the routing, which had finished before the gate/up kernel let this grid launch
    # (it waits, then triggers): safe to read ahead of gdc_wait
    e = tl.load(ids_ptr + sl, mask=smask, other=-1)
    use = smask & (e >= 0) & (e < E)
    r = tl.load(tw_ptr + sl, mask=use, other=0.0).to(tl.float32)
    e = tl.where(use, e, 0)
    oi = tl.arange(0, BI)
    part = tl.zeros([SP, BH], tl.float32)
    for i0 in range(0, I, BI):  # one step when I <= BI (Kimi-K2: I = 256)
        ic = i0 + oi
        imask = ic < I
        w = _load_w(w2_ptr, s2_ptr, e, oh, i0, use, hmask, stride_we, stride_wn, stride_se, stride_sn, I, BI, QUANT,
                    QG, QN)  # [SP, BH, BI]
        if PDL:  # act is the gate/up kernel's output: wait for it (the w2 gather above is already in flight)
            gdc_wait()
        a = tl.load(act_ptr + sl[:, None].to(tl.int64) * stride_am + ic[None, :], mask=use[:, None] & imask[None, :],
                    other=0.0).to(tl.float32) * r[:, None]
        part += tl.sum(w.to(tl.float32) * a[:, None, :], axis=2)
    tok = sl // TOP_K
    for m in tl.static_range(MT):  # the top-k sum of token m, in the fixed order of one reduction
        y = tl.sum(tl.where((tok == m)[:, None], part, 0.0), axis=0)
        tl.store(out_ptr + m * stride_om + oh, y.to(out_ptr.dtype.element_ty), mask=hmask)


# ------------------------------------------------------------------------------------------------------------------
# Split-K gate/up (stream experts, ``gate_up = "splitk"``): the FMA kernel above keeps its bytes in flight in
# registers (one [R, BK] tile per loop step, 14 dependent HBM round trips over H = 7168), so occupancy caps what is
# in flight. This one streams like the split-K GEMV (``specverify.kernels.gemv``): the weight rows on the MMA's M
# side and the slot's one token on a zero-padded N side of 16 columns, so the loop's loads are pipelined into
# shared memory (``num_stages``), and H is split so the grid covers the SMs about twice.
#
#   grid (S * NT, SPLIT_K), NT = ceil(I / BN). Program (s * NT + t, p) with e = topk_ids[s]:
#       P[p, s, rows]     = hidden[tok(s), k-slice p] @ gate[e][rows, k-slice p]^T       rows = [t*BN, (t+1)*BN)
#       P[p, s, I + rows] = the same for the up rows                                     (fp32)
#   the tile's last program (a self-resetting ticket per (s, t), acquire-release):
#       act[s, rows] = silu(sum_p P[p, s, rows]) * sum_p P[p, s, I + rows]                (act in w's dtype)
#   SPLIT_K == 1: the epilogue directly, no workspace. Slots whose id is -1 or >= E exit before the ticket (every
#   program of such a tile does), so their tickets stay 0 and act keeps no row the down kernel reads.
#   PDL: wait for the routing, then let the down kernel launch (it reads ids before its own wait).
# ------------------------------------------------------------------------------------------------------------------
@triton.jit
def _moe_splitk_gate_up_kernel(hidden_ptr, w13_ptr, s13_ptr, act_ptr, part_ptr, ticket_ptr, ids_ptr, stride_hm,
                               stride_we, stride_wn, stride_se, stride_sn, stride_am, k_per_split, S,
                               E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                               BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_PAD: tl.constexpr,
                               DOT_FP32: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr, QG: tl.constexpr,
                               QN: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    NT: tl.constexpr = (I + BN - 1) // BN
    slot = pid_t // NT
    t = pid_t % NT
    e = tl.load(ids_ptr + slot)
    if (e < 0) | (e >= E):
        return
    rows = t * BN + tl.arange(0, BN)
    rmask = rows < I
    x_base = hidden_ptr + (slot // TOP_K).to(tl.int64) * stride_hm
    col0 = tl.arange(0, 16) == 0  # the token sits in column 0 of the MMA's N side, the other 15 are zero
    k_lo = pid_s * k_per_split
    acc_g = tl.zeros((BN, 16), dtype=tl.float32)
    acc_u = tl.zeros((BN, 16), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BK):
        kc = k0 + tl.arange(0, BK)
        kmask = kc < H
        xt = tl.load(x_base + kc[:, None] + tl.zeros((1, 16), tl.int32), mask=kmask[:, None] & col0[None, :],
                     other=0.0)
        wg = _load_w_tile(w13_ptr, s13_ptr, e, rows, k0, rmask, stride_we, stride_wn, stride_se, stride_sn, H, BK,
                          QUANT, QG, QN)
        wu = _load_w_tile(w13_ptr, s13_ptr, e, rows + I, k0, rmask, stride_we, stride_wn, stride_se, stride_sn, H, BK,
                          QUANT, QG, QN)
        if DOT_FP32:  # the CPU interpreter (its bf16 dot is not exact, its cast to bf16 truncates)
            acc_g += tl.dot(wg.to(tl.float32), xt.to(tl.float32))
            acc_u += tl.dot(wu.to(tl.float32), xt.to(tl.float32))
        else:  # a dequantised tile goes into the MMA in x's dtype
            acc_g += tl.dot(wg.to(xt.dtype), xt)
            acc_u += tl.dot(wu.to(xt.dtype), xt)
    g = tl.sum(acc_g, axis=1)  # column 0 (the others are exact zeros)
    u = tl.sum(acc_u, axis=1)
    a_ptrs = act_ptr + slot.to(tl.int64) * stride_am + rows
    if SPLIT_K == 1:
        tl.store(a_ptrs, (g / (1.0 + tl.exp(-g)) * u).to(act_ptr.dtype.element_ty), mask=rmask)
    else:
        p_row = part_ptr + (pid_s * S + slot).to(tl.int64) * (2 * I)
        tl.store(p_row + rows, g, mask=rmask)
        tl.store(p_row + I + rows, u, mask=rmask)
        tl.debug_barrier()  # this program's partial precedes its ticket
        ticket = tl.atomic_add(ticket_ptr + pid_t, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            rs = tl.arange(0, SPLIT_PAD)
            pm = (rs < SPLIT_K)[:, None] & rmask[None, :]
            p_all = part_ptr + (rs[:, None] * S + slot).to(tl.int64) * (2 * I) + rows[None, :]
            g = tl.sum(tl.load(p_all, mask=pm, other=0.0), axis=0)
            u = tl.sum(tl.load(p_all + I, mask=pm, other=0.0), axis=0)
            tl.store(a_ptrs, (g / (1.0 + tl.exp(-g)) * u).to(act_ptr.dtype.element_ty), mask=rmask)
            tl.atomic_xchg(ticket_ptr + pid_t, 0)
