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
| WS_O      | [>= B, S, k, H, Dv] contiguous          | fp32         | split partial outputs (normalised)              |
| WS_LSE    | [>= B, S, k, H] contiguous              | fp32         | split partial lse (natural log)                 |

``PAGE_AHEAD`` (the MLA plan's config where splits walk two or more KV tiles): each tile loads the next tile's page
ids, so the KV copy depends only on loop-carried values and Triton's pipeliner can multi-buffer it. The merge kernel
takes ``PDL`` (programmatic dependent launch on sm_90+, set after the Gluon MLA kernel of
``tree_attention_wgmma.py``: it waits with ``gdc_wait`` for the split kernel's writes before its first load).
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
#: The MLA config a plan takes when its splits walk two or more KV tiles (batch x context that moves tens of MB): the
#: page ids one tile ahead (PAGE_AHEAD). Compiled offline for sm_90a (Triton 3.6 and 3.9; Kimi-K2 rank, b 8 ctx 32768
#: k 4, 16 splits), MLA_CONFIGS[0] keeps ONE KV buffer whatever num_stages is: the in-loop page-table load takes a
#: pipeline stage, so the next tile's copy is issued only after this tile's dots have read the single buffer, and its
#: latency is exposed every tile (one CTA per SM: nothing else hides it). With the page ids loaded one tile ahead the
#: KV copy depends only on loop-carried values and the pipeliner multi-buffers it (Triton 3.6): BLOCK_N 64, 3 stages:
#: 2 KV buffers, 248 regs, no spill, 188 KiB shared. H200 (run 25, Kimi-K2 rank, k 4): 152 us at batch 8 / 32k and
#: batch 64 / 4k (46.6-46.9% of copy bandwidth) against 191.5 us (37.1%) for MLA_CONFIGS[0]. BLOCK_M is capped at the
#: next power of two of the rows. A split of one tile (batch 1 at 4k: 64 splits of 64 tokens) has nothing to prefetch
#: and keeps MLA_CONFIGS[0].
MLA_BANDWIDTH_CONFIG = {"BLOCK_N": 64, "BLOCK_DV": 512, "BLOCK_M": 32, "num_warps": 8, "num_stages": 3,
                        "PAGE_AHEAD": True}
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
    Q, QR, K, V, PT, PREFIX, MASK, OUT, LSE, WS_O, WS_LSE,
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
    PAGE_AHEAD: tl.constexpr = False,
):
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
