"""Skinny GEMM for the verify pass's projections (``x @ w.T`` at M <= 16 rows): see :mod:`specverify.kernels.gemv`.

Timed against cuBLAS by ``bench/bench_gemv.py``; the verify forward calls :func:`linear`, which runs it only at
the shapes where it measured faster (bench/RESULTS.md, "Projections"). Graph capturable after one eager call per
(device, N) (which allocates the workspace and the self-resetting tickets); ``impl="reference"`` runs
:func:`specverify.reference.gemv.gemv_reference`; ``auto`` uses Triton on CUDA tensors (or under
``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import torch

from specverify.fit import pdl_kwargs, sm_count
from specverify.fused_ops import _use_triton, triton_next_pow2
from specverify.workspace import grown_workspace

_FLOAT = (torch.bfloat16, torch.float16)
#: Largest M the kernel serves (the MMA's N side, 16 token columns); callers use torch.matmul above it.
MAX_M = 16
_BUFFERS: dict = {}
#: Splits from which the last program of a row tile sums the partials with one wide load per token row at every M
#: (below it, and above one token, split by split): qkv_a's 8 splits lost with the wide form at 8 tokens (15.0
#: against 11.4 us); the router's ~66 splits serialise the split-by-split loop (15.5 us at 4 tokens, bench_gemv).
WIDE_REDUCE_MIN_SPLITS = 16
#: ``PREFETCH_BYTES``: with PDL, the grid prefetches up to this much of the weight into L2 before ``gdc_wait``
#: (whole ``BLOCK_K`` chunks a program, at least one; 0: none). 8 MiB measured fastest in the pass against 0 and
#: 32 MiB (bench/RESULTS.md, "Verify pass"). The tile (``BLOCK_N`` weight rows x ``BLOCK_K``), the grid's size
#: (``WAVES`` programs an SM, by splitting K) and the launch's warps / stages: the defaults; :data:`SHAPE_CONFIGS`
#: overrides them per shape (``bench/sweep_gemv.py`` times the candidates).
_CONFIG = {"PREFETCH_BYTES": 8 << 20, "BLOCK_N": 64, "BLOCK_K": 128, "WAVES": 2, "num_warps": 4, "num_stages": 3}
_INF = 1 << 62
#: ((max M, (N lo, N hi), (K lo, K hi)), overrides of :data:`_CONFIG`): the first rule that holds applies. From
#: ``bench/sweep_gemv.py`` on the H200 (2026-12-03, bench/RESULTS.md "Verify pass"): qkv_a 7168 -> 2112 with 4
#: stages (10.14 / 10.74 us at M = 1 / 4 against 12.31 / 12.68 with 3; cuBLAS 12.28 / 13.27); Kimi-K2's q_b
#: 1536 -> 1536 at 2-4 tokens with 8 warps (5.34 us at M = 4 against 5.83 with 4; cuBLAS 6.13). Kimi-K2's router
#: 7168 -> 384 at one token with one program an SM (``bench/ab_verify_pass.py``, the whole pass, both orders: 4.873 /
#: 4.877 ms at k = 1 against 4.890 / 4.897 with two; 4 an SM 4.892; bench/RESULTS.md "Verify pass"). o_proj 1024 /
#: 2048 -> 7168 on row ranges of 28 rows (two programs an SM) with 256-column chunks, 3 stages and a 2 MiB
#: prefetch (the pass on the H100, 2026-12-06: see :data:`LINEAR_RULES`; 5.367 / 7.374 ms at k = 1 / 2 against
#: 5.392 / 7.393 with 55 rows; row ranges for qkv_a and q_b measured slower in the pass).
SHAPE_CONFIGS: tuple = (((4, (2048, 4096), (7168, 7168)), {"num_stages": 4}),
                        ((1, (384, 384), (7168, 7168)), {"WAVES": 1}),
                        ((1, (1536, 1536), (1536, 1536)), {}),
                        ((4, (1536, 1536), (1536, 1536)), {"num_warps": 8}),
                        ((8, (7168, 7168), (1024, 2048)), {"ROW_RANGE": True, "WAVES": 2, "BLOCK_K": 256,
                                                           "num_stages": 3, "PREFETCH_BYTES": 2 << 20}))


def _holds(rule, m: int, n: int, k: int) -> bool:
    """Whether a shape rule ``(max M, (N lo, N hi), (K lo, K hi))``, bounds inclusive, covers ``[m, k] @ [n, k].T``."""
    mm, (nlo, nhi), (klo, khi) = rule
    return m <= mm and nlo <= n <= nhi and klo <= k <= khi


def gemv_config(m: int, n: int, k: int) -> dict:
    """The launch config of an ``[m, k] @ [n, k].T`` GEMV: :data:`_CONFIG` with the first matching
    :data:`SHAPE_CONFIGS` rule's overrides."""
    for rule, over in SHAPE_CONFIGS:
        if _holds(rule, m, n, k):
            return {**_CONFIG, **over}
    return dict(_CONFIG)


