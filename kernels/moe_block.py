"""The MoE block of one verify layer at a few tokens in one persistent launch: router GEMV, routing, the shared and
routed experts' gate/up, and the down projection with the top-k sum (issue 22).

Math, for token rows ``m < MT`` of the normalised hidden state ``x`` [MT, H] (fp32 accumulation):

    logits[m]   = x[m] @ router^T                                           (fp32, [MT, E], also returned)
    ids, w      = routing of logits[m] (``_route_rows``: scores, bias, groups, top-k, renormalise, scale), and the
                  shared expert as slot TOP_K of each row (id E, weight 1): ids / w [MT, TOP_K + 1]
    act[s]      = silu(x[m] @ gate[e]^T) * (x[m] @ up[e]^T)                  (slot s = m * (TOP_K + 1) + j, e = ids[s];
                                                                             stored in the weights' dtype)
    out[m]      = sum_j w[s] * (act[s] @ w2[e]^T)                           (fixed slot order; in x's dtype)

with ``w13`` [E + 1, 2I, H] (gate rows then up rows; expert E the shared one) and ``w2`` [E + 1, H, I]: the
stacked layout of the verify forward (``w13_all`` / ``w2_all``).

Why one launch: at one or two tokens each of the four kernels this replaces (router GEMV, routing, gate/up, down)
costs its bytes plus a fixed few microseconds of ramp, tail and dependent round trips, and the edges between them
cost ~0.8 µs each (``bench/bench_chain_latency.py``); inside one persistent grid a step costs its bytes plus a
grid barrier (~1 µs), the routing runs in every program at once (no barrier of its own), and the shared expert's
gate/up, which needs no routing, streams with the router's rows.

Grid: ``NPROG`` programs, all resident at once (the launcher sizes it from the compiled kernel's registers and
shared memory). Each phase hands its work items out round-robin (item ``i`` to program ``i % NPROG``):

    phase 1  items (tile, split): router tiles of 2 * BN rows and shared-expert tiles of BN gate + BN up rows, over
             H split in SPLIT1 parts of whole BK-column chunks (part p: chunks [p * NCH / SPLIT1, (p + 1) * NCH /
             SPLIT1), any SPLIT1 <= NCH); each item writes an fp32 partial [MT, 2 * BN]; the tile's last item (a
             self-resetting ticket, acquire-release) sums the partials: the router's logits, or the shared slot's
             act. Before its PDL wait each program sends its first item's weight slice to L2.
    barrier 1
    phase 2  every program routes all MT rows (identical results; the ids / weights stores race with equal
             values), then items (routed slot, I-tile, split) as in phase 1 over the chosen expert's rows; the
             tile's last item writes the slot's act. Then each program sends the down rows of its phase-3 range
             for the first PF_SLOTS slots to L2.
    barrier 2 (then, with PDL, ``gdc_launch_dependents``)
    phase 3  items = RH output rows each (in a BH = next-power-of-two tile; the launcher takes RH = H / NPROG
             rounded up, one range a program): for every slot (routed and shared) one [BH, BI] tile of w2[e] times
             act[s], scaled by w[s], summed into the token's column; out written once, no atomics.

A grid barrier: every thread's stores, a CTA barrier, one release add on ``BAR[0]``, spin (acquire) until it
reaches ``NPROG`` times the barrier's number; the last program past barrier 2 (``BAR[1]``, a ticket) resets both
counters, so the launch is CUDA-graph replayable. ``PHASE`` 1 / 2 / 3 runs one phase alone (no barriers): the CPU
interpreter, which runs programs one after another and would spin forever, launches the three in turn.

The kernel lets its dependents launch only after barrier 2: a dependent grid resident before all of this grid is
would hold SM slots this grid's barrier waits for; past barrier 2 every program is resident. With ``PDL`` it waits
(``gdc_wait``) for its predecessor before it reads x or writes anything.

Tensors: x [MT, H] bf16/fp16 (unit column stride); router [E, H]; bias [E] fp32; w13 [E + 1, 2I, H]; w2
[E + 1, H, I] (unit column strides); logits [MT, E] fp32 (out); ids [MT, TOP_K + 1] int32 (out); tw [MT, TOP_K + 1]
fp32 (out); act [MT * (TOP_K + 1), I] (x's dtype, scratch); part fp32 scratch; ticket int32 (zero between
launches); bar int32 [2] (zero between launches); out [MT, H]; ts int64 [NPROG, 16] (``TIMING`` only: each
program's global-timer stamps at the start, after the PDL wait, after its phase-1 items, barrier 1, the routing,
its phase-2 items, the down prefetch, barrier 2 and its phase-3 items: points 0-8).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from specverify.kernels.gemv import _prefetch_l2
from specverify.kernels.moe_route import _route_rows


@triton.jit
def _tile_dot(w_base, rows, rmask, stride_wn, x_ptr, stride_xm, k_lo, k_hi, H: tl.constexpr, MT: tl.constexpr,
              BK: tl.constexpr, STAGES: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc [len(rows), 16]: column m = sum over k in [k_lo, k_hi) of W[rows, k] * x[m, k] (columns >= MT zero);
    the loop's loads pipelined STAGES deep."""
    cols = tl.arange(0, 16)
    acc = tl.zeros((rows.shape[0], 16), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        kc = k0 + tl.arange(0, BK)
        kmask = kc < H
        w = tl.load(w_base + rows.to(tl.int64)[:, None] * stride_wn + kc[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        xt = tl.load(x_ptr + cols[None, :] * stride_xm + kc[:, None], mask=(cols < MT)[None, :] & kmask[:, None],
                     other=0.0)
        if DOT_FP32:  # the CPU interpreter (its bf16 dot is not exact)
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
        else:
            acc += tl.dot(w, xt)
    return acc


@triton.jit
def _slot_expert(ids, m, k, ROWS: tl.constexpr, TOPK_P: tl.constexpr):
    """The expert of routed slot (token m, column k) of the routing's [ROWS, TOPK_P] ids, as a scalar."""
    hit = (tl.arange(0, ROWS) == m)[:, None] & (tl.arange(0, TOPK_P) == k)[None, :]
    return tl.sum(tl.sum(tl.where(hit, ids, 0), axis=1), axis=0)


@triton.jit
def _gate_up_rows(t, I: tl.constexpr, BN: tl.constexpr):
    """Rows of I-tile ``t`` of an expert's [2I, H] gate/up matrix: BN gate rows then the same BN up rows."""
    j = tl.arange(0, 2 * BN)
    r = t * BN + (j % BN)
    return tl.where(j < BN, r, I + r), r < I


@triton.jit
def _phase1_item(item, router_ptr, w13_ptr, stride_w13e, stride_w13n, H: tl.constexpr, I: tl.constexpr,
                 E: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NR: tl.constexpr, SPLIT1: tl.constexpr):
    """Phase-1 item ``item`` = (tile, split): (weight base, its rows [2 * BN], row mask, row stride, k_lo, k_hi).
    Tiles below NR are the router's (2 * BN rows each), the rest the shared expert's (expert E) gate/up I-tiles;
    split p covers K chunks [p * NCH / SPLIT1, (p + 1) * NCH / SPLIT1)."""
    NCH: tl.constexpr = (H + BK - 1) // BK
    tile = item // SPLIT1
    sp = item % SPLIT1
    j2 = tl.arange(0, 2 * BN)
    g_rows, g_mask = _gate_up_rows(tile - NR, I, BN)
    is_router = tile < NR
    rows = tl.where(is_router, tile * 2 * BN + j2, g_rows)
    rmask = tl.where(is_router, tile * 2 * BN + j2 < E, g_mask)
    if is_router:
        w_base = router_ptr
        stride_wn = (stride_w13n * 0 + H).to(tl.int64)
    else:
        w_base = w13_ptr + stride_w13e.to(tl.int64) * E
        stride_wn = stride_w13n.to(tl.int64)
    return w_base, rows, rmask, stride_wn, sp * NCH // SPLIT1 * BK, (sp + 1) * NCH // SPLIT1 * BK


@triton.jit
def _split_sum(part_ptr, SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr, stride_split, lo: tl.constexpr,
               N: tl.constexpr):
    """sum over splits p < SPLIT of part[p * stride_split + lo + j], j < N (fp32, read past L1)."""
    sp = tl.arange(0, SPLIT_PAD)
    j = tl.arange(0, N)
    v = tl.load(part_ptr + sp[:, None] * stride_split + lo + j[None, :], mask=(sp < SPLIT)[:, None], other=0.0,
                cache_modifier=".cg")
    return tl.sum(v, axis=0)


@triton.jit
def _prefetch_rows(w_base, rows, rmask, stride_wn, k_lo, k_hi, H: tl.constexpr, BK: tl.constexpr):
    """prefetch.global.L2 of W[rows, k_lo:k_hi] (one address per 128-byte line of 2-byte elements)."""
    lines = tl.arange(0, BK // 64)
    for k0 in range(k_lo, k_hi, BK):
        lk = k0 + lines * 64
        pmask = rmask[:, None] & (lk < H)[None, :]
        _prefetch_l2(tl.where(pmask, w_base + rows.to(tl.int64)[:, None] * stride_wn + lk[None, :], w_base))


@triton.jit
def _grid_barrier(bar_ptr, target):
    """Every program of the grid arrives (release) and waits until ``target`` arrivals (acquire)."""
    tl.debug_barrier()  # every thread's stores precede the arrival
    tl.atomic_add(bar_ptr, 1, sem="release")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _stamp(ts_ptr, pid, i: tl.constexpr, TIMING: tl.constexpr):
    """With TIMING: ts[pid, i] = the global nanosecond timer now (int64; the timeline of ``bench_moe_block.py
    --timeline``)."""
    if TIMING:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False,
                                        pack=1)
        tl.store(ts_ptr + pid * 16 + i, now)


@triton.jit
def _moe_block_kernel(x_ptr, router_ptr, bias_ptr, w13_ptr, w2_ptr, logits_ptr, ids_ptr, tw_ptr, act_ptr, part_ptr,
                      ticket_ptr, bar_ptr, out_ptr, ts_ptr, stride_xm, stride_om, stride_w13e, stride_w13n, stride_w2e,
                      stride_w2n, scale,
                      MT: tl.constexpr, H: tl.constexpr, I: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
                      TOP_K: tl.constexpr, TOPK_P: tl.constexpr, ROWS: tl.constexpr, N_GROUP: tl.constexpr,
                      NG_P: tl.constexpr, GSIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, SOFTMAX: tl.constexpr,
                      HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, SPLIT1: tl.constexpr, SPLIT1_PAD: tl.constexpr,
                      SPLIT2: tl.constexpr, SPLIT2_PAD: tl.constexpr, RH: tl.constexpr, BH: tl.constexpr,
                      BI: tl.constexpr, SPP: tl.constexpr, STAGES_K: tl.constexpr, STAGES_D: tl.constexpr,
                      PF_SLOTS: tl.constexpr, PF_BI: tl.constexpr, PREFETCH: tl.constexpr, NPROG: tl.constexpr,
                      PHASE: tl.constexpr,
                      DOT_FP32: tl.constexpr, PDL: tl.constexpr, TIMING: tl.constexpr):
    pid = tl.program_id(0)
    _stamp(ts_ptr, pid, 0, TIMING)
    OUT_K: tl.constexpr = TOP_K + 1
    NR: tl.constexpr = (E + 2 * BN - 1) // (2 * BN)  # router tiles (2 * BN rows)
    NT: tl.constexpr = (I + BN - 1) // BN  # I-tiles of one expert (BN gate + BN up rows)
    T1: tl.constexpr = NR + NT  # phase-1 tiles: router, then the shared expert's
    T2: tl.constexpr = MT * TOP_K * NT  # phase-2 tiles: routed slot x I-tile
    W: tl.constexpr = 2 * BN
    # fp32 partials: phase 1 [T1, SPLIT1, MT, W], then phase 2 [T2, SPLIT2, W]
    P2_BASE: tl.constexpr = T1 * SPLIT1 * MT * W
    NCH: tl.constexpr = (H + BK - 1) // BK  # K chunks; split p covers chunks [p * NCH // SPLIT, (p + 1) * NCH // SPLIT)
    j2 = tl.arange(0, W)
    cols = tl.arange(0, 16)
    if PREFETCH & ((PHASE == 0) | (PHASE == 1)):  # weights are constant: this program's first phase-1 slice goes to
        if pid < T1 * SPLIT1:  # L2 while the previous kernel finishes
            w_base, rows, rmask, stride_wn, k_lo, k_hi = _phase1_item(pid, router_ptr, w13_ptr, stride_w13e,
                                                                      stride_w13n, H, I, E, BN, BK, NR, SPLIT1)
            _prefetch_rows(w_base, rows, rmask, stride_wn, k_lo, k_hi, H, BK)
    if PDL:  # x comes from the previous kernel; nothing is read or written before this
        gdc_wait()
    _stamp(ts_ptr, pid, 1, TIMING)

    # ---- phase 1: router logits and the shared expert's gate/up ------------------------------------------------
    if (PHASE == 0) | (PHASE == 1):
        for item in range(pid, T1 * SPLIT1, NPROG):
            tile = item // SPLIT1
            sp = item % SPLIT1
            # one K loop for both kinds of tile (each loop's pipeline buffers take shared memory of their own)
            w_base, rows, rmask, stride_wn, k_lo, k_hi = _phase1_item(item, router_ptr, w13_ptr, stride_w13e,
                                                                      stride_w13n, H, I, E, BN, BK, NR, SPLIT1)
            acc = _tile_dot(w_base, rows, rmask, stride_wn, x_ptr, stride_xm, k_lo, k_hi, H, MT, BK, STAGES_K,
                            DOT_FP32)
            tl.store(part_ptr + ((tile * SPLIT1 + sp) * MT + cols[None, :]) * W + j2[:, None], acc,
                     mask=(cols < MT)[None, :])
            tl.debug_barrier()  # this item's partial precedes its ticket
            ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel")
            if ticket == SPLIT1 - 1:
                for m in tl.static_range(MT):
                    base = part_ptr + (tile * SPLIT1 * MT + m) * W
                    if tile < NR:
                        v = _split_sum(base, SPLIT1, SPLIT1_PAD, MT * W, 0, W)
                        tl.store(logits_ptr + m * E + tile * W + j2, v, mask=tile * W + j2 < E)
                    else:
                        t = tile - NR
                        g = _split_sum(base, SPLIT1, SPLIT1_PAD, MT * W, 0, BN)
                        u = _split_sum(base, SPLIT1, SPLIT1_PAD, MT * W, BN, BN)
                        ri = t * BN + tl.arange(0, BN)
                        a = g / (1.0 + tl.exp(-g)) * u
                        tl.store(act_ptr + (m * OUT_K + TOP_K) * I + ri, a.to(act_ptr.dtype.element_ty), mask=ri < I)
                tl.atomic_xchg(ticket_ptr + tile, 0)
    _stamp(ts_ptr, pid, 2, TIMING)
    if PHASE == 0:
        _grid_barrier(bar_ptr, NPROG)
    _stamp(ts_ptr, pid, 3, TIMING)

    # ---- phase 2: routing (every program), the routed experts' gate/up ------------------------------------------
    if (PHASE == 0) | (PHASE == 2):
        ids = _route_rows(logits_ptr, bias_ptr, ids_ptr, tw_ptr, ids_ptr, ids_ptr, 0, MT, E, scale, E, E, EP, ROWS,
                          TOP_K, TOPK_P, N_GROUP, NG_P, GSIZE, TOPK_GROUP, SOFTMAX, HAS_BIAS, RENORM, False, OUT_K)
        _stamp(ts_ptr, pid, 4, TIMING)
        for item in range(pid, T2 * SPLIT2, NPROG):
            tile = item // SPLIT2
            sp = item % SPLIT2
            slot = tile // NT
            t = tile % NT
            m = slot // TOP_K
            kk = slot % TOP_K
            e = _slot_expert(ids, m, kk, ROWS, TOPK_P)
            rows, rmask = _gate_up_rows(t, I, BN)
            k_lo = sp * NCH // SPLIT2 * BK
            k_hi = (sp + 1) * NCH // SPLIT2 * BK
            acc = _tile_dot(w13_ptr + e.to(tl.int64) * stride_w13e, rows, rmask, stride_w13n, x_ptr, stride_xm, k_lo,
                            k_hi, H, MT, BK, STAGES_K, DOT_FP32)
            col = tl.sum(tl.where(cols[None, :] == m, acc, 0.0), axis=1)  # [W]: this slot's token
            ri = t * BN + tl.arange(0, BN)
            a_row = act_ptr + (m * OUT_K + kk) * I + ri
            if SPLIT2 == 1:  # [2 * BN] = gate then up: split the halves in registers
                g, u = tl.split(tl.trans(tl.reshape(col, (2, BN))))
                tl.store(a_row, (g / (1.0 + tl.exp(-g)) * u).to(act_ptr.dtype.element_ty), mask=ri < I)
            else:
                tl.store(part_ptr + P2_BASE + (tile * SPLIT2 + sp) * W + j2, col)
                tl.debug_barrier()
                ticket = tl.atomic_add(ticket_ptr + T1 + tile, 1, sem="acq_rel")
                if ticket == SPLIT2 - 1:
                    base = part_ptr + P2_BASE + tile * SPLIT2 * W
                    g = _split_sum(base, SPLIT2, SPLIT2_PAD, W, 0, BN)
                    u = _split_sum(base, SPLIT2, SPLIT2_PAD, W, BN, BN)
                    tl.store(a_row, (g / (1.0 + tl.exp(-g)) * u).to(act_ptr.dtype.element_ty), mask=ri < I)
                    tl.atomic_xchg(ticket_ptr + T1 + tile, 0)
        _stamp(ts_ptr, pid, 5, TIMING)
    if PREFETCH & ((PHASE == 0) | (PHASE == 2)):  # the first PF_SLOTS slots of this program's first down tile to L2
        if pid * RH < H:  # before the barrier (the routing is known; the w2 rows are constant)
            oh0 = pid * RH + tl.arange(0, BH)
            hm0 = (tl.arange(0, BH) < RH) & (oh0 < H)
            for s in tl.static_range(PF_SLOTS):
                m3 = s // OUT_K
                j3 = s % OUT_K
                e3 = _slot_expert(ids, m3, j3, ROWS, TOPK_P)
                if j3 == TOP_K:  # the shared slot
                    e3 = e3 * 0 + E
                _prefetch_rows(w2_ptr + e3.to(tl.int64) * stride_w2e, oh0, hm0, stride_w2n, 0, I, I, PF_BI)
    _stamp(ts_ptr, pid, 6, TIMING)
    if PHASE == 0:
        _grid_barrier(bar_ptr, 2 * NPROG)
        if PDL:  # every program is resident (all passed the barrier): the next kernel may launch now
            gdc_launch_dependents()
    _stamp(ts_ptr, pid, 7, TIMING)

    # ---- phase 3: down projection, weighted top-k (+ shared) sum -----------------------------------------------
    if (PHASE == 0) | (PHASE == 3):
        SP: tl.constexpr = MT * OUT_K
        NI: tl.constexpr = (I + BI - 1) // BI
        s_ar = tl.arange(0, SPP)
        e_all = tl.load(ids_ptr + s_ar, mask=s_ar < SP, other=0, cache_modifier=".cg")
        r_all = tl.load(tw_ptr + s_ar, mask=s_ar < SP, other=0.0, cache_modifier=".cg")
        e_all = tl.where((e_all >= 0) & (e_all <= E), e_all, 0)
        for item in range(pid, (H + RH - 1) // RH, NPROG):
            oh = item * RH + tl.arange(0, BH)
            hmask = (tl.arange(0, BH) < RH) & (oh < H)
            acc = tl.zeros((BH, 16), dtype=tl.float32)
            for it in tl.range(0, SP * NI, num_stages=STAGES_D):
                s = it // NI
                i0 = (it % NI) * BI
                e = tl.sum(tl.where(s_ar == s, e_all, 0), axis=0)
                r = tl.sum(tl.where(s_ar == s, r_all, 0.0), axis=0)
                ic = i0 + tl.arange(0, BI)
                imask = ic < I
                w = tl.load(w2_ptr + e.to(tl.int64) * stride_w2e + oh.to(tl.int64)[:, None] * stride_w2n + ic[None, :],
                            mask=hmask[:, None] & imask[None, :], other=0.0)
                a = tl.load(act_ptr + s * I + ic, mask=imask, other=0.0, cache_modifier=".cg")
                at = tl.where(cols[None, :] == s // OUT_K, a[:, None], tl.zeros((BI, 16), a.dtype))
                if DOT_FP32:
                    acc += r * tl.dot(w.to(tl.float32), at.to(tl.float32))
                else:
                    acc += r * tl.dot(w, at)
            tl.store(out_ptr + cols[None, :] * stride_om + oh[:, None], acc.to(out_ptr.dtype.element_ty),
                     mask=hmask[:, None] & (cols < MT)[None, :])
    _stamp(ts_ptr, pid, 8, TIMING)
    if PHASE == 0:  # the last program out resets the barrier for the next launch
        tl.debug_barrier()
        done = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel")
        if done == NPROG - 1:
            tl.atomic_xchg(bar_ptr, 0)
            tl.atomic_xchg(bar_ptr + 1, 0)
