"""A verify layer's MoE block at a few tokens in one persistent launch: router GEMV, routing, the shared and routed
experts (issue 22). Kernel and its phases: ``specverify.kernels.moe_block``. Definition of correct:
``logits = x @ router^T`` in fp32, :func:`specverify.reference.moe.route_reference` on them, the shared expert as
one more slot of weight 1, :func:`specverify.reference.moe.fused_moe_reference` over the stacked weights.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from specverify import envvars
from specverify.fit import pdl_kwargs, pdl_launch, persistent_grid, sm_count
from specverify.moe import _cdiv, _check_route_args, _next_pow2
from specverify.workspace import grown_workspace

__all__ = ["MoEBlockResult", "moe_block", "MOE_BLOCK_MAX_M"]

#: Token counts the verify forward runs through :func:`moe_block` (the kernel takes up to 16); above, the four
#: launches (router GEMV, routing, gate/up, down). Chosen from ``bench/ab_verify_pass.py`` on the H200.
MOE_BLOCK_MAX_M = 2
_KERNEL_MAX_M = 16
#: (gate / up rows of a tile, K chunk): the default, and by token count where another measured faster in the pass
#: (H100, ``ab_verify_pass.py``, both orders, 2026-12-06: 16 x 256 at one token 5.325 against 5.351 ms, at two
#: 7.507 against 7.301; alone, ``bench_moe_block.py --configs``, the best four tiles at one token within 1.2 us of
#: one another, 46.6-47.8 us)
_BN, _BK = 32, 128
_TILES = {1: (16, 256)}
#: (K loops, down loop) pipeline depths and warps, best first (H200 at Kimi-K2 M = 1, 2, 4 warps: 6 / 3 at one
#: program an SM 39.4 / 60.4 us, 3 / 3 at two 40.2 / 65.6, 3 / 2 at two 44.4 / 73.2); the first whose compiled
#: kernel lets the grid be resident without spilling is taken (sm_120's ~100 KB of shared memory a block takes a
#: shallower one, its registers 8 warps)
_CANDIDATES = ((6, 3, 4), (4, 3, 4), (3, 3, 4), (3, 2, 4), (4, 3, 8), (3, 2, 8), (2, 2, 8))
#: slots whose first down tile goes to L2 before barrier 2 (every slot's: 0.07 / 0.33 ms slower at k = 1 / 2, H200)
_PF_SLOTS = 3
_WS: dict = {}
_CHOSEN: dict = {}
#: ``bench/bench_moe_block.py --timeline`` sets this to an int64 CUDA tensor of at least 16 * (2 * SMs) elements;
#: each launch then stamps its programs' phase boundaries into it (``_stamp`` in the kernel; a kernel compiled
#: apart). None in the pass.
_TIMELINE: torch.Tensor | None = None


class MoEBlockResult(NamedTuple):
    """out [M, H] (hidden's dtype); topk_ids int32 [M, top_k + 1] and topk_weights fp32 [M, top_k + 1] (last column:
    the shared expert, id E, weight 1); router_logits fp32 [M, E]."""

    out: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    router_logits: torch.Tensor


def _plan(m: int, h: int, inter: int, e: int, top_k: int, nprog: int) -> dict:
    """Tiles and splits for ``nprog`` programs: K split into parts of equal whole chunks so each K phase has at most
    one item a program, the down rows cut into ``nprog`` ranges (one each). H200, Kimi-K2 b 1 / 4k pass
    (bench/ab_verify_pass.py, both orders): parts as many as fill the grid (9 of 6-7 chunks at one token, 126
    items) were 0.02 / 0.07 ms slower at k = 1 / 2 than 8 equal ones (112 items); row ranges against 64-row tiles
    (112 items) equal within 0.01 ms."""
    bn, bk = _TILES.get(m, (_BN, _BK))
    chunks = _cdiv(h, bk)
    t1 = _cdiv(e, 2 * bn) + _cdiv(inter, bn)
    t2 = m * top_k * _cdiv(inter, bn)
    s1 = _cdiv(chunks, _cdiv(chunks, max(1, nprog // t1)))
    s2 = _cdiv(chunks, _cdiv(chunks, max(1, nprog // t2)))
    rh = max(16, _cdiv(h, nprog))
    return dict(BN=bn, BK=bk, SPLIT1=s1, SPLIT1_PAD=max(2, _next_pow2(s1)), SPLIT2=s2,
                SPLIT2_PAD=max(2, _next_pow2(s2)), RH=rh, BH=_next_pow2(rh), BI=min(256, _next_pow2(inter)),
                PF_BI=max(64, min(256, _next_pow2(inter))),
                SPP=max(2, _next_pow2(m * (top_k + 1))), PF_SLOTS=max(1, min(_PF_SLOTS, m * (top_k + 1))), T1=t1,
                T2=t2, M=m)


def _workspace(device, part: int, tickets: int):
    """(fp32 partials, int32 tickets, int32 barrier counters [2]) of ``device``; tickets and counters zero."""
    return grown_workspace(_WS, device, (part, tickets, 2), lambda n: (
        torch.empty(n[0], dtype=torch.float32, device=device), torch.zeros(n[1], dtype=torch.int32, device=device),
        torch.zeros(2, dtype=torch.int32, device=device)), "moe_block")


def _plan_consts(key, nprog: int, cand: tuple[int, int, int]) -> dict:
    """Launch keywords of ``nprog`` programs with the (K stages, down stages, warps) candidate ``cand``."""
    m, h, inter, e, top_k = key[:5]
    p = _plan(m, h, inter, e, top_k, nprog)
    for k in ("T1", "T2", "M"):
        p.pop(k)
    return dict(p, NPROG=nprog, STAGES_K=cand[0], STAGES_D=cand[1], num_warps=cand[2])


def moe_block(hidden: torch.Tensor, router: torch.Tensor, w13_all: torch.Tensor, w2_all: torch.Tensor, *, top_k: int,
              scoring: str = "sigmoid", correction_bias: torch.Tensor | None = None, n_group: int = 1,
              topk_group: int = 1, renormalize: bool = True, routed_scaling_factor: float = 1.0) -> MoEBlockResult:
    """The MoE block of a verify layer (router, routing, routed + shared SwiGLU experts) in one persistent launch.

    Math: ``logits = hidden @ router^T`` (fp32); ids / weights by the routing of :func:`specverify.moe.moe_route`
    (same semantics and tie rules; here on fp32 logits) with the shared expert as slot ``top_k`` (id E, weight 1);
    ``out[m] = sum_j w[m, j] * w2[e] @ (silu(gate[e] @ h) * (up[e] @ h))`` with the SwiGLU output rounded to
    hidden's dtype, summed in a fixed order (deterministic). Source: DeepSeek-V3's MoE layer (routed + shared
    experts, auxiliary-loss-free routing); one persistent grid with grid barriers instead of four launches.

    Parameters
    ----------
    hidden : torch.Tensor
        (M, H), bfloat16 or float16, unit column stride; 1 <= M <= 16 (the verify forward uses it up to
        :data:`MOE_BLOCK_MAX_M`).
    router : torch.Tensor
        (E, H), hidden's dtype, contiguous.
    w13_all, w2_all : torch.Tensor
        (E + 1, 2I, H) and (E + 1, H, I), hidden's dtype, unit column stride: gate rows then up rows of each expert,
        expert E the shared one (the verify forward's ``w13_all`` / ``w2_all``).
    top_k, scoring, correction_bias, n_group, topk_group, renormalize, routed_scaling_factor
        As :func:`specverify.moe.moe_route` (``correction_bias`` fp32-convertible, shape (E,)).

    Returns
    -------
    MoEBlockResult
        ``out`` (M, H) in hidden's dtype, ``topk_ids`` int32 (M, top_k + 1), ``topk_weights`` fp32 (M, top_k + 1),
        ``router_logits`` fp32 (M, E). New tensors each call.

    Raises
    ------
    TypeError
        Non-tensor operands; hidden not bf16 / fp16, or weights of another dtype; the routing arguments' types as
        :func:`specverify.moe.moe_route` raises them (``top_k`` not an int, a non-float bias, ``renormalize`` not a
        bool, ``routed_scaling_factor`` not a Python number).
    ValueError
        Shapes that disagree (the shared expert must be expert E of the stacked weights), M outside 1..16, H or I
        below 16, a non-unit last stride of hidden / w13_all / w2_all or a non-contiguous router, tensors on
        different devices, CPU tensors without ``TRITON_INTERPRET=1``, top_k above 64, and the routing values
        :func:`specverify.moe.moe_route` rejects (top_k outside 1..E, n_group not dividing E or above 64,
        topk_group outside 1..n_group, top_k above the kept groups' experts, unknown scoring, a bias of the wrong
        shape or device).
    RuntimeError
        A call that must grow the per-device workspace (the first one, or a larger shape) during CUDA-graph
        capture; no launch config lets the grid be resident (never on the H200 or sm_120 at the pass's shapes).

    Notes
    -----
    Graph-safe after one eager call (the workspace is then sized for every token count up to
    :data:`MOE_BLOCK_MAX_M`): fixed grid, self-resetting tickets and barrier counters, no host sync; a workspace
    replaced by a larger one is kept alive for the graphs that captured it. Every program must be resident at once
    (the launcher sizes the grid from the compiled kernel and the device's SM count), so: one call at a time per
    device (calls share the workspace and its barrier counters; the verify pass runs on one stream), and not beside
    work that holds SMs for its whole duration, nor under MPS or green contexts that give this process fewer SMs
    than the device has (the barrier would wait forever). CUDA (sm_80+; PDL wait on sm_90+) or the Triton
    interpreter (which runs the three phases as three launches).
    """
    from specverify.kernels.moe_block import _moe_block_kernel

    op = "moe_block"
    for name, t in (("hidden", hidden), ("router", router), ("w13_all", w13_all), ("w2_all", w2_all)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{op}: hidden must be bfloat16 or float16, got {hidden.dtype}; cast it with .bfloat16()")
    for name, t in (("router", router), ("w13_all", w13_all), ("w2_all", w2_all)):
        if t.dtype != hidden.dtype:
            raise TypeError(f"{op}: {name} must have hidden's dtype {hidden.dtype}, got {t.dtype}; cast it with "
                            f".to({hidden.dtype})")
        if t.device != hidden.device:
            raise ValueError(f"{op}: {name} is on {t.device}, hidden on {hidden.device}; move them to one device")
    dev = hidden.device
    if dev.type != "cuda" and not envvars.triton_interpret():
        raise ValueError(f"{op}: needs CUDA tensors, got {dev}; on a CPU set TRITON_INTERPRET=1 before importing "
                         "specverify to run the kernel in Triton's interpreter")
    if hidden.dim() != 2 or router.dim() != 2 or w13_all.dim() != 3 or w2_all.dim() != 3:
        raise ValueError(f"{op}: expected hidden (M, H), router (E, H), w13_all (E + 1, 2I, H), w2_all (E + 1, H, I); "
                         f"got {list(hidden.shape)}, {list(router.shape)}, {list(w13_all.shape)}, "
                         f"{list(w2_all.shape)}")
    m, h = hidden.shape
    e = router.shape[0]
    inter = w2_all.shape[2]
    if (router.shape[1] != h or tuple(w13_all.shape) != (e + 1, 2 * inter, h)
            or tuple(w2_all.shape) != (e + 1, h, inter)):
        raise ValueError(f"{op}: shapes disagree: hidden {list(hidden.shape)}, router {list(router.shape)}, w13_all "
                         f"{list(w13_all.shape)}, w2_all {list(w2_all.shape)}; expected router (E, {h}), w13_all "
                         f"(E + 1, 2I, {h}), w2_all (E + 1, {h}, I) with the shared expert as expert E")
    if not 1 <= m <= _KERNEL_MAX_M:
        raise ValueError(f"{op}: M must be in 1..{_KERNEL_MAX_M}, got {m}; above, use moe_route + fused_moe")
    if h < 16 or inter < 16:
        raise ValueError(f"{op}: the hidden size and the expert intermediate size must be >= 16, got H = {h}, "
                         f"I = {inter}")
    for name, t, dim in (("hidden", hidden, 1), ("w13_all", w13_all, 2), ("w2_all", w2_all, 2)):
        if t.stride(dim) != 1:
            raise ValueError(f"{op}: {name} needs a unit stride in its last dimension, got strides "
                             f"{tuple(t.stride())}; pass {name}.contiguous()")
    if not router.is_contiguous():
        raise ValueError(f"{op}: router must be contiguous (E, H), got strides {tuple(router.stride())}; pass "
                         "router.contiguous() once (the weight is constant)")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 64:
        raise ValueError(f"{op}: top_k must be at most 64, got {top_k}")
    logits = torch.empty((m, e), dtype=torch.float32, device=dev)
    # the routing arguments as moe_route takes them (same checks and messages), against the logits buffer
    _check_route_args(logits, top_k, scoring, correction_bias, n_group, topk_group, renormalize,
                      routed_scaling_factor, None)
    bias = (correction_bias.float().contiguous() if correction_bias is not None
            else torch.zeros(1, dtype=torch.float32, device=dev))
    ids = torch.empty((m, top_k + 1), dtype=torch.int32, device=dev)
    tw = torch.empty((m, top_k + 1), dtype=torch.float32, device=dev)
    act = torch.empty((m * (top_k + 1), inter), dtype=hidden.dtype, device=dev)
    out = torch.empty((m, h), dtype=hidden.dtype, device=dev)
    interp = dev.type != "cuda" or envvars.triton_interpret()
    pdl = pdl_launch(dev)
    # the launch choice depends on the compiled kernel: key it on everything that selects one (the tiles and
    # candidates too: ``bench/bench_moe_block.py --configs`` and ``bench/ab_verify_pass.py`` set them; the SM count,
    # which sizes the grid and the workspace below: tests stand in a smaller one)
    timing = _TIMELINE is not None and not interp
    sms = sm_count(dev.type, dev.index)
    key = (m, h, inter, e, top_k, hidden.dtype, scoring, n_group, topk_group, correction_bias is not None,
           bool(renormalize), pdl, timing, _TILES.get(m, (_BN, _BK)), _CANDIDATES, sms)
    ep = max(_next_pow2(e), 16)
    consts = dict(MT=m, H=h, I=inter, E=e, EP=ep, TOP_K=top_k, TOPK_P=max(2, _next_pow2(top_k)),
                  ROWS=_next_pow2(m), N_GROUP=n_group, NG_P=max(2, _next_pow2(n_group)), GSIZE=e // n_group,
                  TOPK_GROUP=topk_group, SOFTMAX=scoring == "softmax", HAS_BIAS=correction_bias is not None,
                  RENORM=renormalize, DOT_FP32=interp, PREFETCH=not interp, TIMING=timing, **pdl_kwargs(dev))
    # the workspace covers either grid size's plan (sized before the kernel is compiled) at every token count up to
    # the forward's, so a graph captured later at another count needs no allocation
    plans = [_plan(mm, h, inter, e, top_k, sms * p) for p in (1, 2) for mm in range(1, max(m, MOE_BLOCK_MAX_M) + 1)]
    need_p = max((p["T1"] * p["SPLIT1"] * p["M"] + p["T2"] * p["SPLIT2"]) * 2 * p["BN"] for p in plans)
    need_t = max(p["T1"] + p["T2"] for p in plans)
    part, ticket, bar = _workspace(dev, need_p, need_t)

    args = (hidden, router, bias, w13_all, w2_all, logits, ids, tw, act, part, ticket, bar, out,
            _TIMELINE if timing else bar, hidden.stride(0),
            out.stride(0), w13_all.stride(0), w13_all.stride(1), w2_all.stride(0), w2_all.stride(1),
            float(routed_scaling_factor))
    cfg = dict(consts, **persistent_grid(_moe_block_kernel, args, dict(consts, PHASE=0), dev, sms, key, _CANDIDATES,
                                         functools.partial(_plan_consts, key), _CHOSEN, op))
    nprog = cfg["NPROG"]
    if timing and (_TIMELINE.dtype != torch.int64 or _TIMELINE.numel() < 16 * nprog or _TIMELINE.device != dev):
        raise ValueError(f"{op}: the timeline buffer must be int64 with >= {16 * nprog} elements on {dev}, got "
                         f"{_TIMELINE.dtype} x {_TIMELINE.numel()} on {_TIMELINE.device}")
    if interp:  # programs run one after another: the three phases as three launches, no grid barrier
        for phase in (1, 2, 3):
            _moe_block_kernel[(nprog,)](*args, PHASE=phase, **cfg)
    else:
        _moe_block_kernel[(nprog,)](*args, PHASE=0, **cfg)
    return MoEBlockResult(out, ids, tw, logits)