def prefetch_columns(programs: int, per: int, elem_bytes: int, cfg: dict | None = None, rows: int | None = None) -> int:
    """K columns of its slice (``per`` wide, ``rows`` weight rows, default ``BLOCK_N``) each of ``programs`` programs
    prefetches under ``PREFETCH_BYTES``."""
    cfg = cfg or _CONFIG
    budget = cfg["PREFETCH_BYTES"]
    if budget <= 0:
        return 0
    chunk = (rows or cfg["BLOCK_N"]) * cfg["BLOCK_K"] * elem_bytes
    return min(per, max(1, budget // (programs * chunk)) * cfg["BLOCK_K"])


def gemv_rows(n: int, sms: int, cfg: dict | None = None) -> tuple[int, int]:
    """(weight rows a program, its pow-2 tile height): ``BLOCK_N`` both, or with ``ROW_RANGE`` N cut into
    ``WAVES * sms`` equal ranges (rounded up) in a tile of the next power of two, at least 16 (the MMA's side)."""
    cfg = cfg or _CONFIG
    if not cfg.get("ROW_RANGE"):
        return cfg["BLOCK_N"], cfg["BLOCK_N"]
    rows = -(-n // (cfg["WAVES"] * sms))
    return rows, max(16, triton_next_pow2(rows))


def gemv_split(n: int, k: int, sms: int, cfg: dict | None = None) -> tuple[int, int]:
    """(split count, K elements a split): splits of whole ``BLOCK_K`` chunks, as long as at least ``WAVES * sms``
    programs over the ``ceil(n / BLOCK_N)`` row tiles need (at most one chunk a split when even that falls short);
    one split of all K with ``ROW_RANGE`` (:func:`gemv_rows`)."""
    cfg = cfg or _CONFIG
    if cfg.get("ROW_RANGE"):
        return 1, k
    tiles = -(-n // cfg["BLOCK_N"])
    chunks = -(-k // cfg["BLOCK_K"])
    want = max(1, -(-cfg["WAVES"] * sms // tiles))
    per = max(1, chunks // want) * cfg["BLOCK_K"]
    return -(-k // per), per


def _buffers(device, n, split, rows):
    """(partials fp32 [>= split * MAX_M * n], tickets int32 [row tiles], sums of squares fp32 [row tiles, MAX_M] of
    :func:`gemv_sumsq`) for one (device, N, rows a tile): :func:`specverify.workspace.grown_workspace` of
    ``_BUFFERS[(N, rows)]``, grown to ``split`` and kept (graph replays reuse the addresses; a set replaced by a
    larger one stays allocated for the graphs captured on it; growing during CUDA-graph capture raises
    RuntimeError)."""
    tiles = -(-n // rows)
    part, ticket, sums = grown_workspace(
        _BUFFERS.setdefault((n, rows), {}), torch.device(device), (split * MAX_M * n, tiles, tiles * MAX_M),
        lambda size: (torch.empty(size[0], dtype=torch.float32, device=device),
                      torch.zeros(size[1], dtype=torch.int32, device=device),
                      torch.empty(size[2], dtype=torch.float32, device=device)), "gemv")
    return part, ticket, sums.view(-1, MAX_M)


#: Where :func:`gemv` beat cuBLAS on the H200 (bench_gemv, 2026-12-02), as (max M, N range, K range), bounds
#: inclusive; cuBLAS keeps every other projection:
#:
#: * M <= 8, N >= 2048, K = 7168: qkv_a 7168 -> 2112 (0.84-0.88x cuBLAS's time) and the LM head 7168 -> 20480
#:   (0.88-0.90x);
#: * M = 1, N <= 512, K = 7168: the router 7168 -> 384 / 256 (0.80 / 0.73x; at 4-8 tokens 1.1-1.6x);
#: * M <= 4, N = K = 1536: Kimi-K2's q_b 1536 -> 1536 (M = 1 0.85x; M = 4 0.87x with 8 warps, sweep_gemv
#:   2026-12-03; DeepSeek-V3's 1536 -> 3072 is 1.08-1.17x).
#:
#: * M <= 8, N = 7168, K = 1024 / 2048: o_proj on row ranges (one range of weight rows a program over all K,
#:   no split reduce): alone 5.92 against cuBLAS's 7.71 us (Kimi-K2, M = 1, H100, sweep_gemv 2026-12-06); in the pass
#:   (``ab_verify_pass.py``, both orders) 5.396 / 7.405 against 5.434 / 7.451 ms at k = 1 / 2 with a 2 MiB prefetch.
#:   The split-K tiles had lost at every M (1.18-1.81x cuBLAS's time, 2026-12-03).
#: K is bounded by what was measured (7168, the hidden size): a K = 8192 o_proj (DeepSeek-V3 at tp 2) stays cuBLAS's.
LINEAR_RULES = ((8, (2048, _INF), (7168, 7168)), (1, (1, 512), (7168, 7168)), (4, (1536, 1536), (1536, 1536)),
                (8, (7168, 7168), (1024, 2048)))


def gemv_is_faster(m: int, n: int, k: int) -> bool:
    """Whether :data:`LINEAR_RULES` give this ``[m, k] @ [n, k].T`` projection to :func:`gemv`."""
    return any(_holds(rule, m, n, k) for rule in LINEAR_RULES)


def _served(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x as [M, K] when :func:`linear` runs ``x @ w.T`` on :func:`gemv` (the shape rule, bf16 / fp16 with unit
    stride on K, on CUDA or under the interpreter), else None."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    n = w.shape[0]
    if (m >= 1 and gemv_is_faster(m, n, k) and x.dtype in _FLOAT and w.dtype == x.dtype and w.dim() == 2
            and w.shape[1] == k and w.stride(1) == 1 and _use_triton("auto", x, w)):
        flat = x.reshape(m, k)
        if flat.stride(1) == 1:
            return flat
    return None


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for the verify pass's projections: :func:`gemv` where it measured faster than cuBLAS
    (:func:`gemv_is_faster`; bf16 / fp16 with unit stride on K, on CUDA or under the interpreter), ``torch.matmul``
    otherwise.

    x [..., K] (any leading strides that flatten to [M, K] with unit stride on K, e.g. a column slice of a wider
    activation); w [N, K]. Returns [..., N] in x's dtype. Graph capturable after one eager call per (device, N)
    (see :func:`gemv`); no validation beyond the shape rule (the verify forward's own tensors).
    """
    flat = _served(x, w)
    if flat is not None:
        return gemv(flat, w).view(*x.shape[:-1], w.shape[0])
    return x @ w.t()


def linear_sumsq(x: torch.Tensor, w: torch.Tensor, cols: int):
    """:func:`linear` with the sums of squares of :func:`gemv_sumsq`, where :func:`linear` would run :func:`gemv`.

    x [..., K]; w [N, K]; cols in [1, N]. Returns ``(y [..., N], partials fp32 [P, M])`` (M = x's rows; see
    :func:`gemv_sumsq`), or None where :func:`linear` runs ``torch.matmul`` (no epilogue there; nothing is launched
    and the caller takes its unfused path). The choice depends on shapes and dtypes only, so it is fixed under graph
    capture. The verify forward's qkv_a projection: q_a's RMSNorm scale without a norm kernel.
    """
    flat = _served(x, w)
    if flat is None:
        return None
    y, part = gemv_sumsq(flat, w, cols)
    return y.view(*x.shape[:-1], w.shape[0]), part


def _check(op, x, w, out):
    """Validate a GEMV's operands; returns (m, n, k, out) with ``out`` allocated when None."""
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT or t.dim() != 2:
            raise TypeError(f"{op}: {name} must be a 2-d bf16/fp16 tensor, got {t.dtype} {list(t.shape)}")
    if w.dtype != x.dtype:
        raise TypeError(f"{op}: w must have x's dtype {x.dtype}, got {w.dtype}")
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"{op}: w must be [N, K = {k}] (x is [{m}, {k}]), got {list(w.shape)}")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"{op}: x must have 1..{MAX_M} rows, got {m}; use torch.matmul for wider inputs")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{op}: x and w need a unit stride on K; pass .contiguous() tensors")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"{op}: out must be {x.dtype} [{m}, {n}] with unit stride, got {out.dtype} "
                         f"{list(out.shape)}")
    return m, n, k, out


def _launch(x, w, out, sumsq_cols: int = 0):
    """One launch of the split-K kernel; with ``sumsq_cols`` its sums of squares too: returns the partials view
    [tiles over sumsq_cols, M] of the persistent buffer, else None."""
    from specverify.kernels.gemv import _gemv_splitk_kernel

    m, k = x.shape
    n = w.shape[0]
    cfg = gemv_config(m, n, k)
    sms = sm_count(x.device.type, x.device.index)
    split, per = gemv_split(n, k, sms, cfg)
    rows, block_n = gemv_rows(n, sms, cfg)
    part, ticket, sums = _buffers(x.device, n, split, rows)
    grid = (-(-n // rows), split)
    pdl = pdl_kwargs(x.device)
    k_prefetch = prefetch_columns(grid[0] * grid[1], per, x.element_size(), cfg, rows) if pdl["PDL"] else 0
    _gemv_splitk_kernel[grid](x, w, out, part, ticket, sums, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                              MAX_M, per, k_prefetch, sumsq_cols,
                              BLOCK_M=max(16, triton_next_pow2(m)), BLOCK_N=block_n, ROWS=rows, BLOCK_K=cfg["BLOCK_K"],
                              SPLIT_K=split, SPLIT_PAD=triton_next_pow2(split),
                              WIDE_REDUCE=m == 1 or split >= WIDE_REDUCE_MIN_SPLITS,
                              DOT_FP32=not x.is_cuda, PREFETCH=k_prefetch > 0, SUMSQ=sumsq_cols > 0,
                              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl)
    return sums[: -(-sumsq_cols // rows), :m] if sumsq_cols else None


def gemv(x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """``x @ w.T`` for skinny ``x``.

    Source: split-K GEMV with the MMA operands swapped (the weight rows on the MMA's M side), as in the skinny
    GEMM paths of TensorRT-LLM and FlashInfer.

    Parameters
    ----------
    x : Tensor [M, K], M in [1, 16], unit stride on K; bf16 / fp16.
    w : Tensor [N, K] (a Linear weight), unit stride on K, x's dtype.
    out : Tensor [M, N] of x's dtype with unit stride on N, or None (allocated).

    Returns ``out`` [M, N] in x's dtype (fp32 accumulation, one rounding).

    Raises
    ------
    TypeError
        Non-bf16/fp16 or mismatched dtypes.
    ValueError
        Shapes that disagree, M outside [1, 16] (use ``torch.matmul``), a strided K dimension.

    Notes
    -----
    One launch; CUDA-graph capturable after one eager call per (device, N) (the workspace and its self-resetting
    tickets). On sm_90+ it launches as a programmatic dependent (:func:`specverify.fit.pdl_launch`).
    """
    from specverify.reference.gemv import gemv_reference

    m, n, k, out = _check("gemv", x, w, out)
    if not _use_triton(impl, x, w):
        out.copy_(gemv_reference(x, w))
        return out
    _launch(x, w, out)
    return out


def gemv_sumsq(x: torch.Tensor, w: torch.Tensor, cols: int, *, out: torch.Tensor | None = None,
               impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gemv` that also returns, per token row, partial sums of squares of its first ``cols`` output columns
    as stored (rounded to x's dtype): the RMSNorm statistic of a projection's leading slice from the same launch.

    The verify forward's qkv_a projection (q_a, then kv_a) passes ``cols = q_lora_rank``: q_a's RMSNorm then needs
    no kernel of its own, one launch fewer per MLA layer. Its weight is folded into q_b's (``q_b_folded``,
    :func:`specverify.forward.model.fold_q_norm`) and its per-token scale ``rsqrt(sum_p partials[p, t] / cols +
    eps)`` is applied after q_b, in :func:`specverify.fused_ops.mla_prep_absorb` (``q_sumsq``): every op after q_b is
    linear in q per token.

    Parameters
    ----------
    x, w, out, impl
        As in :func:`gemv`.
    cols : int in [1, N]
        The leading output columns whose squares are summed.

    Returns
    -------
    out : Tensor [M, N], x's dtype, as :func:`gemv` returns it.
    partials : fp32 Tensor [P, M]
        ``partials.sum(0)[m] == sum(float(out[m, :cols]) ** 2)`` up to fp32 summation order. Row p is the kernel's
        row tile p (its rows below ``cols``), so P = ceil(cols / rows a tile) depends on the launch config (1 with
        ``impl="reference"``). With Triton it is a strided view (row stride 16) of a buffer kept per (device, N,
        rows a tile): the next :func:`gemv_sumsq` over the same N overwrites it, so read it before then (the verify
        forward reads it two launches later, in the same layer).

    Raises
    ------
    TypeError
        As :func:`gemv`; ``cols`` not an int.
    ValueError
        As :func:`gemv`; ``cols`` outside [1, N].

    Notes
    -----
    One launch, deterministic (one slot per row tile and token, summed in one program: no atomics). CUDA-graph
    capturable after one eager call per (device, N) (the partials buffer keeps its address); a programmatic
    dependent on sm_90+.
    """
    from specverify.reference.gemv import gemv_reference

    op = "gemv_sumsq"
    m, n, k, out = _check(op, x, w, out)
    if isinstance(cols, bool) or not isinstance(cols, int):
        raise TypeError(f"{op}: cols must be an int in [1, N = {n}] (e.g. q_lora_rank), got {type(cols).__name__}")
    if not 1 <= cols <= n:
        raise ValueError(f"{op}: cols must lie in [1, N = {n}] (the leading output columns to sum), got {cols}")
    if not _use_triton(impl, x, w):
        out.copy_(gemv_reference(x, w))
        return out, out[:, :cols].float().pow(2).sum(-1).unsqueeze(0)
    return out, _launch(x, w, out, cols)
