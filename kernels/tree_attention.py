r"""Tree attention over a paged KV cache: Triton kernels (GQA/MHA and absorbed MLA) and their configs.

Math. Request b has ``L_b = prefix_lens[b] + k`` KV tokens; token t lives at page ``page_table[b, t // P]``, slot
``t % P``. For query row (draft token i, head h, KV head g = h // G):

    s_t      = sm_scale * (q[b, i, h] . K[t, g]  +  q_rope[b, i, h] . K_rope[t])        (rope term: MLA only)
    visible  = t < prefix_lens[b]                                  (the whole prefix)
             | bit (t - prefix_lens[b]) of tree_mask[b, i]          (the draft tokens; chain: j <= i)
    lse      = log sum_{t visible} exp(s_t)
    out      = sum_{t visible} exp(s_t - lse) * V[t, g]

computed with an online softmax in the exp2 domain (``qk_scale = sm_scale * log2(e)``), fp32 accumulation.

Tiling. The G query heads of one KV group times the k draft tokens form the tile's rows (row m = i * G + hg), so one
KV tile read feeds ``G * k`` rows through ``tl.dot``; MLA is the case of one KV group with G = H heads. Grid:

    axis 0: kv_head * (M_TILES * DV_TILES) + m_tile * DV_TILES + dv_tile   (programs sharing a KV tile adjacent)
    axis 1: split                                                           (split-KV over the prefix)
    axis 2: batch

Split s covers prefix tokens ``[s * C, min((s + 1) * C, prefix))`` with ``C = ceil(ceil(prefix / S) / BLOCK_N) *
BLOCK_N``; the last split continues through the k draft tokens in the same loop (their visibility read through the
bit-packed mask; ``BLOCK_K`` is unused and kept for launcher compatibility). With S > 1 each split writes a normalised partial output and its lse to the workspace and
``_tree_attention_merge_kernel`` combines them: ``lse = logsumexp_s lse_s``, ``out = sum_s exp(lse_s - lse) o_s``.
Empty splits write ``lse_s = -inf, o_s = 0``. ``DOT_FP32`` upcasts the dot operands to fp32; the launcher sets it
only under the CPU interpreter, whose bf16 ``tl.dot`` returns garbage (seen with Triton 3.9 + numpy 2.4). Loads past a request's length are masked (``other=0``) and their scores
set to -inf, so NaN in unused cache slots or garbage page ids past the length never reach the result.

Tensors (B batch, k draft tokens, H query heads, Hkv KV heads, G = H / Hkv, D qk dim, Dr rope dim (0 for GQA),
Dv value dim, P page size, S splits):

| name      | shape                                   | dtype        | meaning                                         |
| --------- | --------------------------------------- | ------------ | ----------------------------------------------- |
| Q         | [B, k, H, D] (any strides, last 1)      | bf16 / fp16  | queries (MLA: the absorbed latent query)        |
| QR        | [B, k, H, Dr]                           | as Q         | MLA rope query (unused for GQA)                 |
| K         | [num_pages, P, Hkv, D (+ Dr)] strided   | as Q         | key cache (MLA: latent + rope key, Hkv = 1)     |
| V         | [num_pages, P, Hkv, Dv] strided         | as Q         | value cache (MLA: the latent part of K)         |
| PT        | [B, max_pages]                          | int32/int64  | page table                                      |
| PREFIX    | [B]                                     | int32/int64  | prefix length (tokens before the draft tokens)  |
| MASK      | [k, ceil(k/8)] or [B, k, ceil(k/8)]     | uint8        | ancestor mask, little-endian bits, diagonal set |
| OUT       | [B, k, H, Dv] (last stride 1)           | as Q         | output                                          |
| LSE       | [B, k, H] contiguous                    | fp32         | natural-log lse of the scaled scores            |
| WS_O      | [>= B, S, k, H, Dv] contiguous          | fp32 (opt-in | split partial outputs (normalised); stored in   |
|           |                                         | bf16 / fp16) | its dtype, merged in fp32                       |
| WS_LSE    | [>= B, S, k, H] contiguous              | fp32         | split partial lse (natural log); with           |
|           | FUSED_MERGE: [>= B, S, DV_TILES, k, H]  |              | FUSED_MERGE one slot per value tile             |
| CNT       | [>= B, programs per split] (FUSED_MERGE)| int32        | finished splits; zero before and after a call   |

Opt-in variants (end of file): ``_tree_attention_mla_chunked_kernel`` (latent in column chunks, KV tile loaded once for
QK and PV, value columns over several programs), ``_tree_attention_mla_swapped_kernel`` (scores and output computed
transposed, ``s^T = K q^T`` and ``o^T += V^T p^T``, so the KV tokens / latent columns are the MMA's M dimension and
Hopper can use wgmma with 32 query rows; softmax statistics per column) and ``FUSED_MERGE`` (the last split program
merges; no merge launch). Selected through the plan's config; the defaults above do not use them. Two more opt-ins apply
to every kernel here: a bf16/fp16 ``WS_O`` (half the partial-output traffic; the lse stays fp32 and the merge sums in
fp32) and ``PDL`` (programmatic dependent launch on sm_90+: each kernel waits with ``gdc_wait`` for the previous
kernel's writes before its first load and at once lets the next kernel launch, so the merge grid is resident and waiting
when the split grid ends; the launcher sets it only on CUDA).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Configs. The launcher (specverify/attention.py) picks one by kind and sizes; the bench sweeps these lists.
# keys: BLOCK_N (KV tokens per tile), BLOCK_DV (value columns per program), num_warps, num_stages.
# BLOCK_DV = None means the whole value dim in one program.
GQA_CONFIGS = [
    {"BLOCK_N": 64, "BLOCK_DV": None, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 32, "BLOCK_DV": None, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 128, "BLOCK_DV": None, "num_warps": 8, "num_stages": 2},
    {"BLOCK_N": 64, "BLOCK_DV": None, "num_warps": 8, "num_stages": 2},
]
# MLA: 32 rows (heads x draft tokens) per program with 8 warps keeps the [32, 512] fp32 accumulator and the mma.sync
# operands in registers without spills (sm_90 resource usage); 64-row tiles (wgmma) spill. The first is the default.
# H200 sweep (bench/sweep_verify_kernels.py): BLOCK_N 64 beats 32 by 1.2-1.5x (q is re-read from shared memory by
# every warp once per tile, so longer tiles amortise it), 16 is 2x slower, 64-row wgmma tiles 1.2x slower.
MLA_CONFIGS = [
    {"BLOCK_N": 64, "BLOCK_DV": 512, "BLOCK_M": 32, "num_warps": 8, "num_stages": 2},
    {"BLOCK_N": 32, "BLOCK_DV": 512, "BLOCK_M": 32, "num_warps": 8, "num_stages": 2},
    {"BLOCK_N": 16, "BLOCK_DV": 512, "BLOCK_M": 32, "num_warps": 8, "num_stages": 3},
    {"BLOCK_N": 32, "BLOCK_DV": 512, "BLOCK_M": 32, "num_warps": 8, "num_stages": 3},
    {"BLOCK_N": 64, "BLOCK_DV": 512, "BLOCK_M": 32, "num_warps": 8, "num_stages": 3},
    {"BLOCK_N": 32, "BLOCK_DV": 512, "BLOCK_M": 64, "num_warps": 8, "num_stages": 2},
]
#: The one config used under TRITON_INTERPRET=1 (small tiles keep the CPU interpreter fast).
INTERPRETER_CONFIG = {"BLOCK_N": 16, "BLOCK_DV": None, "num_warps": 4, "num_stages": 1}
#: Rows of one program's tile (query heads of a group x draft tokens) are capped here; more rows use M tiles.
MAX_BLOCK_M = 64


@triton.jit
def _split_range(prefix, split, NUM_SPLITS, NUM_DRAFT, BLOCK_N):
    """KV positions [start, end) of one split: whole tiles of the prefix, the last split also the draft tokens."""
    chunk = tl.cdiv(tl.cdiv(prefix, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, prefix)
    if split == NUM_SPLITS - 1:
        start = tl.minimum(start, prefix)
        end = prefix + NUM_DRAFT
    return start, end


@triton.jit
def _first_tile_pages(pt_row, start, end, offs_n, PAGE_SIZE: tl.constexpr, PAGE_AHEAD: tl.constexpr):
    """PAGE_AHEAD: the page ids of a split's first KV tile, loaded before its loop (else an unused placeholder)."""
    if PAGE_AHEAD:
        return tl.load(pt_row + (start + offs_n) // PAGE_SIZE, mask=start + offs_n < end, other=0)
    return tl.zeros_like(offs_n)


@triton.jit
def _tile_pages(pt_row, pos, end, page_nxt, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                PAGE_AHEAD: tl.constexpr):
    """Page ids (int64) of the KV tile at positions ``pos`` [BLOCK_N], and the loop-carried ids of the next tile.

    PAGE_AHEAD: this tile's ids were loaded one tile earlier (``page_nxt``) and the next tile's are loaded now, so
    the KV copy depends only on loop-carried values and Triton's pipeliner can multi-buffer it (without, the
    in-loop page-table load takes a pipeline stage and the KV tile stays single-buffered). Else: loaded here."""
    if PAGE_AHEAD:
        page = page_nxt.to(tl.int64)
        pos_nxt = pos + BLOCK_N
        page_nxt = tl.load(pt_row + pos_nxt // PAGE_SIZE, mask=pos_nxt < end, other=0)
    else:
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=pos < end, other=0).to(tl.int64)
    return page, page_nxt


@triton.jit
def _online_softmax_step(s, vis, v, acc, m_i, l_i):
    """One online-softmax update with scores ``s`` (log2 domain) [M, N], visibility [M, N], values [N, DV]."""
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen nothing yet keeps m = -inf; subtracting 0 instead keeps exp2 away from (-inf) - (-inf)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _tree_attention_fwd_kernel(
    Q, QR, K, V, PT, PREFIX, MASK, OUT, LSE, WS_O, WS_LSE, CNT,
    qk_scale,
    stride_qb, stride_qt, stride_qh,
    stride_qrb, stride_qrt, stride_qrh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ptb,
    stride_mb, stride_mt,
    stride_ob, stride_ot, stride_oh,
    NUM_DRAFT: tl.constexpr, GROUP: tl.constexpr, NUM_Q_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, D: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_K: tl.constexpr, M_TILES: tl.constexpr, DV_TILES: tl.constexpr,
    HAS_MASK: tl.constexpr, V_IS_K: tl.constexpr, STORE_LSE: tl.constexpr, DOT_FP32: tl.constexpr,
    FUSED_MERGE: tl.constexpr = False, PDL: tl.constexpr = False, PAGE_AHEAD: tl.constexpr = False,
):
    if PDL:  # launched as a programmatic dependent: wait for the previous kernel's writes, let the merge launch
        gdc_wait()
        gdc_launch_dependents()
    pid0 = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    kvh = pid0 // (M_TILES * DV_TILES)
    m_tile = (pid0 // DV_TILES) % M_TILES
    dv_tile = pid0 % DV_TILES

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = offs_m < NUM_DRAFT * GROUP
    tok = offs_m // GROUP  # draft token of each row
    head = kvh * GROUP + offs_m % GROUP  # query head of each row
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = dv_tile * BLOCK_DV + tl.arange(0, BLOCK_DV)
    d_mask = offs_d < D
    dv_mask = offs_dv < DV

    b64 = b.to(tl.int64)
    q_rows = b64 * stride_qb + tok.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    if DR > 0:
        offs_dr = tl.arange(0, BLOCK_DR)
        dr_mask = offs_dr < DR
        qr_rows = b64 * stride_qrb + tok.to(tl.int64) * stride_qrt + head.to(tl.int64) * stride_qrh
        qr = tl.load(QR + qr_rows[:, None] + offs_dr[None, :], mask=row_valid[:, None] & dr_mask[None, :],
                     other=0.0)
        if DOT_FP32:
            qr = qr.to(tl.float32)

    prefix = tl.load(PREFIX + b).to(tl.int32)
    pt_row = PT + b64 * stride_ptb
    k_head = kvh.to(tl.int64) * stride_kh
    v_head = kvh.to(tl.int64) * stride_vh

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # ---- one loop: this split's prefix chunk; the last split also takes the k draft tokens ---------------------
    # Draft positions (pos >= prefix) are visible through the bit-packed tree mask; the mask load is predicated off
    # for prefix tiles, so they pay no memory traffic for it. One loop body keeps registers and code size down.
    start, end = _split_range(prefix, split, NUM_SPLITS, NUM_DRAFT, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    page_nxt = _first_tile_pages(pt_row, start, end, offs_n, PAGE_SIZE, PAGE_AHEAD)
    for start_n in range(start, end, BLOCK_N):
        pos = start_n + offs_n
        valid = pos < end
        page, page_nxt = _tile_pages(pt_row, pos, end, page_nxt, PAGE_SIZE, BLOCK_N, PAGE_AHEAD)
        slot = (pos % PAGE_SIZE).to(tl.int64)
        k_rows = page * stride_kp + slot * stride_ks + k_head
        kt = tl.load(K + k_rows[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
        if DOT_FP32:
            kt = kt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt))
        if DR > 0:
            kr = tl.load(K + k_rows[:, None] + D + offs_dr[None, :], mask=valid[:, None] & dr_mask[None, :],
                         other=0.0)
            if DOT_FP32:
                kr = kr.to(tl.float32)
            s = tl.dot(qr, tl.trans(kr), s)
        s = s * qk_scale
        if V_IS_K and BLOCK_DV == BLOCK_D and DV_TILES == 1:
            vt = kt
        else:
            v_rows = page * stride_vp + slot * stride_vs + v_head
            vt = tl.load(V + v_rows[:, None] + offs_dv[None, :], mask=valid[:, None] & dv_mask[None, :], other=0.0)
            if DOT_FP32:
                vt = vt.to(tl.float32)
        jd = pos - prefix  # draft index (>= 0 on draft tokens)
        is_draft = valid & (jd >= 0)
        jd = tl.where(is_draft, jd, 0)
        if HAS_MASK:
            byte = tl.load(MASK + b64 * stride_mb + tok[:, None] * stride_mt + (jd // 8)[None, :],
                           mask=row_valid[:, None] & is_draft[None, :], other=0)
            dvis = ((byte.to(tl.int32) >> (jd % 8)[None, :]) & 1) != 0
        else:
            dvis = jd[None, :] <= tok[:, None]
        vis = (valid[None, :] & row_valid[:, None]) & ((pos < prefix)[None, :] | dvis)
        acc, m_i, l_i = _online_softmax_step(s, vis, vt, acc, m_i, l_i)

    # ---- epilogue -----------------------------------------------------------------------------------------------
    has_any = l_i > 0.0
    out = acc / tl.where(has_any, l_i, 1.0)[:, None]
    lse = tl.where(has_any, (m_i + tl.log2(tl.where(has_any, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    if NUM_SPLITS == 1:
        o_rows = b64 * stride_ob + tok.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(OUT + o_rows[:, None] + offs_dv[None, :], out.to(OUT.dtype.element_ty),
                 mask=row_valid[:, None] & dv_mask[None, :])
        if STORE_LSE:
            if dv_tile == 0:
                l_rows = (b64 * NUM_DRAFT + tok) * NUM_Q_HEADS + head
                tl.store(LSE + l_rows, lse, mask=row_valid)
    else:
        ws_rows = ((b64 * NUM_SPLITS + split) * NUM_DRAFT + tok) * NUM_Q_HEADS + head  # [BLOCK_M] int64
        tl.store(WS_O + ws_rows[:, None] * DV + offs_dv[None, :], out.to(WS_O.dtype.element_ty),
                 mask=row_valid[:, None] & dv_mask[None, :])
        if FUSED_MERGE:
            # the last of the NUM_SPLITS programs of this (request, KV head, row tile, value tile) merges; lse slots
            # per value tile ([B, S, DV_TILES, k * H]) so it reads only what programs of its own tile wrote
            rows_per_split = NUM_DRAFT * NUM_Q_HEADS
            o_rows0 = (b64 * NUM_SPLITS * NUM_DRAFT + tok) * NUM_Q_HEADS + head
            l_rows0 = (b64 * NUM_SPLITS * DV_TILES + dv_tile) * rows_per_split + tok * NUM_Q_HEADS + head
            tl.store(WS_LSE + l_rows0 + split * DV_TILES * rows_per_split, lse, mask=row_valid)
            cnt = CNT + b64 * tl.num_programs(0) + pid0
            if _take_ticket(cnt, NUM_SPLITS):
                merged, lse_all = _split_merge_cols(WS_O, WS_LSE, o_rows0, l_rows0, rows_per_split,
                                                    DV_TILES * rows_per_split, offs_dv, dv_mask, row_valid,
                                                    NUM_SPLITS, DV)
                o_rows = b64 * stride_ob + tok.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
                tl.store(OUT + o_rows[:, None] + offs_dv[None, :], merged.to(OUT.dtype.element_ty),
                         mask=row_valid[:, None] & dv_mask[None, :])
                if STORE_LSE:
                    if dv_tile == 0:
                        tl.store(LSE + (b64 * NUM_DRAFT + tok) * NUM_Q_HEADS + head, lse_all, mask=row_valid)
                tl.atomic_xchg(cnt, 0)  # back to zero for the next call (CUDA-graph replay)
        else:
            if dv_tile == 0:
                tl.store(WS_LSE + ws_rows, lse, mask=row_valid)


@triton.jit
def _tree_attention_merge_kernel(
    WS_O, WS_LSE, OUT, LSE,
    stride_ob, stride_ot, stride_oh,
    NUM_DRAFT: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, DV: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, STORE_LSE: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # the split kernel let this grid launch early; wait until its workspace writes are visible
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)  # (b * k + i) * H + h
    dv_tile = tl.program_id(1)
    b = row // (NUM_DRAFT * NUM_Q_HEADS)
    rem = row % (NUM_DRAFT * NUM_Q_HEADS)
    i = rem // NUM_Q_HEADS
    h = rem % NUM_Q_HEADS
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    ws_rows = ((b * NUM_SPLITS + offs_s) * NUM_DRAFT + i) * NUM_Q_HEADS + h  # [BLOCK_S]
    lse_s = tl.load(WS_LSE + ws_rows, mask=s_mask, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)  # 0 for empty splits
    total = tl.sum(w, 0)
    offs_dv = dv_tile * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    o = tl.load(WS_O + ws_rows[:, None] * DV + offs_dv[None, :], mask=s_mask[:, None] & dv_mask[None, :],
                other=0.0).to(tl.float32)
    # an empty split wrote o = 0, and its weight is 0: no 0 * NaN can arise
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(OUT + b * stride_ob + i * stride_ot + h * stride_oh + offs_dv, out.to(OUT.dtype.element_ty),
             mask=dv_mask)
    if STORE_LSE:
        if dv_tile == 0:
            lse = tl.where(total > 0.0, m_safe + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
            tl.store(LSE + row, lse)


# ================================================================================================================
# Opt-in variants (selected through the plan's config; the defaults above are unchanged)
# ================================================================================================================
# MLA_CHUNKED_CONFIGS: ``_tree_attention_mla_chunked_kernel`` ("KERNEL": "mla_chunked"). The latent dim is cut into
# NC = D / D_CHUNK column chunks (NC <= 4); q's chunks are loaded once per program, each KV tile's chunks are loaded
# once and feed both the QK dot (s += q_c . k_c^T, plus the rope chunk) and the PV dot (acc_c += p . k_c), so the
# latent is never loaded twice. BLOCK_DV < 512 splits the value columns over D / BLOCK_DV programs (each still
# computes the full scores) so more CTAs stream at batch 1; its PV chunks are the first it loads (the chunk order
# is rotated per program; the QK sum does not depend on it). BLOCK_M 64 lets Hopper use wgmma, whose A operand is
# read from shared memory by the tensor cores instead of by every warp through registers.
# "FUSED_MERGE": True (any kernel) makes the last split program of a (request, row tile, value tile) merge the
# splits itself (atomic ticket in an int32 counter the merging program resets to 0), removing the merge launch.
MLA_CHUNKED_CONFIGS = [
    # sm_90a resources from `python bench/sweep_verify_kernels.py --resources` (offline compile, Triton 3.9): all
    # spill-free; shared bytes per CTA in brackets. 64-row tiles with 8 warps (wgmma) spilled 56-280 B and BLOCK_N 128
    # needs > 227 KB of shared memory, so neither is listed.
    {"KERNEL": "mla_chunked", "D_CHUNK": 128, "BLOCK_N": 64, "BLOCK_DV": 256, "BLOCK_M": 32, "num_warps": 8,
     "num_stages": 3},  # mma.sync, 164 regs [115 KB]
    {"KERNEL": "mla_chunked", "D_CHUNK": 128, "BLOCK_N": 64, "BLOCK_DV": 512, "BLOCK_M": 32, "num_warps": 8,
     "num_stages": 2},
    {"KERNEL": "mla_chunked", "D_CHUNK": 128, "BLOCK_N": 32, "BLOCK_DV": 256, "BLOCK_M": 32, "num_warps": 4,
     "num_stages": 4},  # mma.sync, 243 regs [78 KB]
    {"KERNEL": "mla_chunked", "D_CHUNK": 128, "BLOCK_N": 64, "BLOCK_DV": 128, "BLOCK_M": 64, "num_warps": 4,
     "num_stages": 2},
    {"KERNEL": "mla_chunked", "D_CHUNK": 128, "BLOCK_N": 32, "BLOCK_DV": 128, "BLOCK_M": 64, "num_warps": 4,
     "num_stages": 4},
    {"KERNEL": "mla_chunked", "D_CHUNK": 128, "BLOCK_N": 64, "BLOCK_DV": 128, "BLOCK_M": 32, "num_warps": 4,
     "num_stages": 3},
]
# MLA_PAGE_AHEAD_CONFIGS: the default kernel with PAGE_AHEAD (issue 4, MLA bandwidth). Compiled offline for sm_90a
# (Triton 3.6 as on the H200 machine, and 3.9; Kimi-K2 rank, b 8 ctx 32768 k 4, 16 splits), the default MLA config
# keeps ONE KV buffer whatever num_stages is (2, 3 or 4) and waits for every copy at the top of each tile: the
# in-loop page-table load takes a pipeline stage, so the next tile's copy is issued only after this tile's dots have
# read the single buffer, and its latency is exposed every tile (one CTA per SM: nothing else hides it; the GQA
# shapes reach 81% because several CTAs share an SM). With the page ids loaded one tile ahead the KV copy depends
# only on loop-carried values and the pipeliner multi-buffers it (Triton 3.6): BLOCK_N 64, 3 stages: 2 KV buffers,
# one tile in flight while the other is used, 248 regs, no spill, 188 KiB shared; BLOCK_N 32, 4 stages: 3 buffers
# (two tiles in flight), 178 regs, 148 KiB; BLOCK_N 32, 3 stages: 2 buffers, 178 regs, 112 KiB.
# The swapped kernel (wgmma) has the same single-stage wait; with PAGE_AHEAD at BLOCK_N 32 / 4 stages it keeps three
# KV buffers and two tiles in flight (178 regs, 146 KiB; BLOCK_N 64 would need 256 KiB for three buffers).
# H200 (run 25, Kimi-K2 rank, k 4): BLOCK_N 64 / 3 stages took 152 us at batch 8 / 32k and batch 64 / 4k (46.6-46.9%
# of copy bandwidth) against 191.5 us (37.1%) for the default; the BLOCK_N 32 rows (M 32, mma.sync) took ~247 us.
# Entries 4-7 (offline, Triton 3.6, at 16 heads): 64-row tiles, where both dots are wgmma and one program covers the
# 64 rows of a k 4 tree of 16 heads: BLOCK_N 32 with 3 / 4 stages (3 / 4 KV buffers, 246 regs, no spill, 188 / 224
# KiB), BLOCK_N 64 with 2 stages (2 buffers, 255 regs, no spill, 224 KiB); and the swapped kernel at BLOCK_N 64 /
# 2 stages (2 buffers, 238 regs, 184 KiB). Run 26 timed them at the Kimi-K2 rank, whose 8 heads give a k 4 tree 32
# rows: there the 64-row tiles were half empty and took 249-302 us; the swapped one took 171 us.
MLA_PAGE_AHEAD_CONFIGS = [
    {"BLOCK_N": 64, "BLOCK_DV": 512, "BLOCK_M": 32, "num_warps": 8, "num_stages": 3, "PAGE_AHEAD": True},
    {"BLOCK_N": 32, "BLOCK_DV": 512, "BLOCK_M": 32, "num_warps": 8, "num_stages": 4, "PAGE_AHEAD": True},
    {"BLOCK_N": 32, "BLOCK_DV": 512, "BLOCK_M": 32, "num_warps": 8, "num_stages": 3, "PAGE_AHEAD": True},
    {"KERNEL": "mla_swapped", "BLOCK_N": 32, "BLOCK_M": 32, "num_warps": 8, "num_stages": 4, "PAGE_AHEAD": True},
    {"BLOCK_N": 32, "BLOCK_DV": 512, "BLOCK_M": 64, "num_warps": 8, "num_stages": 3, "PAGE_AHEAD": True},
    {"BLOCK_N": 32, "BLOCK_DV": 512, "BLOCK_M": 64, "num_warps": 8, "num_stages": 4, "PAGE_AHEAD": True},
    {"BLOCK_N": 64, "BLOCK_DV": 512, "BLOCK_M": 64, "num_warps": 8, "num_stages": 2, "PAGE_AHEAD": True},
    {"KERNEL": "mla_swapped", "BLOCK_N": 64, "BLOCK_M": 32, "num_warps": 8, "num_stages": 2, "PAGE_AHEAD": True},
]
#: The MLA config a plan takes when its splits walk two or more KV tiles (batch x context that moves tens of MB):
#: the KV tile multi-buffered (PAGE_AHEAD). BLOCK_M is capped at the next power of two of the rows. A split of one
#: tile (batch 1 at 4k: 64 splits of 64 tokens) has nothing to prefetch and keeps MLA_CONFIGS[0].
MLA_BANDWIDTH_CONFIG = MLA_PAGE_AHEAD_CONFIGS[0]
# GQA_BANDWIDTH_CONFIGS: long tiles and deep pipelines for batch x context that moves hundreds of MB (with few splits).
GQA_BANDWIDTH_CONFIGS = [
    # the default GQA tile with the page ids one tile ahead: 2 K and 2 V buffers instead of 1 (Triton 3.6 offline,
    # Llama-3.1-8B b 8 ctx 32768 k 4: 158 regs, 72 KiB shared); not yet timed
    {"BLOCK_N": 64, "BLOCK_DV": None, "num_warps": 4, "num_stages": 3, "PAGE_AHEAD": True},
    {"BLOCK_N": 128, "BLOCK_DV": None, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 128, "BLOCK_DV": None, "num_warps": 8, "num_stages": 4},
    {"BLOCK_N": 64, "BLOCK_DV": None, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 128, "BLOCK_DV": None, "num_warps": 4, "num_stages": 3},
]
# MLA_LATENCY_CONFIGS: the batch-1 latency levers (issue 4, Kimi-K2 b1 ctx 4096 k 4 <= 10 us), for
# bench/sweep_attention.py. Each is a full config (tile + opt-ins); the split count is the sweep's. "PARTIAL_DTYPE"
# bf16 halves the split workspace written by every split program and read back by the merge (at 64 splits x 32 rows
# x 512 columns that is 4 MB in fp32: as much as the KV itself); "PDL" hides the merge launch behind the split
# grid; fewer rows (BLOCK_M 16) or fewer value columns per program spread a split over more SMs; MERGE_BLOCK_DV sets
# how many programs the merge uses (512 / width per output row).
_MLA_TILE = {"BLOCK_N": 64, "BLOCK_DV": 512, "BLOCK_M": 32, "num_warps": 8, "num_stages": 2}
_LAT = {"PARTIAL_DTYPE": "bf16", "PDL": True}
MLA_LATENCY_CONFIGS = {
    "bf16": dict(_MLA_TILE, PARTIAL_DTYPE="bf16"),
    "pdl": dict(_MLA_TILE, PDL=True),
    "bf16+pdl": dict(_MLA_TILE, **_LAT),
    "bf16+pdl N32": dict(_MLA_TILE, BLOCK_N=32, **_LAT),
    "bf16+pdl stages1": dict(_MLA_TILE, num_stages=1, **_LAT),
    "bf16+pdl merge32": dict(_MLA_TILE, MERGE_BLOCK_DV=32, **_LAT),
    "bf16+pdl merge128": dict(_MLA_TILE, MERGE_BLOCK_DV=128, **_LAT),
    "bf16+pdl merge512 w8": dict(_MLA_TILE, MERGE_BLOCK_DV=512, MERGE_WARPS=8, **_LAT),
    "bf16+pdl M16": dict(_MLA_TILE, BLOCK_M=16, **_LAT),
    "bf16+pdl M16 DV256": dict(_MLA_TILE, BLOCK_M=16, BLOCK_DV=256, **_LAT),
    "bf16+pdl DV256": dict(_MLA_TILE, BLOCK_DV=256, **_LAT),
    "chunk DV256 bf16+pdl": dict(MLA_CHUNKED_CONFIGS[0], **_LAT),
    "chunk DV128 bf16+pdl": dict(MLA_CHUNKED_CONFIGS[5], **_LAT),
    "chunk DV256 N32 bf16+pdl": dict(MLA_CHUNKED_CONFIGS[2], **_LAT),
    "fused bf16+pdl": dict(_MLA_TILE, FUSED_MERGE=True, **_LAT),
    "chunk DV128 fused bf16+pdl": dict(MLA_CHUNKED_CONFIGS[5], FUSED_MERGE=True, **_LAT),
}
#: The most latent chunks the chunked MLA kernel holds (q0..q3 / k0..k3).
MAX_D_CHUNKS = 4


@triton.jit
def _split_merge_cols(WS_O, WS_LSE, o_rows0, l_rows0, o_split_stride, l_split_stride, offs_c, c_mask, row_valid,
                      NUM_SPLITS: tl.constexpr, DV: tl.constexpr):
    """Merge the NUM_SPLITS normalised partial outputs of [M] rows over the columns ``offs_c``.

    Row r of split s sits at ``WS_O[(o_rows0[r] + s * o_split_stride) * DV + col]`` with its lse at
    ``WS_LSE[l_rows0[r] + s * l_split_stride]``. Returns (out [M, C] fp32, lse [M] natural log, -inf when empty).
    Loads bypass L1 (``.cg``): other CTAs wrote these lines.
    """
    m = tl.full(o_rows0.shape, float("-inf"), dtype=tl.float32)
    for s in range(NUM_SPLITS):
        lse_s = tl.load(WS_LSE + l_rows0 + s * l_split_stride, mask=row_valid, other=float("-inf"),
                        cache_modifier=".cg")
        m = tl.maximum(m, lse_s)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros(o_rows0.shape, dtype=tl.float32)
    acc = tl.zeros([o_rows0.shape[0], offs_c.shape[0]], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        lse_s = tl.load(WS_LSE + l_rows0 + s * l_split_stride, mask=row_valid, other=float("-inf"),
                        cache_modifier=".cg")
        w = tl.exp(lse_s - m_safe)  # 0 for an empty split (lse -inf), whose o is 0
        o = tl.load(WS_O + (o_rows0 + s * o_split_stride)[:, None] * DV + offs_c[None, :],
                    mask=row_valid[:, None] & c_mask[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
        acc += w[:, None] * o
        total += w
    has_any = total > 0.0
    out = acc / tl.where(has_any, total, 1.0)[:, None]
    lse = tl.where(has_any, m_safe + tl.log(tl.where(has_any, total, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _take_ticket(CNT, NUM_SPLITS: tl.constexpr):
    """True in the last of NUM_SPLITS programs to arrive at counter CNT (int32); that program must reset it."""
    tl.debug_barrier()  # every warp's workspace stores are issued before the release below
    ticket = tl.atomic_add(CNT, 1, sem="acq_rel", scope="gpu")
    return ticket == NUM_SPLITS - 1


@triton.jit
def _tree_attention_mla_chunked_kernel(
    Q, QR, KV, PT, PREFIX, MASK, OUT, LSE, WS_O, WS_LSE, CNT,
    qk_scale,
    stride_qb, stride_qt, stride_qh,
    stride_qrb, stride_qrt, stride_qrh,
    stride_kp, stride_ks,
    stride_ptb,
    stride_mb, stride_mt,
    stride_ob, stride_ot, stride_oh,
    NUM_DRAFT: tl.constexpr, NUM_Q_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    D: tl.constexpr, DR: tl.constexpr, DC: tl.constexpr, NC: tl.constexpr, CPT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DR: tl.constexpr, M_TILES: tl.constexpr,
    DV_TILES: tl.constexpr, HAS_MASK: tl.constexpr, STORE_LSE: tl.constexpr, FUSED_MERGE: tl.constexpr,
    DOT_FP32: tl.constexpr, PDL: tl.constexpr = False,
):
    """Absorbed MLA (one latent KV, H = NUM_Q_HEADS heads): the latent in NC chunks of DC columns (D = NC * DC),
    CPT = NC / DV_TILES of them accumulated by this program. Grid as ``_tree_attention_fwd_kernel`` (kv_head 0)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid0 = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    m_tile = pid0 // DV_TILES
    dv_tile = pid0 % DV_TILES

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = offs_m < NUM_DRAFT * NUM_Q_HEADS
    tok = offs_m // NUM_Q_HEADS
    head = offs_m % NUM_Q_HEADS
    offs_c = tl.arange(0, DC)
    offs_dr = tl.arange(0, BLOCK_DR)
    dr_mask = offs_dr < DR
    # chunk j of this program covers latent columns c_j * DC ..; the first CPT are the ones it accumulates
    c0 = ((dv_tile * CPT + 0) % NC) * DC
    c1 = ((dv_tile * CPT + 1) % NC) * DC
    c2 = ((dv_tile * CPT + 2) % NC) * DC
    c3 = ((dv_tile * CPT + 3) % NC) * DC

    b64 = b.to(tl.int64)
    q_rows = b64 * stride_qb + tok.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q_ptr = Q + q_rows[:, None] + offs_c[None, :]
    q0 = tl.load(q_ptr + c0, mask=row_valid[:, None], other=0.0)
    if DOT_FP32:
        q0 = q0.to(tl.float32)
    if NC > 1:
        q1 = tl.load(q_ptr + c1, mask=row_valid[:, None], other=0.0)
        if DOT_FP32:
            q1 = q1.to(tl.float32)
    if NC > 2:
        q2 = tl.load(q_ptr + c2, mask=row_valid[:, None], other=0.0)
        q3 = tl.load(q_ptr + c3, mask=row_valid[:, None], other=0.0)
        if DOT_FP32:
            q2 = q2.to(tl.float32)
            q3 = q3.to(tl.float32)
    qr_rows = b64 * stride_qrb + tok.to(tl.int64) * stride_qrt + head.to(tl.int64) * stride_qrh
    qr = tl.load(QR + qr_rows[:, None] + offs_dr[None, :], mask=row_valid[:, None] & dr_mask[None, :], other=0.0)
    if DOT_FP32:
        qr = qr.to(tl.float32)

    prefix = tl.load(PREFIX + b).to(tl.int32)
    pt_row = PT + b64 * stride_ptb
    acc0 = tl.zeros([BLOCK_M, DC], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, DC], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, DC], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_M, DC], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    start, end = _split_range(prefix, split, NUM_SPLITS, NUM_DRAFT, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        pos = start_n + offs_n
        valid = pos < end
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        slot = (pos % PAGE_SIZE).to(tl.int64)
        kv_ptr = KV + (page * stride_kp + slot * stride_ks)[:, None] + offs_c[None, :]
        k0 = tl.load(kv_ptr + c0, mask=valid[:, None], other=0.0)
        if DOT_FP32:
            k0 = k0.to(tl.float32)
        s = tl.dot(q0, tl.trans(k0))
        if NC > 1:
            k1 = tl.load(kv_ptr + c1, mask=valid[:, None], other=0.0)
            if DOT_FP32:
                k1 = k1.to(tl.float32)
            s = tl.dot(q1, tl.trans(k1), s)
        if NC > 2:
            k2 = tl.load(kv_ptr + c2, mask=valid[:, None], other=0.0)
            k3 = tl.load(kv_ptr + c3, mask=valid[:, None], other=0.0)
            if DOT_FP32:
                k2 = k2.to(tl.float32)
                k3 = k3.to(tl.float32)
            s = tl.dot(q2, tl.trans(k2), s)
            s = tl.dot(q3, tl.trans(k3), s)
        kr = tl.load(KV + (page * stride_kp + slot * stride_ks)[:, None] + D + offs_dr[None, :],
                     mask=valid[:, None] & dr_mask[None, :], other=0.0)
        if DOT_FP32:
            kr = kr.to(tl.float32)
        s = tl.dot(qr, tl.trans(kr), s) * qk_scale
        jd = pos - prefix
        is_draft = valid & (jd >= 0)
        jd = tl.where(is_draft, jd, 0)
        if HAS_MASK:
            byte = tl.load(MASK + b64 * stride_mb + tok[:, None] * stride_mt + (jd // 8)[None, :],
                           mask=row_valid[:, None] & is_draft[None, :], other=0)
            dvis = ((byte.to(tl.int32) >> (jd % 8)[None, :]) & 1) != 0
        else:
            dvis = jd[None, :] <= tok[:, None]
        vis = (valid[None, :] & row_valid[:, None]) & ((pos < prefix)[None, :] | dvis)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        p = p.to(k0.dtype)
        acc0 = tl.dot(p, k0, acc0 * alpha[:, None])
        if CPT > 1:
            acc1 = tl.dot(p, k1, acc1 * alpha[:, None])
        if CPT > 2:
            acc2 = tl.dot(p, k2, acc2 * alpha[:, None])
            acc3 = tl.dot(p, k3, acc3 * alpha[:, None])

    # ---- epilogue -----------------------------------------------------------------------------------------------
    has_any = l_i > 0.0
    inv_l = 1.0 / tl.where(has_any, l_i, 1.0)
    lse = tl.where(has_any, (m_i + tl.log2(tl.where(has_any, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    if NUM_SPLITS == 1:
        o_ptr = OUT + (b64 * stride_ob + tok.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh)[:, None] \
            + offs_c[None, :]
        tl.store(o_ptr + c0, (acc0 * inv_l[:, None]).to(OUT.dtype.element_ty), mask=row_valid[:, None])
        if CPT > 1:
            tl.store(o_ptr + c1, (acc1 * inv_l[:, None]).to(OUT.dtype.element_ty), mask=row_valid[:, None])
        if CPT > 2:
            tl.store(o_ptr + c2, (acc2 * inv_l[:, None]).to(OUT.dtype.element_ty), mask=row_valid[:, None])
            tl.store(o_ptr + c3, (acc3 * inv_l[:, None]).to(OUT.dtype.element_ty), mask=row_valid[:, None])
        if STORE_LSE:
            if dv_tile == 0:
                tl.store(LSE + (b64 * NUM_DRAFT + tok) * NUM_Q_HEADS + head, lse, mask=row_valid)
    else:
        rows_per_split = NUM_DRAFT * NUM_Q_HEADS
        o_rows0 = b64 * NUM_SPLITS * rows_per_split + offs_m  # split 0's row; + s * rows_per_split for split s
        ws_ptr = WS_O + (o_rows0 + split * rows_per_split)[:, None] * D + offs_c[None, :]
        tl.store(ws_ptr + c0, (acc0 * inv_l[:, None]).to(WS_O.dtype.element_ty), mask=row_valid[:, None])
        if CPT > 1:
            tl.store(ws_ptr + c1, (acc1 * inv_l[:, None]).to(WS_O.dtype.element_ty), mask=row_valid[:, None])
        if CPT > 2:
            tl.store(ws_ptr + c2, (acc2 * inv_l[:, None]).to(WS_O.dtype.element_ty), mask=row_valid[:, None])
            tl.store(ws_ptr + c3, (acc3 * inv_l[:, None]).to(WS_O.dtype.element_ty), mask=row_valid[:, None])
        if FUSED_MERGE:
            # lse slots per value tile: [B, S, DV_TILES, k * H]; the merging program reads only its own tile's
            l_rows0 = (b64 * NUM_SPLITS * DV_TILES + dv_tile) * rows_per_split + offs_m
            tl.store(WS_LSE + l_rows0 + split * DV_TILES * rows_per_split, lse, mask=row_valid)
            cnt = CNT + b64 * (M_TILES * DV_TILES) + pid0
            if _take_ticket(cnt, NUM_SPLITS):
                o_ptr = OUT + (b64 * stride_ob + tok.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh)[
                    :, None] + offs_c[None, :]
                c_ok = offs_c < DC
                out, lse_all = _split_merge_cols(WS_O + c0, WS_LSE, o_rows0, l_rows0, rows_per_split,
                                                 DV_TILES * rows_per_split, offs_c, c_ok, row_valid, NUM_SPLITS, D)
                tl.store(o_ptr + c0, out.to(OUT.dtype.element_ty), mask=row_valid[:, None])
                if CPT > 1:
                    out, lse_all = _split_merge_cols(WS_O + c1, WS_LSE, o_rows0, l_rows0, rows_per_split,
                                                     DV_TILES * rows_per_split, offs_c, c_ok, row_valid, NUM_SPLITS,
                                                     D)
                    tl.store(o_ptr + c1, out.to(OUT.dtype.element_ty), mask=row_valid[:, None])
                if CPT > 2:
                    out, lse_all = _split_merge_cols(WS_O + c2, WS_LSE, o_rows0, l_rows0, rows_per_split,
                                                     DV_TILES * rows_per_split, offs_c, c_ok, row_valid, NUM_SPLITS,
                                                     D)
                    tl.store(o_ptr + c2, out.to(OUT.dtype.element_ty), mask=row_valid[:, None])
                    out, lse_all = _split_merge_cols(WS_O + c3, WS_LSE, o_rows0, l_rows0, rows_per_split,
                                                     DV_TILES * rows_per_split, offs_c, c_ok, row_valid, NUM_SPLITS,
                                                     D)
                    tl.store(o_ptr + c3, out.to(OUT.dtype.element_ty), mask=row_valid[:, None])
                if STORE_LSE:
                    if dv_tile == 0:
                        tl.store(LSE + (b64 * NUM_DRAFT + tok) * NUM_Q_HEADS + head, lse_all, mask=row_valid)
                tl.atomic_xchg(cnt, 0)  # back to zero for the next call (CUDA-graph replay)
        else:
            if dv_tile == 0:
                tl.store(WS_LSE + o_rows0 + split * rows_per_split, lse, mask=row_valid)


# MLA_SWAPPED_CONFIGS: ``_tree_attention_mla_swapped_kernel`` ("KERNEL": "mla_swapped", issue 4 bandwidth). The
# product is computed transposed so the KV tile is the MMA's M dimension: S^T = K Q^T is [BLOCK_N, BLOCK_M] and
# O^T = V^T P^T is [D, BLOCK_M]. With 32 query rows per program (Kimi-K2 rank: 8 heads x k 4) the default kernel's
# dots have M = 32, which Hopper runs on mma.sync; here M is the 64 KV tokens of a tile (QK) or the 512 latent
# columns (PV), so both dots can use wgmma with both of their big operands (the KV tile, read once) in shared memory
# and the query rows as N (16..256). The softmax runs down the KV axis (per-column statistics). BLOCK_DV is
# always the whole latent (one value tile); BLOCK_M 64 covers k 8 trees (8 heads x 8 tokens) in one program. A tree
# mask of <= 32 draft tokens is read once per program (one int32 of ancestor bits per query row), not per tile.
# sm_90a resources (offline compile, Triton 3.9, Kimi-K2 rank at batch 64 / 4k, 2 splits; `python
# bench/sweep_verify_kernels.py --resources`), shared bytes per CTA in brackets: the KV tiles of the pipeline stages
# (BLOCK_N x 576 x 2 B each) plus q. BLOCK_N 64: both dots wgmma (m64n16 for QK, m64n32 for PV); with 3 stages the
# page-table load runs two tiles ahead. BLOCK_N 32: the QK dot (M 32) falls back to mma.sync and the pipeliner keeps
# one KV buffer, but 4 warps use 76 KB and 255 registers, so two CTAs fit on an SM (force twice the splits). Not
# listed: 4 warps at BLOCK_N 64 (the [512, 32] fp32 accumulator is 128 registers per thread: 272 B spilled), BLOCK_M
# 64 at BLOCK_N 64 (224 KB, 480 B spilled with 8 warps, 1136 B with 16).
MLA_SWAPPED_CONFIGS = [
    {"KERNEL": "mla_swapped", "BLOCK_N": 64, "BLOCK_M": 32, "num_warps": 8, "num_stages": 2},  # 255 regs [184 KB]
    {"KERNEL": "mla_swapped", "BLOCK_N": 64, "BLOCK_M": 32, "num_warps": 8, "num_stages": 3},  # 255 regs [185 KB]
    {"KERNEL": "mla_swapped", "BLOCK_N": 32, "BLOCK_M": 32, "num_warps": 4, "num_stages": 3},  # 255 regs [74 KB]
    {"KERNEL": "mla_swapped", "BLOCK_N": 32, "BLOCK_M": 32, "num_warps": 8, "num_stages": 3},  # 172 regs [74 KB]
    {"KERNEL": "mla_swapped", "BLOCK_N": 32, "BLOCK_M": 64, "num_warps": 8, "num_stages": 3},  # 228 regs [113 KB]
]
# the swapped kernel with the batch-1 latency levers (bf16 partials + PDL) for bench/sweep_attention.py
MLA_LATENCY_CONFIGS.update({
    "swap bf16+pdl": dict(MLA_SWAPPED_CONFIGS[0], **_LAT),
    "swap s3 bf16+pdl": dict(MLA_SWAPPED_CONFIGS[1], **_LAT),
    "swap N32 w4 bf16+pdl": dict(MLA_SWAPPED_CONFIGS[2], **_LAT),
})


@triton.jit
def _tree_attention_mla_swapped_kernel(
    Q, QR, KV, PT, PREFIX, MASK, OUT, LSE, WS_O, WS_LSE,
    qk_scale,
    stride_qb, stride_qt, stride_qh,
    stride_qrb, stride_qrt, stride_qrh,
    stride_kp, stride_ks,
    stride_ptb,
    stride_mb, stride_mt,
    stride_ob, stride_ot, stride_oh,
    NUM_DRAFT: tl.constexpr, NUM_Q_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    D: tl.constexpr, DR: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, STORE_LSE: tl.constexpr, DOT_FP32: tl.constexpr,
    PDL: tl.constexpr = False, PAGE_AHEAD: tl.constexpr = False,
):
    """Absorbed MLA with transposed products: ``s^T = K q^T`` [BLOCK_N, BLOCK_M], ``o^T += V^T p^T`` [BLOCK_D,
    BLOCK_M] (V = the latent part of K). Grid: (row tile, split, batch); workspace and merge as
    ``_tree_attention_fwd_kernel`` with one value tile."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    m_tile = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = offs_m < NUM_DRAFT * NUM_Q_HEADS
    tok = offs_m // NUM_Q_HEADS
    head = offs_m % NUM_Q_HEADS
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    offs_dr = tl.arange(0, BLOCK_DR)
    dr_mask = offs_dr < DR

    b64 = b.to(tl.int64)
    q_rows = b64 * stride_qb + tok.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    qr_rows = b64 * stride_qrb + tok.to(tl.int64) * stride_qrt + head.to(tl.int64) * stride_qrh
    qr = tl.load(QR + qr_rows[:, None] + offs_dr[None, :], mask=row_valid[:, None] & dr_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
        qr = qr.to(tl.float32)
    q_t = tl.trans(q)  # [BLOCK_D, BLOCK_M]: the B operand of the score product
    qr_t = tl.trans(qr)

    prefix = tl.load(PREFIX + b).to(tl.int32)
    pt_row = PT + b64 * stride_ptb
    if HAS_MASK and NUM_DRAFT <= 32:
        # each row's ancestor bits as one int32 (<= 4 mask bytes), loaded once: no mask gather inside the loop
        row_bits = tl.zeros([BLOCK_M], dtype=tl.int32)
        for j in tl.static_range((NUM_DRAFT + 7) // 8):
            byte = tl.load(MASK + b64 * stride_mb + tok * stride_mt + j, mask=row_valid, other=0)
            row_bits = row_bits | (byte.to(tl.int32) << (8 * j))
    acc_t = tl.zeros([BLOCK_D, BLOCK_M], dtype=tl.float32)  # o^T: latent columns x query rows
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    start, end = _split_range(prefix, split, NUM_SPLITS, NUM_DRAFT, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    page_nxt = _first_tile_pages(pt_row, start, end, offs_n, PAGE_SIZE, PAGE_AHEAD)
    for start_n in range(start, end, BLOCK_N):
        pos = start_n + offs_n
        valid = pos < end
        page, page_nxt = _tile_pages(pt_row, pos, end, page_nxt, PAGE_SIZE, BLOCK_N, PAGE_AHEAD)
        kv_rows = page * stride_kp + (pos % PAGE_SIZE).to(tl.int64) * stride_ks
        kt = tl.load(KV + kv_rows[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
        kr = tl.load(KV + kv_rows[:, None] + D + offs_dr[None, :], mask=valid[:, None] & dr_mask[None, :],
                     other=0.0)
        if DOT_FP32:
            kt = kt.to(tl.float32)
            kr = kr.to(tl.float32)
        s_t = tl.dot(kt, q_t)  # [BLOCK_N, BLOCK_M]
        s_t = tl.dot(kr, qr_t, s_t) * qk_scale
        jd = pos - prefix
        is_draft = valid & (jd >= 0)
        jd = tl.where(is_draft, jd, 0)
        if HAS_MASK:
            if NUM_DRAFT <= 32:
                dvis = ((row_bits[None, :] >> jd[:, None]) & 1) != 0
            else:
                byte = tl.load(MASK + b64 * stride_mb + tok[None, :] * stride_mt + (jd // 8)[:, None],
                               mask=is_draft[:, None] & row_valid[None, :], other=0)
                dvis = ((byte.to(tl.int32) >> (jd % 8)[:, None]) & 1) != 0
        else:
            dvis = jd[:, None] <= tok[None, :]
        vis = (valid[:, None] & row_valid[None, :]) & ((pos < prefix)[:, None] | dvis)
        s_t = tl.where(vis, s_t, float("-inf"))
        # online softmax down the KV axis: one (m, l) per query row = per column
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p_t = tl.exp2(s_t - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p_t, 0)
        m_i = m_new
        acc_t = tl.dot(tl.trans(kt), p_t.to(kt.dtype), acc_t * alpha[None, :])  # [BLOCK_D, BLOCK_M]

    # ---- epilogue -----------------------------------------------------------------------------------------------
    has_any = l_i > 0.0
    out_t = acc_t * (1.0 / tl.where(has_any, l_i, 1.0))[None, :]
    lse = tl.where(has_any, (m_i + tl.log2(tl.where(has_any, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    st_mask = d_mask[:, None] & row_valid[None, :]
    if NUM_SPLITS == 1:
        o_rows = b64 * stride_ob + tok.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(OUT + o_rows[None, :] + offs_d[:, None], out_t.to(OUT.dtype.element_ty), mask=st_mask)
        if STORE_LSE:
            tl.store(LSE + (b64 * NUM_DRAFT + tok) * NUM_Q_HEADS + head, lse, mask=row_valid)
    else:
        ws_rows = ((b64 * NUM_SPLITS + split) * NUM_DRAFT + tok) * NUM_Q_HEADS + head
        tl.store(WS_O + ws_rows[None, :] * D + offs_d[:, None], out_t.to(WS_O.dtype.element_ty), mask=st_mask)
        tl.store(WS_LSE + ws_rows, lse, mask=row_valid)
