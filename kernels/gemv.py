"""Skinny GEMM for the verify pass's projections, ``Y[M, N] = X[M, K] @ W[N, K]^T`` at M <= 16 rows: timed
against cuBLAS by ``bench/bench_gemv.py``; the pass runs it only where it measured faster (``specverify.gemv.linear``).

At 1-8 tokens a rank a projection reads its weight once and does almost no arithmetic: it costs the weight bytes
over the bandwidth it reaches. The weight rows take the MMA's M side and the few tokens its N side ("swap AB": 64
weight rows x 16 token columns a tile, the tokens zero-padded), so a tile is one ``tl.dot``, and K is split so the
grid covers every SM about twice (N of 384-7168 gives only 6-112 row tiles)::

    program (n, s):  P[s, :, n0:n0+ROWS] = sum over k in slice s of  X[:, k] * W[n0 + j, k]   (n0 = n * ROWS) fp32
    last program of row tile n (a self-resetting ticket per tile):  Y[m, n0:n0+ROWS] = sum_s P[s, m]  (x's dtype):
        one [SPLIT_PAD, BLOCK_N] load and tree sum per token row (WIDE_REDUCE: one token, or many splits),
        else split by split

Row ranges (``ROWS`` < ``BLOCK_N``): program n takes weight rows [n * ROWS, (n + 1) * ROWS) in a BLOCK_N tile (the
rows past ROWS masked, never loaded), so a grid of at most ``WAVES`` programs an SM covers N with no split of K and
no reduce (the launcher's ``ROW_RANGE`` config); ``ROWS == BLOCK_N`` is the tiling above.

One launch: the partials go to an fp32 workspace [SPLIT_K, BLOCK_M, N] and the tile's last program (its ticket,
acquire-release) reduces them and resets the ticket, so the launch is graph-replayable with no memset.

``PDL`` (programmatic dependent launch, sm_90+): the grid may start while the previous kernel finishes; with
``PREFETCH`` each program first issues ``prefetch.global.L2`` for the first ``k_prefetch`` columns of its weight
slice (constant data; the launcher bounds the grid's total, so a large weight does not thrash L2), then lets the
next kernel launch (``gdc_launch_dependents``) and waits (``gdc_wait``; ``specverify.kernels.pdl``) before it
touches X, the workspace or Y.

``SUMSQ`` (the qkv_a projection of MLA, whose first ``sumsq_cols`` = q_lora columns feed q_a's RMSNorm): the
program that stores row tile n (the plain store at ``SPLIT_K == 1``, else the tile's last program, in both reduce
forms) also writes, per token row m, the sum of squares of the values it stored in columns ``< sumsq_cols``::

    S[n, m] = sum over j < ROWS with n * ROWS + j < sumsq_cols of  float(Y[m, n * ROWS + j])^2     (Y as stored)

Tiles that start at or past ``sumsq_cols`` write nothing (their slots are not part of the partials the launcher
returns). One slot per tile and token, summed within one program: no atomics, the same bits every launch. The
consumer (``specverify.fused_ops.mla_prep_absorb``) sums the tiles' slots, so q_a's RMSNorm needs no kernel of its
own: its weight is folded into q_b's, its per-token scale rsqrt(mean + eps) is applied after q_b.

Tensors: X [M, K] (unit stride on K), W [N, K] (torch's Linear layout), Y [M, N]; bf16 / fp16; P fp32; TICKET
int32 [row tiles], zero between launches; S fp32 [row tiles, stride_s >= M] (``SUMSQ`` only).
"""
import triton
import triton.language as tl

from specverify.kernels.pdl import pdl_enter


@triton.jit
def _prefetch_l2(ptrs):
    # prefetch.global.L2 of every address (one per 128-byte line); no result, no fault on the lanes given the base
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _sumsq(y, keep):
    # the sum of y^2 (fp32) over axis 0 of the stored values y where keep: per token column of a [BLOCK_N, BLOCK_M]
    # tile, or one token row's [BLOCK_N]
    yf = y.to(tl.float32)
    return tl.sum(tl.where(keep, yf * yf, 0.0), axis=0)


