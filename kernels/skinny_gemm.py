"""Small-M linear layer (the dense projections of a verify pass): ``y = x @ w^T`` with M <= 64 tokens.

At verify sizes the projections are matrix-vector products bounded by reading ``w`` once; what decides their
speed is how many programs stream the weight rows concurrently. A program owns BLOCK_N output columns (weight rows)
and, with SPLIT_K > 1, one of SPLIT_K slices of the reduction; its fp32 partial goes to ``part`` and a second launch
sums the slices in a fixed order (deterministic). With SPLIT_K == 1 the program writes ``y`` directly.

    y[m, n] = sum_k x[m, k] * w[n, k]                  (fp32 accumulation, one rounding to y's dtype)

Tensors:

| name  | shape               | dtype     | meaning                                      |
| ----- | ------------------- | --------- | -------------------------------------------- |
| x     | [M, K]              | bf16/fp16 | activations, unit column stride              |
| w     | [N, K]              | as x      | weight (torch ``Linear`` layout)             |
| y     | [M, N]              | as x      | result, unit column stride                   |
| part  | [SPLIT_K, M, N]     | fp32      | partial sums per reduction slice             |
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M", "N", "K", "K_PER_SPLIT"])
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, part_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_ym,
                        SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_lo = pid_k * K_PER_SPLIT
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None], other=0.0)
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            else:
                k_mask = offs_k < K
                w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                            mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                            mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if UPCAST:  # fp32 inputs and the interpreter (its bf16 tl.dot returns garbage): full fp32 products
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        out_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=out_mask)
        else:
            base = pid_k.to(tl.int64) * M * N
            tl.store(part_ptr + base + offs_m[:, None] * N + offs_n[None, :], acc, mask=out_mask)


@triton.jit(do_not_specialize=["M", "N"])
def _skinny_gemm_reduce_kernel(part_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    m = offs // N
    n = offs % N
    tl.store(y_ptr + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)
