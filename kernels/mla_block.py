"""The attention half of one MLA verify layer at a few tokens in one persistent launch (issue 22): qkv_a, q_a's
RMSNorm and q_b, the KV preparation, the query absorption, split-KV tree attention, the split merge with the V
up-projection, and o_proj.

Math, for token rows ``m < MT`` (request ``b = m // KQ``, draft node ``i = m % KQ``) of the normalised hidden state
``x`` [MT, H]; every product accumulates in fp32 and is rounded to x's dtype where the op chain it replaces rounds:

    qkv        = x @ W_a^T                                   [MT, Q + R + DR]   (q_a, latent, rope key)
    qn         = rmsnorm(qkv[:, :Q]) * w_qn                  (q_a's norm, rounded)
    qb         = qn @ W_b^T                                  [MT, NH, NOPE + DR]
    cache[b, prefix_b + i] = [rmsnorm(qkv[:, Q:Q+R]) * w_kvn, rope(qkv[:, Q+R:], pos)]   (the KV write)
    q_lat[h]   = qb[h, :NOPE] @ W_uk[h]                      [MT, NH, R]        (absorbed query)
    q_pe[h]    = rope(qb[h, NOPE:], pos)
    o_lat      = tree attention of (q_lat, q_pe) over the request's prefix + draft tokens (tree mask), V = latent
    v[h]       = o_lat[h] @ W_uv[h]                          [MT, NH * V]
    out        = v @ W_o^T                                   [MT, H]

Why one launch: the op chain runs these as eight kernels whose bytes (a Kimi-K2 rank: 52 MB of weights, 4.7 MB of
KV at 4k) would take 13 µs at the copy bandwidth, yet they take ~35: each small kernel pays its ramp, tail and
dependent round trips. In one grid a step costs its bytes plus a grid barrier (~1 µs), and the weights of the
next steps go to L2 before the barrier (``bench/bench_chain_latency.py``: a persistent 4-8 MiB step runs at the
floor + 0.8-1.3 µs, a PDL kernel at the floor + 1.7-2.3).

Grid: ``NPROG`` programs, all resident at once. Each phase hands its items out round-robin (item ``i`` to program
``i % NPROG``); a grid barrier separates the phases:

    1  qkv_a: items (row tile of TA rows, K split); fp32 partials, the tile's last item (a self-resetting ticket)
       sums them into qkv. Before the PDL wait each program sends its first slice to L2.
    2  every program computes q_a's RMSNorm scale of each token (Q values from L2); items (q_b tile of TB rows, K split)
       as phase 1 with the norm applied to x on load; MT more items prepare the KV of one token each.
    3  items (head, R tile of BR): the absorbed query; the R tile 0 items also rotate the head's rope query.
    4  items (request, KV split, value chunk of RCH columns): tree attention of every head and node of the request
       over the split's KV tiles (the split range of ``tree_attention``: whole tiles of the prefix, the last split
       the draft tokens too); each item computes the whole score (over R in RCH chunks, and the rope part) and
       accumulates its chunk of the value: a normalised partial output chunk per row, and (chunk 0) its lse. The
       KV tile is read from HBM once and from L2 by the split's other items; registers hold one chunk.
    5  items (head, R chunk of BC): the chunk of each row's merged output (logsumexp weights over the splits),
       rounded, times the chunk's W_uv rows: a partial of v[h]; the head's last item sums the partials.
    6  items of RH output rows of o_proj (the whole K = NH * V each).

Weights are constant, so before barrier 1 each program sends its first phase-2 and phase-3 slices to L2, and
before barrier ``PF_O`` (1, 3 or 4; 0: never) its phase-6 rows of W_o and its phase-5 rows of W_uv. Activations
written inside the launch are read with ``.cg`` (from L2, past the SM's L1).

A grid barrier is the moe block's (``kernels/moe_block.py``): one release add on ``BAR[0]``, acquire spin until
``NPROG`` times the barrier's number; the last program out resets both counters (graph-replayable). The kernel lets
its dependents launch after barrier 5. ``PHASE`` 1-6 runs one phase alone (no barriers): the CPU interpreter runs
the six in turn.

Tensors: x [MT, H] bf16/fp16 (unit column stride); W_a [Q + R + DR, H], w_qn [Q], W_b [NH * (NOPE + DR), Q],
w_kvn [R], W_uk [NH, NOPE, R], W_uv [NH, R, V], W_o [H, NH * V], all contiguous in x's dtype; cache [pages, P,
R + DR] (unit last stride); page table int32 [B, max_pages]; prefix int32 [B]; pos int64 [MT]; mask uint8 [KQ,
ceil(KQ / 8)] or [B, KQ, ceil(KQ / 8)]; scratch: qkv [MT, Q + R + DR], qb [MT, NH * (NOPE + DR)], q_lat [MT, NH,
R], q_pe [MT, NH, DR], v [MT, NH * V] (x's dtype), ws_o fp32 [B, NSPLIT, KQ, NH, R], ws_lse fp32 [B, NSPLIT, KQ,
NH], part fp32, ticket int32 and bar int32 [2] (zero between launches); out [MT, H].
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from specverify.kernels.fused_ops import _rope_half
from specverify.kernels.gemv import _prefetch_l2
from specverify.kernels.moe_block import _grid_barrier, _prefetch_rows, _split_sum
from specverify.kernels.tree_attention import _online_softmax_step, _split_range


@triton.jit
def _rows_dot(w_base, rows, rmask, stride_wn, x_ptr, stride_xm, nw_ptr, rstd, k_lo, k_hi, K: tl.constexpr,
              MT: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, NORM: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc [len(rows), 16]: column m = sum over k in [k_lo, k_hi) of W[rows, k] * x[m, k] (columns >= MT zero).
    NORM: x[m, k] is first scaled by ``rstd[m]`` then by the norm weight ``nw[k]`` and rounded to W's dtype (an
    RMSNorm applied on load). x is read from L2 (``.cg``): it may have been written earlier in the launch."""
    cols = tl.arange(0, 16)
    acc = tl.zeros((rows.shape[0], 16), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        kc = k0 + tl.arange(0, BK)
        kmask = kc < K
        w = tl.load(w_base + rows.to(tl.int64)[:, None] * stride_wn + kc[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        xt = tl.load(x_ptr + cols[None, :] * stride_xm + kc[:, None], mask=(cols < MT)[None, :] & kmask[:, None],
                     other=0.0, cache_modifier=".cg")
        if NORM:
            nw = tl.load(nw_ptr + kc, mask=kmask, other=0.0).to(tl.float32)
            xt = ((xt.to(tl.float32) * rstd[None, :]) * nw[:, None]).to(w.dtype)
        if DOT_FP32:  # the CPU interpreter (its bf16 dot is not exact)
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
        else:
            acc += tl.dot(w, xt)
    return acc


@triton.jit
def _kv_prep_row(m, qkv_ptr, kvn_ptr, pos_ptr, pt_ptr, prefix_ptr, cache_ptr, stride_ptb, stride_cp, stride_cs, eps,
                 log2_theta, NA: tl.constexpr, Q: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, KQ: tl.constexpr,
                 PAGE: tl.constexpr):
    """Token m's KV: the latent's RMSNorm and the rope key, written at the request's position prefix + node."""
    HALF: tl.constexpr = DR // 2
    r = tl.arange(0, R)
    lat = tl.load(qkv_ptr + m * NA + Q + r, cache_modifier=".cg").to(tl.float32)
    lat = lat * tl.rsqrt(tl.sum(lat * lat, axis=0) / R + eps) * tl.load(kvn_ptr + r).to(tl.float32)
    j = tl.arange(0, HALF)
    x1 = tl.load(qkv_ptr + m * NA + Q + R + j, cache_modifier=".cg").to(tl.float32)
    x2 = tl.load(qkv_ptr + m * NA + Q + R + HALF + j, cache_modifier=".cg").to(tl.float32)
    pos = tl.load(pos_ptr + m)
    y1, y2 = _rope_half(x1, x2, pos, j, HALF, log2_theta)
    b = m // KQ
    p = tl.load(prefix_ptr + b) + m % KQ
    page = tl.load(pt_ptr + b * stride_ptb + p // PAGE).to(tl.int64)
    base = cache_ptr + page * stride_cp + (p % PAGE) * stride_cs
    ty = cache_ptr.dtype.element_ty
    tl.store(base + r, lat.to(ty))
    tl.store(base + R + j, y1.to(ty))
    tl.store(base + R + HALF + j, y2.to(ty))


@triton.jit
def _mla_block_kernel(x_ptr, wa_ptr, qn_ptr, wb_ptr, kvn_ptr, wuk_ptr, wuv_ptr, wo_ptr, cache_ptr, pt_ptr,
                      prefix_ptr, pos_ptr, mask_ptr, qkv_ptr, qb_ptr, ql_ptr, qr_ptr, vo_ptr, ws_o_ptr, ws_lse_ptr,
                      part_ptr, ticket_ptr, bar_ptr, out_ptr,
                      stride_xm, stride_om, stride_cp, stride_cs, stride_ptb, stride_mb, stride_mt,
                      eps, log2_theta, qk_scale,
                      MT: tl.constexpr, KQ: tl.constexpr, H: tl.constexpr, Q: tl.constexpr, QP: tl.constexpr,
                      R: tl.constexpr, DR: tl.constexpr, DRP: tl.constexpr, NOPE: tl.constexpr, NH: tl.constexpr,
                      V: tl.constexpr,
                      PAGE: tl.constexpr, HAS_MASK: tl.constexpr,
                      TA: tl.constexpr, TB: tl.constexpr, BK: tl.constexpr, SPLIT_A: tl.constexpr, SPLIT_A_PAD: tl.constexpr,
                      SPLIT_B: tl.constexpr, SPLIT_B_PAD: tl.constexpr, BR: tl.constexpr, NSPLIT: tl.constexpr,
                      NSPLIT_PAD: tl.constexpr, ATT_BN: tl.constexpr, BM: tl.constexpr, RCH: tl.constexpr,
                      BC: tl.constexpr,
                      RH: tl.constexpr, BH: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
                      PF_O: tl.constexpr, NPROG: tl.constexpr, PHASE: tl.constexpr, DOT_FP32: tl.constexpr,
                      PDL: tl.constexpr):
    pid = tl.program_id(0)
    NA: tl.constexpr = Q + R + DR  # qkv_a rows
    QD: tl.constexpr = NOPE + DR  # q_b rows a head
    NB: tl.constexpr = NH * QD  # q_b rows
    NV: tl.constexpr = NH * V  # o_proj's K
    B: tl.constexpr = MT // KQ  # requests
    T_A: tl.constexpr = (NA + TA - 1) // TA
    T_B: tl.constexpr = (NB + TB - 1) // TB
    NCH_A: tl.constexpr = (H + BK - 1) // BK
    NCH_B: tl.constexpr = (Q + BK - 1) // BK
    NRT: tl.constexpr = R // BR  # absorb tiles a head
    NC: tl.constexpr = R // BC  # merge chunks a head
    # fp32 partials: phase 1 [T_A, SPLIT_A, MT, TA], phase 2 [T_B, SPLIT_B, MT, TB], phase 5 [NH, NC, MT, V]
    P2: tl.constexpr = T_A * SPLIT_A * MT * TA
    P5: tl.constexpr = P2 + T_B * SPLIT_B * MT * TB
    # tickets: phase 1 [T_A], phase 2 [T_B], phase 5 [NH]
    TK2: tl.constexpr = T_A
    TK5: tl.constexpr = T_A + T_B
    ja = tl.arange(0, TA)
    jb = tl.arange(0, TB)
    cols = tl.arange(0, 16)
    odt = out_ptr.dtype.element_ty
    if PREFETCH & ((PHASE == 0) | (PHASE == 1)):  # this program's first qkv_a slice to L2 before the wait
        if pid < T_A * SPLIT_A:
            sp0 = pid % SPLIT_A
            _prefetch_rows(wa_ptr, (pid // SPLIT_A) * TA + ja, (pid // SPLIT_A) * TA + ja < NA, H,
                           sp0 * NCH_A // SPLIT_A * BK, (sp0 + 1) * NCH_A // SPLIT_A * BK, H, BK)
    if PDL:  # x comes from the previous kernel; nothing is read or written before this
        gdc_wait()

    # ---- phase 1: qkv_a ------------------------------------------------------------------------------------------
    if (PHASE == 0) | (PHASE == 1):
        for item in range(pid, T_A * SPLIT_A, NPROG):
            tile = item // SPLIT_A
            sp = item % SPLIT_A
            rows = tile * TA + ja
            acc = _rows_dot(wa_ptr, rows, rows < NA, H, x_ptr, stride_xm, x_ptr, cols.to(tl.float32),
                            sp * NCH_A // SPLIT_A * BK, (sp + 1) * NCH_A // SPLIT_A * BK, H, MT, BK, STAGES, False,
                            DOT_FP32)
            tl.store(part_ptr + ((tile * SPLIT_A + sp) * MT + cols[None, :]) * TA + ja[:, None], acc,
                     mask=(cols < MT)[None, :])
            tl.debug_barrier()  # this item's partial precedes its ticket
            if tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel") == SPLIT_A - 1:
                for m in tl.static_range(MT):
                    v = _split_sum(part_ptr + (tile * SPLIT_A * MT + m) * TA, SPLIT_A, SPLIT_A_PAD, MT * TA, 0, TA)
                    tl.store(qkv_ptr + m * NA + rows, v.to(odt), mask=rows < NA)
                tl.atomic_xchg(ticket_ptr + tile, 0)
    if PREFETCH & ((PHASE == 0) | (PHASE == 1)):  # the first phase-2 and phase-3 slices (constant weights)
        if pid < T_B * SPLIT_B:
            sp0 = pid % SPLIT_B
            rb = (pid // SPLIT_B) * TB + jb
            _prefetch_rows(wb_ptr, rb, rb < NB, Q, sp0 * NCH_B // SPLIT_B * BK, (sp0 + 1) * NCH_B // SPLIT_B * BK, Q,
                           BK)
        if pid < NH * NRT:
            _prefetch_rows(wuk_ptr + (pid // NRT) * NOPE * R + (pid % NRT) * BR, tl.arange(0, NOPE),
                           tl.arange(0, NOPE) < NOPE, R, 0, BR, BR, 64)
    if PREFETCH & (PF_O == 1):
        _prefetch_late(pid, wo_ptr, wuv_ptr, H, NV, R, V, BC, NH, RH, BH, BK, NPROG)
    if PHASE == 0:
        _grid_barrier(bar_ptr, NPROG)

    # ---- phase 2: q_a's norm and q_b; the KV preparation ----------------------------------------------------------
    if (PHASE == 0) | (PHASE == 2):
        qc = tl.arange(0, QP)
        rstd = tl.zeros((16,), dtype=tl.float32)
        for m in tl.static_range(MT):
            qa = tl.load(qkv_ptr + m * NA + qc, mask=qc < Q, other=0.0, cache_modifier=".cg").to(tl.float32)
            rstd = tl.where(cols == m, tl.rsqrt(tl.sum(qa * qa, axis=0) / Q + eps), rstd)
        for item in range(pid, T_B * SPLIT_B + MT, NPROG):
            if item < T_B * SPLIT_B:
                tile = item // SPLIT_B
                sp = item % SPLIT_B
                rows = tile * TB + jb
                acc = _rows_dot(wb_ptr, rows, rows < NB, Q, qkv_ptr, NA, qn_ptr, rstd, sp * NCH_B // SPLIT_B * BK,
                                (sp + 1) * NCH_B // SPLIT_B * BK, Q, MT, BK, STAGES, True, DOT_FP32)
                tl.store(part_ptr + P2 + ((tile * SPLIT_B + sp) * MT + cols[None, :]) * TB + jb[:, None], acc,
                         mask=(cols < MT)[None, :])
                tl.debug_barrier()
                if tl.atomic_add(ticket_ptr + TK2 + tile, 1, sem="acq_rel") == SPLIT_B - 1:
                    for m in tl.static_range(MT):
                        v = _split_sum(part_ptr + P2 + (tile * SPLIT_B * MT + m) * TB, SPLIT_B, SPLIT_B_PAD, MT * TB,
                                       0, TB)
                        tl.store(qb_ptr + m * NB + rows, v.to(odt), mask=rows < NB)
                    tl.atomic_xchg(ticket_ptr + TK2 + tile, 0)
            else:
                _kv_prep_row(item - T_B * SPLIT_B, qkv_ptr, kvn_ptr, pos_ptr, pt_ptr, prefix_ptr, cache_ptr,
                             stride_ptb, stride_cp, stride_cs, eps, log2_theta, NA, Q, R, DR, KQ, PAGE)
    if PHASE == 0:
        _grid_barrier(bar_ptr, 2 * NPROG)

    # ---- phase 3: absorbed query, rope query ------------------------------------------------------------------------
    if (PHASE == 0) | (PHASE == 3):
        jn = tl.arange(0, NOPE)
        for item in range(pid, NH * NRT, NPROG):
            h = item // NRT
            t = item % NRT
            rc = t * BR + tl.arange(0, BR)
            w = tl.load(wuk_ptr + h * NOPE * R + jn[:, None] * R + rc[None, :])  # [NOPE, BR]
            a = tl.load(qb_ptr + cols[:, None] * NB + h * QD + jn[None, :], mask=(cols < MT)[:, None], other=0.0,
                        cache_modifier=".cg")  # [16, NOPE]
            if DOT_FP32:
                ql = tl.dot(a.to(tl.float32), w.to(tl.float32))
            else:
                ql = tl.dot(a, w)
            tl.store(ql_ptr + (cols[:, None] * NH + h) * R + rc[None, :], ql.to(odt), mask=(cols < MT)[:, None])
            if t == 0:  # the head's rope query
                HALF: tl.constexpr = DR // 2
                j = tl.arange(0, HALF)
                pos = tl.load(pos_ptr + cols, mask=cols < MT, other=0)
                src = qb_ptr + cols[:, None] * NB + h * QD + NOPE
                x1 = tl.load(src + j[None, :], mask=(cols < MT)[:, None], other=0.0, cache_modifier=".cg")
                x2 = tl.load(src + HALF + j[None, :], mask=(cols < MT)[:, None], other=0.0, cache_modifier=".cg")
                y1, y2 = _rope_half(x1.to(tl.float32), x2.to(tl.float32), pos[:, None], j[None, :], HALF,
                                    log2_theta)
                dst = qr_ptr + (cols[:, None] * NH + h) * DR
                tl.store(dst + j[None, :], y1.to(odt), mask=(cols < MT)[:, None])
                tl.store(dst + HALF + j[None, :], y2.to(odt), mask=(cols < MT)[:, None])
    if PREFETCH & (PF_O == 3):
        _prefetch_late(pid, wo_ptr, wuv_ptr, H, NV, R, V, BC, NH, RH, BH, BK, NPROG)
    if PHASE == 0:
        _grid_barrier(bar_ptr, 3 * NPROG)

    # ---- phase 4: split-KV tree attention ------------------------------------------------------------------------
    if (PHASE == 0) | (PHASE == 4):
        NRC: tl.constexpr = R // RCH  # value chunks: each (request, split) is NRC items, one a chunk of the output
        rm = tl.arange(0, BM)
        tok = rm // NH
        head = rm % NH
        row_ok = rm < KQ * NH
        dr = tl.arange(0, DRP)  # the rope dim, padded to a dot's 16
        vc = tl.arange(0, RCH)
        offs_n = tl.arange(0, ATT_BN)
        for item in range(pid, B * NSPLIT * NRC, NPROG):
            c = item % NRC
            b = item // NRC // NSPLIT
            split = item // NRC % NSPLIT
            qrow = (b * KQ + tok) * NH + head
            qr = tl.load(qr_ptr + qrow[:, None] * DR + dr[None, :], mask=row_ok[:, None] & (dr < DR)[None, :],
                         other=0.0, cache_modifier=".cg")
            if DOT_FP32:
                qr = qr.to(tl.float32)
            prefix = tl.load(prefix_ptr + b).to(tl.int32)
            pt_row = pt_ptr + b.to(tl.int64) * stride_ptb
            acc = tl.zeros([BM, RCH], dtype=tl.float32)
            m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BM], dtype=tl.float32)
            start, end = _split_range(prefix, split, NSPLIT, KQ, ATT_BN)
            for start_n in range(start, end, ATT_BN):
                pos = start_n + offs_n
                valid = pos < end
                page = tl.load(pt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
                krow = page * stride_cp + (pos % PAGE).to(tl.int64) * stride_cs
                kr = tl.load(cache_ptr + krow[:, None] + R + dr[None, :], mask=valid[:, None] & (dr < DR)[None, :],
                             other=0.0, cache_modifier=".cg")
                if DOT_FP32:
                    kr = kr.to(tl.float32)
                s = tl.dot(qr, tl.trans(kr))
                # every item of the split computes the whole score (all R), chunk by chunk: the KV tile's later
                # readers hit L2; registers hold one [ATT_BN, RCH] chunk at a time
                for cc in tl.static_range(NRC):
                    q_ch = tl.load(ql_ptr + qrow[:, None] * R + cc * RCH + vc[None, :], mask=row_ok[:, None], other=0.0,
                                 cache_modifier=".cg")
                    k_ch = tl.load(cache_ptr + krow[:, None] + cc * RCH + vc[None, :], mask=valid[:, None], other=0.0,
                                 cache_modifier=".cg")
                    if DOT_FP32:
                        q_ch = q_ch.to(tl.float32)
                        k_ch = k_ch.to(tl.float32)
                    s = tl.dot(q_ch, tl.trans(k_ch), s)
                s = s * qk_scale
                jd = pos - prefix  # draft index (>= 0 on draft tokens)
                is_draft = valid & (jd >= 0)
                jd = tl.where(is_draft, jd, 0)
                if HAS_MASK:
                    byte = tl.load(mask_ptr + b * stride_mb + tok[:, None] * stride_mt + (jd // 8)[None, :],
                                   mask=row_ok[:, None] & is_draft[None, :], other=0)
                    dvis = ((byte.to(tl.int32) >> (jd % 8)[None, :]) & 1) != 0
                else:
                    dvis = jd[None, :] <= tok[:, None]
                vis = (valid[None, :] & row_ok[:, None]) & ((pos < prefix)[None, :] | dvis)
                vt = tl.load(cache_ptr + krow[:, None] + c * RCH + vc[None, :], mask=valid[:, None], other=0.0,
                             cache_modifier=".cg")  # this item's value chunk
                if DOT_FP32:
                    vt = vt.to(tl.float32)
                acc, m_i, l_i = _online_softmax_step(s, vis, vt, acc, m_i, l_i)
            has_any = l_i > 0.0
            o = acc / tl.where(has_any, l_i, 1.0)[:, None]
            ws_row = ((b * NSPLIT + split) * KQ + tok) * NH + head
            tl.store(ws_o_ptr + ws_row.to(tl.int64)[:, None] * R + c * RCH + vc[None, :], o, mask=row_ok[:, None])
            if c == 0:  # the split's lse (every chunk's item computes the same)
                lse = tl.where(has_any, (m_i + tl.log2(tl.where(has_any, l_i, 1.0))) * 0.6931471805599453,
                               float("-inf"))
                tl.store(ws_lse_ptr + ws_row, lse, mask=row_ok)
    if PREFETCH & (PF_O == 4):
        _prefetch_late(pid, wo_ptr, wuv_ptr, H, NV, R, V, BC, NH, RH, BH, BK, NPROG)
    if PHASE == 0:
        _grid_barrier(bar_ptr, 4 * NPROG)

    # ---- phase 5: split merge and the V up-projection ---------------------------------------------------------------
    if (PHASE == 0) | (PHASE == 5):
        ss = tl.arange(0, NSPLIT_PAD)
        jv = tl.arange(0, V)
        for item in range(pid, NH * NC, NPROG):
            h = item // NC
            c = item % NC
            rc = c * BC + tl.arange(0, BC)
            a = tl.zeros((16, BC), dtype=tl.float32)
            for m in tl.static_range(MT):
                ws_rows = ((m // KQ * NSPLIT + ss) * KQ + m % KQ) * NH + h
                lse_s = tl.load(ws_lse_ptr + ws_rows, mask=ss < NSPLIT, other=float("-inf"), cache_modifier=".cg")
                mx = tl.max(lse_s, 0)
                mx = tl.where(mx == float("-inf"), 0.0, mx)
                wgt = tl.exp(lse_s - mx)  # 0 for empty splits
                tot = tl.sum(wgt, 0)
                o = tl.load(ws_o_ptr + ws_rows.to(tl.int64)[:, None] * R + rc[None, :], mask=(ss < NSPLIT)[:, None],
                            other=0.0, cache_modifier=".cg")
                merged = tl.sum(wgt[:, None] * o, 0) / tl.where(tot > 0.0, tot, 1.0)
                merged = merged.to(odt).to(tl.float32)  # the attention output is rounded, as the op chain's
                a = tl.where((cols == m)[:, None], merged[None, :], a)
            w = tl.load(wuv_ptr + h * R * V + rc[:, None] * V + jv[None, :])  # [BC, V]
            if DOT_FP32:
                pv = tl.dot(a, w.to(tl.float32))
            else:
                pv = tl.dot(a.to(odt), w)
            tl.store(part_ptr + P5 + ((h * NC + c) * MT + cols[:, None]) * V + jv[None, :], pv,
                     mask=(cols < MT)[:, None])
            tl.debug_barrier()
            if tl.atomic_add(ticket_ptr + TK5 + h, 1, sem="acq_rel") == NC - 1:
                for m in tl.static_range(MT):
                    v = _split_sum(part_ptr + P5 + (h * NC * MT + m) * V, NC, NC, MT * V, 0, V)
                    tl.store(vo_ptr + m * NV + h * V + jv, v.to(odt))
                tl.atomic_xchg(ticket_ptr + TK5 + h, 0)
    if PHASE == 0:
        _grid_barrier(bar_ptr, 5 * NPROG)
        if PDL:  # every program is resident (all passed the barrier): the next kernel may launch now
            gdc_launch_dependents()

    # ---- phase 6: o_proj -----------------------------------------------------------------------------------------
    if (PHASE == 0) | (PHASE == 6):
        for item in range(pid, (H + RH - 1) // RH, NPROG):
            oh = item * RH + tl.arange(0, BH)
            hmask = (tl.arange(0, BH) < RH) & (oh < H)
            acc = _rows_dot(wo_ptr, oh, hmask, NV, vo_ptr, NV, vo_ptr, cols.to(tl.float32), 0, NV, NV, MT, BK, STAGES,
                            False, DOT_FP32)
            tl.store(out_ptr + cols[None, :] * stride_om + oh[:, None], acc.to(odt),
                     mask=hmask[:, None] & (cols < MT)[None, :])
    if PHASE == 0:  # the last program out resets the barrier for the next launch
        tl.debug_barrier()
        if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel") == NPROG - 1:
            tl.atomic_xchg(bar_ptr, 0)
            tl.atomic_xchg(bar_ptr + 1, 0)


@triton.jit
def _prefetch_late(pid, wo_ptr, wuv_ptr, H: tl.constexpr, NV: tl.constexpr, R: tl.constexpr, V: tl.constexpr,
                   BC: tl.constexpr, NH: tl.constexpr, RH: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                   NPROG: tl.constexpr):
    """This program's phase-6 rows of W_o and its first phase-5 chunk of W_uv to L2 (constant weights)."""
    if pid * RH < H:
        oh = pid * RH + tl.arange(0, BH)
        _prefetch_rows(wo_ptr, oh, (tl.arange(0, BH) < RH) & (oh < H), NV, 0, NV, NV, BK)
    NC: tl.constexpr = R // BC
    if pid < NH * NC:
        _prefetch_rows(wuv_ptr + (pid // NC) * R * V + (pid % NC) * BC * V, tl.arange(0, BC),
                       tl.arange(0, BC) < BC, V, 0, V, V, 64)