@triton.jit
def _gemv_splitk_kernel(X, W, Y, P, TICKET, S, M, N, K, stride_xm, stride_wn, stride_ym, stride_s, k_per_split,
                        k_prefetch, sumsq_cols,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, SPLIT_PAD: tl.constexpr, WIDE_REDUCE: tl.constexpr,
                        DOT_FP32: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                        SUMSQ: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rr = tl.arange(0, BLOCK_N)
    rn = pid_n * ROWS + rr
    rm = tl.arange(0, BLOCK_M)
    nmask = (rr < ROWS) & (rn < N)
    mmask = rm < M
    k_lo = pid_s * k_per_split
    if PDL:
        if PREFETCH:  # the weight is constant: the slice's first k_prefetch columns go to L2 while the previous
            lines = tl.arange(0, BLOCK_K // 64)  # kernel finishes (64 bf16 / fp16 elements = one 128-byte line)
            for k0 in range(k_lo, k_lo + k_prefetch, BLOCK_K):
                lk = k0 + lines * 64
                pmask = nmask[:, None] & (lk < K)[None, :]
                _prefetch_l2(tl.where(pmask, W + rn.to(tl.int64)[:, None] * stride_wn + lk[None, :], W))
    pdl_enter(PDL)  # x (and the workspace) belong to earlier kernels: nothing is read or written before this
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        w = tl.load(W + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0)
        xt = tl.load(X + rm[None, :] * stride_xm + rk[:, None], mask=mmask[None, :] & kmask[:, None], other=0.0)
        if DOT_FP32:  # the CPU interpreter (its bf16 dot is not exact)
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
        else:
            acc += tl.dot(w, xt)
    out_mask = nmask[:, None] & mmask[None, :]
    s_row = S + pid_n * stride_s  # this tile's slots (SUMSQ)
    s_here = pid_n * ROWS < sumsq_cols  # the tile holds columns < sumsq_cols
    if SPLIT_K == 1:
        y = acc.to(Y.dtype.element_ty)
        tl.store(Y + rm[None, :] * stride_ym + rn[:, None], y, mask=out_mask)
        if SUMSQ:
            if s_here:
                tl.store(s_row + rm, _sumsq(y, out_mask & (rn < sumsq_cols)[:, None]), mask=mmask)
    else:
        p_tile = P + (pid_s * BLOCK_M + rm[None, :]) * N + rn[:, None]
        tl.store(p_tile, acc, mask=out_mask)
        tl.debug_barrier()  # this program's partial precedes its ticket
        ticket = tl.atomic_add(TICKET + pid_n, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            if WIDE_REDUCE:
                # one wide load of every split's partial per token row (the launcher's rule: one token, or
                # many splits, where the split-by-split loop below would serialise)
                rs = tl.arange(0, SPLIT_PAD)
                smask = rs < SPLIT_K
                for m in range(0, M):
                    part = tl.load(P + (rs[:, None] * BLOCK_M + m) * N + rn[None, :],
                                   mask=smask[:, None] & nmask[None, :], other=0.0)
                    y = tl.sum(part, axis=0).to(Y.dtype.element_ty)
                    tl.store(Y + m * stride_ym + rn, y, mask=nmask)
                    if SUMSQ:
                        if s_here:
                            tl.store(s_row + m, _sumsq(y, nmask & (rn < sumsq_cols)))
            else:
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in range(0, SPLIT_K):
                    total += tl.load(P + (s * BLOCK_M + rm[None, :]) * N + rn[:, None], mask=out_mask, other=0.0)
                y = total.to(Y.dtype.element_ty)
                tl.store(Y + rm[None, :] * stride_ym + rn[:, None], y, mask=out_mask)
                if SUMSQ:
                    if s_here:
                        tl.store(s_row + rm, _sumsq(y, out_mask & (rn < sumsq_cols)[:, None]), mask=mmask)
            tl.atomic_xchg(TICKET + pid_n, 0)
