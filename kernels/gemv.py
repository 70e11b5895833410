"""Skinny GEMM (GEMV) for the verify pass's projections: ``Y[M, N] = X[M, K] @ W[N, K]^T`` with M <= 16 rows.

At verify sizes (1-8 tokens a rank) a projection reads its weight once and does almost no arithmetic, so its cost
is the weight bytes over the bandwidth the kernel reaches. One program owns ``BLOCK_N`` output columns (weight
rows) and streams them along K in ``BLOCK_K`` chunks, coalesced, with every input row held in registers; the
launcher picks ``BLOCK_N`` so the grid covers every SM about twice (no split-K: each program writes its columns
once, in the output dtype, so there is no second launch and no memset)::

    acc[m, n] = sum_k  X[m, k] * W[n0 + n, k]      fp32, m < M (BLOCK_M = M rounded up), n < BLOCK_N

Tensors: X [M, K] (unit stride on K), W [N, K] (torch's Linear layout, unit stride on K), Y [M, N]; bf16 / fp16
/ fp32, fp32 accumulation.
"""
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    nmask = rn < N
    mmask = rm < M
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = X + rm[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])
