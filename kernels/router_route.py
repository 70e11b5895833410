"""The router GEMV and the routing of a verify layer's MoE block in one launch, at up to 16 tokens (issue 22).

Math, for token rows ``m < MT`` of the normalised hidden state ``x`` [MT, H] (fp32 accumulation):

    logits[m]  = x[m] @ router^T                               (fp32, [MT, E], also returned)
    ids, w     = the routing of logits[m] (``_route_rows``: scores, bias, groups, top-k, renormalise, scale); with
                 ``OUT_K = TOP_K + 1`` each row ends with the shared expert's slot (``shared_id``, weight 1)

Why one launch: at 3-16 tokens the router costs three launches in the op chain (cuBLAS's split-K GEMM, its reduce,
the routing kernel) for ~4-6 MB of weight, each a fixed few microseconds of ramp and dependent round trip (the
moe_route section: 9.7 / 11.6 us a layer for Kimi-K2 at 4 tokens / DeepSeek-V3 at batch 4, H200); here the routing
runs in the program that finishes the GEMV last.

Grid (NT, SPLIT): program (t, p) multiplies router rows [t * BN, (t + 1) * BN) by x over its share of H (whole
BK-column chunks [p * NCH / SPLIT, (p + 1) * NCH / SPLIT)) and writes an fp32 partial [MT, BN]. The tile's last
program (a self-resetting ticket, acquire-release) sums the SPLIT partials into the tile's logits (one load of
[SPLIT, MTP, BN], MTP = MT rounded up to a power of two), then takes a second ticket: the program that finishes the
last tile routes every row, RROWS rows at a time. No program waits for another, so the grid needs no residency
guarantee.

With ``PDL`` each program sends its weight slice to L2, lets its dependent launch, and waits for its predecessor
before it reads x or writes anything.

Tensors: x [MT, H] bf16/fp16 (unit column stride); router [E, H] contiguous, x's dtype; bias [E] fp32;
logits [MT, E] fp32 (out); ids [MT, OUT_K] int32 (out); w [MT, OUT_K] fp32 (out); part fp32 scratch
[NT * SPLIT * MT * BN]; ticket int32 [NT + 1], zero between launches (the kernel leaves it zero).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from specverify.kernels.moe_block import _prefetch_rows, _tile_dot
from specverify.kernels.moe_route import _route_rows


@triton.jit
def _router_route_kernel(x_ptr, router_ptr, bias_ptr, logits_ptr, ids_ptr, w_ptr, part_ptr, ticket_ptr, stride_xm,
                         scale, shared_id,
                         MT: tl.constexpr, MTP: tl.constexpr, H: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
                         TOP_K: tl.constexpr, TOPK_P: tl.constexpr, OUT_K: tl.constexpr, RROWS: tl.constexpr,
                         N_GROUP: tl.constexpr, NG_P: tl.constexpr, GSIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, SOFTMAX: tl.constexpr,
                         HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr, STAGES: tl.constexpr,
                         PREFETCH: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0)
    sp = tl.program_id(1)
    NT: tl.constexpr = (E + BN - 1) // BN
    NCH: tl.constexpr = (H + BK - 1) // BK
    k_lo = sp * NCH // SPLIT * BK
    k_hi = (sp + 1) * NCH // SPLIT * BK
    j = tl.arange(0, BN)
    rows = t * BN + j
    rmask = rows < E
    if PDL:
        if PREFETCH:  # the router is constant: this program's slice goes to L2 while the previous kernel finishes
            _prefetch_rows(router_ptr, rows, rmask, H, k_lo, k_hi, H, BK)
        gdc_launch_dependents()
        gdc_wait()  # x belongs to the previous kernel: nothing is read or written before this
    acc = _tile_dot(router_ptr, rows, rmask, H, x_ptr, stride_xm, k_lo, k_hi, H, MT, BK, STAGES, DOT_FP32)
    cols = tl.arange(0, 16)
    tl.store(part_ptr + ((t * SPLIT + sp) * MT + cols[None, :]) * BN + j[:, None], acc, mask=(cols < MT)[None, :])
    tl.debug_barrier()  # this program's partial precedes its ticket
    ticket = tl.atomic_add(ticket_ptr + t, 1, sem="acq_rel")
    if ticket == SPLIT - 1:  # every split's partial of every row in one load (read past L1), summed over splits
        spl = tl.arange(0, SPLIT_PAD)
        mm = tl.arange(0, MTP)
        v = tl.load(part_ptr + ((t * SPLIT + spl[:, None, None]) * MT + mm[None, :, None]) * BN + j[None, None, :],
                    mask=(spl < SPLIT)[:, None, None] & (mm < MT)[None, :, None], other=0.0, cache_modifier=".cg")
        tl.store(logits_ptr + mm[:, None] * E + rows[None, :], tl.sum(v, axis=0),
                 mask=(mm < MT)[:, None] & rmask[None, :])
        tl.atomic_xchg(ticket_ptr + t, 0)
        tl.debug_barrier()  # the tile's logits precede the second ticket
        done = tl.atomic_add(ticket_ptr + NT, 1, sem="acq_rel")
        if done == NT - 1:
            for r0 in tl.static_range(0, MT, RROWS):
                _route_rows(logits_ptr, bias_ptr, ids_ptr, w_ptr, ids_ptr, ids_ptr, r0, MT, E, scale, shared_id, E,
                            EP, RROWS, TOP_K, TOPK_P, N_GROUP, NG_P, GSIZE, TOPK_GROUP, SOFTMAX, HAS_BIAS, RENORM,
                            False, OUT_K)
            tl.atomic_xchg(ticket_ptr + NT, 0)
