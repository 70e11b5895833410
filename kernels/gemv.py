"""Skinny GEMM for the verify pass's projections, ``Y[M, N] = X[M, K] @ W[N, K]^T`` at M <= 16 rows: timed
against cuBLAS by ``bench/bench_gemv.py``; the pass runs it only where it measured faster (``specverify.gemv.linear``).

At 1-8 tokens a rank a projection reads its weight once and does almost no arithmetic: it costs the weight bytes
over the bandwidth it reaches. The weight rows take the MMA's M side and the few tokens its N side ("swap AB": 64
weight rows x 16 token columns a tile, the tokens zero-padded), so a tile is one ``tl.dot``, and K is split so the
grid covers every SM about twice (N of 384-7168 gives only 6-112 row tiles)::

    program (n, s):  P[s, :, n0:n0+BLOCK_N] = sum over k in slice s of  X[:, k] * W[n0 + j, k]      fp32
    last program of row tile n (a self-resetting ticket per tile):  Y[m, n0:n0+BLOCK_N] = sum_s P[s, m]  (x's dtype):
        one [SPLIT_PAD, BLOCK_N] load and tree sum per token row (WIDE_REDUCE: one token, or many splits),
        else split by split

One launch: the partials go to an fp32 workspace [SPLIT_K, BLOCK_M, N] and the tile's last program (its ticket,
acquire-release) reduces them and resets the ticket, so the launch is graph-replayable with no memset.

``PDL`` (programmatic dependent launch, sm_90+): the grid may start while the previous kernel finishes; with
``PREFETCH`` each program first issues ``prefetch.global.L2`` for the first ``k_prefetch`` columns of its weight
slice (constant data; the launcher bounds the grid's total, so a large weight does not thrash L2), then lets the
next kernel launch (``gdc_launch_dependents``) and waits (``gdc_wait``) before it touches X, the workspace or Y.

``NORM`` > 0 (q_a's RMSNorm in the qkv_a projection): once every row tile is written, the last one to finish (a
second self-resetting ticket, ``TICKET[row tiles]``) RMS-normalises ``Y[:, :NORM]`` in place with weight ``NW``, so
the norm costs one ticket and an L2 round trip in this launch instead of a launch of its own.

``TMA``: the weight tiles come from a host tensor descriptor ``W_desc`` (W in [BLOCK_N, BLOCK_K] boxes) instead of
masked pointer loads.

Tensors: X [M, K] (unit stride on K), W [N, K] (torch's Linear layout), Y [M, N]; bf16 / fp16; P fp32; TICKET
int32 [row tiles + 1], zero between launches; NW [NORM] (the norm's weight) or unused.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _prefetch_l2(ptrs):
    # prefetch.global.L2 of every address (one per 128-byte line); no result, no fault on the lanes given the base
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _norm_after_last_tile(Y, TICKET2, NW, M, stride_ym, eps, NORM: tl.constexpr, NORM_P: tl.constexpr):
    """Called by each row tile's final writer once its Y tile is stored: the launch's last tile to finish (a
    self-resetting ticket, acquire-release) RMS-normalises ``Y[:, :NORM]`` in place with weight ``NW`` (fp32 sums,
    the arithmetic of ``fused_ops._rmsnorm_kernel``)."""
    tl.debug_barrier()  # this tile's Y stores precede its ticket
    done = tl.atomic_add(TICKET2, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:
        offs = tl.arange(0, NORM_P)
        mask = offs < NORM
        w = tl.load(NW + offs, mask=mask, other=0.0).to(tl.float32)
        for m in range(0, M):
            x = tl.load(Y + m * stride_ym + offs, mask=mask, other=0.0).to(tl.float32)
            var = tl.sum(x * x, axis=0) / NORM
            tl.store(Y + m * stride_ym + offs, (x * tl.rsqrt(var + eps) * w).to(Y.dtype.element_ty), mask=mask)
        tl.atomic_xchg(TICKET2, 0)


@triton.jit
def _gemv_splitk_kernel(X, W, W_desc, Y, P, TICKET, NW, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
                        k_prefetch, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, SPLIT_PAD: tl.constexpr, WIDE_REDUCE: tl.constexpr,
                        DOT_FP32: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, TMA: tl.constexpr,
                        NORM: tl.constexpr = 0, NORM_P: tl.constexpr = 1):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    nmask = rn < N
    mmask = rm < M
    k_lo = pid_s * k_per_split
    if PDL:
        if PREFETCH:  # the weight is constant: the slice's first k_prefetch columns go to L2 while the previous
            lines = tl.arange(0, BLOCK_K // 64)  # kernel finishes (64 bf16 / fp16 elements = one 128-byte line)
            for k0 in range(k_lo, k_lo + k_prefetch, BLOCK_K):
                lk = k0 + lines * 64
                pmask = nmask[:, None] & (lk < K)[None, :]
                _prefetch_l2(tl.where(pmask, W + rn.to(tl.int64)[:, None] * stride_wn + lk[None, :], W))
        gdc_launch_dependents()
        gdc_wait()  # x (and the workspace) belong to earlier kernels: nothing is read or written before this
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        if TMA:  # the tile by a TMA copy (rows past N and columns past K read as zeros)
            w = W_desc.load([pid_n * BLOCK_N, k0])
        else:
            w = tl.load(W + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0.0)
        xt = tl.load(X + rm[None, :] * stride_xm + rk[:, None], mask=mmask[None, :] & kmask[:, None], other=0.0)
        if DOT_FP32:  # the CPU interpreter (its bf16 dot is not exact)
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
        else:
            acc += tl.dot(w, xt)
    out_mask = nmask[:, None] & mmask[None, :]
    n_tiles = tl.num_programs(0)
    if SPLIT_K == 1:
        tl.store(Y + rm[None, :] * stride_ym + rn[:, None], acc.to(Y.dtype.element_ty), mask=out_mask)
        if NORM > 0:
            _norm_after_last_tile(Y, TICKET + n_tiles, NW, M, stride_ym, eps, NORM, NORM_P)
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
                    tl.store(Y + m * stride_ym + rn, tl.sum(part, axis=0).to(Y.dtype.element_ty), mask=nmask)
            else:
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in range(0, SPLIT_K):
                    total += tl.load(P + (s * BLOCK_M + rm[None, :]) * N + rn[:, None], mask=out_mask, other=0.0)
                tl.store(Y + rm[None, :] * stride_ym + rn[:, None], total.to(Y.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(TICKET + pid_n, 0)
            if NORM > 0:
                _norm_after_last_tile(Y, TICKET + n_tiles, NW, M, stride_ym, eps, NORM, NORM_P)
