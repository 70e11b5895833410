"""A verify layer's MLA attention at a few tokens in one persistent launch: qkv_a, q_a's norm, q_b, the KV write,
the absorbed query, tree attention, the V up-projection and o_proj (issue 22). Kernel and its phases:
``specverify.kernels.mla_block``. Definition of correct: the op chain of the verify forward on the references
(:func:`mla_block_reference`).
"""
from __future__ import annotations

import functools
import math

import torch

from specverify import envvars
from specverify.fit import pdl_launch, persistent_grid, sm_count
from specverify.reference.attention import tree_attention_mla_reference
from specverify.reference.fused_ops import (mla_absorb_q_reference, mla_kv_prep_reference, mla_up_v_reference,
                                            rmsnorm_reference)
from specverify.validation import capturing, check_int_tensor, check_paged_kv, check_tree_mask
from specverify.workspace import grown_workspace

__all__ = ["mla_block", "mla_block_fits", "mla_block_reference", "MLA_BLOCK_MAX_M"]

#: Token counts (batch x draft tokens) the verify forward runs through :func:`mla_block` (the kernel takes up to
#: 16); above, the op chain.
MLA_BLOCK_MAX_M = 2
_KERNEL_MAX_M = 16
_BK = 128
#: Weight rows of a phase-1 (qkv_a) and a phase-2 (q_b) tile.
_TA, _TB = 64, 32
#: KV tokens a split tile reads.
_ATT_BN = 64
#: (K-loop pipeline stages, warps), best first; the first whose compiled kernel lets the grid be resident without
#: spilling is taken (two programs an SM tried before one).
_CANDIDATES = ((4, 4), (3, 4), (2, 4), (3, 8), (2, 8), (1, 8))
#: Before which barrier each program sends its W_o rows and first W_uv chunk to L2 (1, 3 or 4; 0: not at all).
_PF_O = 0
#: Launch keywords that replace the plan's (bench sweeps only; empty in use): NPROG, STAGES, num_warps, PF_O,
#: PREFETCH, ATT_BN, and PHASES (a list: those phases as separate launches without barriers, to time them).
_TUNE: dict = {}
_WS: dict = {}
_CHOSEN: dict = {}


def mla_block_fits(num_draft_tokens: int, heads: int, nope: int, kv_lora_rank: int, rope_dim: int,
                   v_head_dim: int) -> bool:
    """Whether :func:`mla_block` takes a layer of these sizes (else it raises ValueError): NOPE, R and V powers of two
    >= 16, the rope dim a power of two >= 2, draft tokens x heads <= 32."""
    pow2 = [d for d in (nope, kv_lora_rank, v_head_dim, rope_dim) if d & (d - 1) == 0]
    return (len(pow2) == 4 and min(nope, kv_lora_rank, v_head_dim) >= 16 and rope_dim >= 2
            and num_draft_tokens * heads <= 32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _equal_split(chunks: int, tiles: int, nprog: int) -> int:
    """K parts of equal whole chunks, as many as let every (tile, part) item have a program of its own."""
    return _cdiv(chunks, _cdiv(chunks, max(1, nprog // tiles)))


def _plan(shape: tuple, nprog: int) -> dict:
    """Tiles and splits of a grid of ``nprog`` programs for ``shape`` = (M, KQ, H, Q, R, DR, NOPE, NH, V, capacity)
    (capacity: the KV positions a page-table row holds)."""
    m, kq, h, q, r, dr, nope, nh, v, capacity = shape
    b = m // kq
    ta, tb = int(_TUNE.get("TA", _TA)), int(_TUNE.get("TB", _TB))
    sa = _equal_split(_cdiv(h, _BK), _cdiv(q + r + dr, ta), nprog)
    sb = _equal_split(_cdiv(q, _BK), _cdiv(nh * (nope + dr), tb), nprog)
    att_bn = int(_TUNE.get("ATT_BN", _ATT_BN))
    rch = min(128, max(16, r // 4))  # value chunk of a phase-4 item
    nsplit = max(1, min(_cdiv(capacity, att_bn), max(1, nprog // (b * (r // rch)))))
    rh = max(16, _cdiv(h, nprog))
    return dict(TA=ta, TB=tb, BK=_BK, SPLIT_A=sa, SPLIT_A_PAD=max(2, _next_pow2(sa)), SPLIT_B=sb,
                SPLIT_B_PAD=max(2, _next_pow2(sb)), BR=min(64, r), NSPLIT=nsplit,
                NSPLIT_PAD=max(2, _next_pow2(nsplit)), ATT_BN=att_bn, BM=max(16, _next_pow2(kq * nh)), RCH=rch,
                BC=min(64, r // 2), RH=rh, BH=_next_pow2(rh), PF_O=_PF_O)


def _plan_consts(shape: tuple, nprog: int, cand: tuple[int, int]) -> dict:
    """Launch keywords of ``nprog`` programs with the (stages, warps) candidate ``cand``."""
    return dict(_plan(shape, nprog), NPROG=nprog, STAGES=cand[0], num_warps=cand[1])


def _part_size(shape: tuple, p: dict) -> tuple[int, int]:
    """(fp32 partials, tickets) the plan ``p`` needs."""
    m, kq, h, q, r, dr, nope, nh, v, _ = shape
    t_a, t_b = _cdiv(q + r + dr, p["TA"]), _cdiv(nh * (nope + dr), p["TB"])
    return (t_a * p["SPLIT_A"] * m * p["TA"] + t_b * p["SPLIT_B"] * m * p["TB"] + nh * (r // p["BC"]) * m * v,
            t_a + t_b + nh)


def _workspace(device, part: int, tickets: int):
    """(fp32 partials, int32 tickets, int32 barrier counters [2]) of ``device``; tickets and counters zero."""
    return grown_workspace(_WS, device, (part, tickets, 2), lambda n: (
        torch.empty(n[0], dtype=torch.float32, device=device), torch.zeros(n[1], dtype=torch.int32, device=device),
        torch.zeros(2, dtype=torch.int32, device=device)), "mla_block")


def mla_block_reference(x, qkv_a, q_a_norm, q_b, kv_a_norm, w_uk, w_uv, o_proj, kv_cache, page_table, prefix_lens,
                        positions, tree_mask=None, *, eps, rope_theta, sm_scale):
    """The op chain :func:`mla_block` replaces, on the plain-torch references (the verify forward's ``_mla`` with
    the reference op table; attention in fp32). Writes the draft tokens' KV into ``kv_cache``; returns [B, KQ, H]."""
    b, kq, _ = x.shape
    nh, nope, _ = w_uk.shape
    q_lora = q_a_norm.shape[0]
    qkv = x @ qkv_a.t()
    q = rmsnorm_reference(qkv[..., :q_lora], q_a_norm, eps) @ q_b.t()
    q = q.view(b, kq, nh, -1).clone()
    mla_kv_prep_reference(q, qkv[..., q_lora:], positions, kv_a_norm, kv_cache, page_table, prefix_lens, eps,
                          rope_theta, nope)
    q_latent = mla_absorb_q_reference(q, w_uk, nope)
    o_latent = tree_attention_mla_reference(q_latent, q[..., nope:], kv_cache, page_table, prefix_lens, tree_mask,
                                            sm_scale, compute_dtype=torch.float32)
    return mla_up_v_reference(o_latent, w_uv) @ o_proj.t()


def _check(op, x, weights, kv_cache, page_table, prefix_lens, positions, tree_mask):
    for name, t in (("x", x), *weights.items(), ("kv_cache", kv_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{op}: x must be bfloat16 or float16, got {x.dtype}; cast it with .bfloat16()")
    for name, t in (*weights.items(), ("kv_cache", kv_cache)):
        if t.dtype != x.dtype:
            raise TypeError(f"{op}: {name} must have x's dtype {x.dtype}, got {t.dtype}; cast it with "
                            f".to({x.dtype})")
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device}, x on {x.device}; move them to one device")
    if x.device.type != "cuda" and not envvars.triton_interpret():
        raise ValueError(f"{op}: needs CUDA tensors, got {x.device}; on a CPU set TRITON_INTERPRET=1 before "
                         "importing specverify to run the kernel in Triton's interpreter")
    if x.dim() != 3:
        raise ValueError(f"{op}: x must be (batch, draft tokens, hidden), got {list(x.shape)}")
    b, kq, h = x.shape
    w = weights
    for name, dims in (("qkv_a", 2), ("q_a_norm", 1), ("q_b", 2), ("kv_a_norm", 1), ("w_uk", 3), ("w_uv", 3),
                       ("o_proj", 2)):
        if w[name].dim() != dims:
            raise ValueError(f"{op}: {name} must have {dims} dimensions, got shape {list(w[name].shape)}")
    nh, nope, r = w["w_uk"].shape
    q = w["q_a_norm"].shape[0]
    v = w["w_uv"].shape[2]
    qd = w["q_b"].shape[0] // nh if nh else 0
    dr = qd - nope
    expect = {"qkv_a": (q + r + dr, h), "q_b": (nh * qd, q), "kv_a_norm": (r,), "w_uv": (nh, r, v),
              "o_proj": (h, nh * v)}
    for name, shape in expect.items():
        if tuple(w[name].shape) != shape or w["q_b"].shape[0] != nh * qd:
            raise ValueError(f"{op}: shapes disagree: {name} is {list(w[name].shape)}, expected {list(shape)} (from "
                             f"x {list(x.shape)}, q_a_norm ({q},), w_uk ({nh}, NOPE {nope}, R {r}), w_uv V {v}, "
                             f"q_b rows = heads x (NOPE + rope dim))")
    for name, val, low in (("kv_lora_rank R", r, 16), ("rope dim", dr, 2), ("nope dim", nope, 16),
                           ("V head dim", v, 16)):
        if val < low or val & (val - 1):
            raise ValueError(f"{op}: the {name} must be a power of two >= {low}, got {val}")
    if not 1 <= b * kq <= _KERNEL_MAX_M:
        raise ValueError(f"{op}: batch x draft tokens must be in 1..{_KERNEL_MAX_M}, got {b} x {kq}; above, use the "
                         "op chain (gemv.linear, fused_ops.mla_prep_absorb, tree_attention_mla, mla_up_v)")
    if kq * nh > 32:
        raise ValueError(f"{op}: draft tokens x heads must be at most 32, got {kq} x {nh}")
    if x.stride(2) != 1:
        raise ValueError(f"{op}: x needs a unit stride in its last dimension, got {tuple(x.stride())}; pass "
                         "x.contiguous()")
    for name, t in weights.items():
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous, got strides {tuple(t.stride())}; pass "
                             f"{name}.contiguous() once (the weight is constant)")
    if kv_cache.dim() != 3 or kv_cache.shape[2] != r + dr or kv_cache.stride(2) != 1:
        raise ValueError(f"{op}: kv_cache must be (pages, page size, {r + dr}) with a unit last stride, got "
                         f"{list(kv_cache.shape)} strides {tuple(kv_cache.stride())}")
    check_int_tensor(op, "page_table", page_table, (b, None))
    check_int_tensor(op, "positions", positions, (b, kq))
    check_int_tensor(op, "prefix_lens", prefix_lens, (b,))
    if tree_mask is not None:
        nbytes = (kq + 7) // 8
        if not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype != torch.uint8:
            raise TypeError(f"{op}: tree_mask must be uint8 [{kq}, {nbytes}] or [{b}, {kq}, {nbytes}], got "
                            f"{getattr(tree_mask, 'dtype', type(tree_mask).__name__)}")
        if tuple(tree_mask.shape) not in ((kq, nbytes), (b, kq, nbytes)) or tree_mask.stride(-1) != 1:
            raise ValueError(f"{op}: tree_mask must be uint8 [{kq}, {nbytes}] or [{b}, {kq}, {nbytes}] with a unit "
                             f"last stride, got {list(tree_mask.shape)}")
    for name, t in (("page_table", page_table), ("prefix_lens", prefix_lens), ("positions", positions),
                    ("tree_mask", tree_mask)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device}, x on {x.device}; move them to one device")
    return b, kq, h, q, r, dr, nope, nh, v


def mla_block(x: torch.Tensor, qkv_a: torch.Tensor, q_a_norm: torch.Tensor, q_b: torch.Tensor,
              kv_a_norm: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, o_proj: torch.Tensor,
              kv_cache: torch.Tensor, page_table: torch.Tensor, prefix_lens: torch.Tensor, positions: torch.Tensor,
              tree_mask: torch.Tensor | None = None, *, eps: float, rope_theta: float, sm_scale: float,
              validate: bool = True) -> torch.Tensor:
    """The attention half of an absorbed-MLA verify layer (DeepSeek-V3 / Kimi-K2) in one persistent launch.

    Math (:func:`mla_block_reference` is the definition): ``qkv = x @ qkv_a^T``; ``q = rmsnorm(qkv[:Q]) @ q_b^T``
    per head (NOPE + rope columns); the latent's RMSNorm and the rotate-half RoPE key written into ``kv_cache`` at
    ``prefix_lens[b] + node``; ``q_latent = q_nope @ w_uk``, ``q_pe = rope(q_rope)`` at ``positions``; tree
    attention over the prefix and the draft tokens the tree mask shows (score ``sm_scale * (q_latent . c + q_pe .
    k_pe)``, value ``c``); ``out = (o_latent @ w_uv) @ o_proj^T``. fp32 accumulation, rounded to x's dtype where
    the op chain rounds (qkv, the normed q_a, q, q_latent, the attention output, v, out). Source: DeepSeek-V2's
    MLA with weight absorption; one persistent grid with grid barriers instead of eight launches.

    Parameters
    ----------
    x : torch.Tensor
        (B, KQ, H) normalised hidden states of B requests of KQ draft tokens, bf16 or fp16, unit last stride;
        1 <= B * KQ <= 16 (the verify forward uses it up to :data:`MLA_BLOCK_MAX_M`), KQ * heads <= 32.
    qkv_a : (Q + R + DR, H); q_a_norm : (Q,); q_b : (NH * (NOPE + DR), Q); kv_a_norm : (R,);
    w_uk : (NH, NOPE, R); w_uv : (NH, R, V); o_proj : (H, NH * V)
        The rank's weights in x's dtype, contiguous (the verify forward's layout). R, NOPE, V: powers of two
        >= 16; DR a power of two >= 2 (:func:`mla_block_fits`).
    kv_cache : torch.Tensor
        (pages, page size, R + DR), x's dtype, unit last stride; the draft tokens' rows are written.
    page_table : int32/int64 (B, max_pages); prefix_lens : int32/int64 (B,); positions : int32/int64 (B, KQ)
        Page ids, tokens before the draft tokens, and each node's RoPE position (prefix + depth).
    tree_mask : uint8 (KQ, ceil(KQ / 8)) or (B, KQ, ceil(KQ / 8)), optional
        Bit-packed ancestor mask (:meth:`specverify.DraftTree.packed_mask`); None: a chain.
    eps, rope_theta, sm_scale : float
        The norms' epsilon, RoPE base, and the attention scale (1 / sqrt(NOPE + DR) for DeepSeek-V3).
    validate : bool
        Value checks of the page table and mask (a host sync; skipped under CUDA-graph capture). The verify forward
        checks once per pass and passes False.

    Returns
    -------
    torch.Tensor
        (B, KQ, H) in x's dtype, a new tensor.

    Raises
    ------
    TypeError
        Non-tensor operands, x not bf16 / fp16, weights or cache of another dtype, non-integer page table, prefix
        lengths or positions, a mask that is not uint8.
    ValueError
        Shapes that disagree, B * KQ outside 1..16, KQ * heads above 32, head dims :func:`mla_block_fits` refuses,
        non-contiguous weights, tensors on different devices, CPU tensors without ``TRITON_INTERPRET=1``; with
        ``validate``, page ids outside the cache, requests longer than their page-table rows, or a mask that is not
        a tree's.
    RuntimeError
        A call that must grow the per-device workspace during CUDA-graph capture; no launch config lets the grid be
        resident.

    Notes
    -----
    Graph-safe after one eager call (the workspace is then sized for every token count up to
    :data:`MLA_BLOCK_MAX_M`): fixed grid, self-resetting tickets and barrier counters, no host sync without
    validation. The attention splits are sized from the page table's capacity, not the prefix lengths, so a graph
    replays for any lengths the page table holds. As :func:`specverify.moe_block`: every program must be resident
    at once, so one call at a time per device and not beside work that holds SMs for its whole run (nor under MPS or
    green contexts with fewer SMs). CUDA (sm_80+; PDL on sm_90+) or the Triton interpreter (six launches, one a
    phase).
    """
    op = "mla_block"
    weights = {"qkv_a": qkv_a, "q_a_norm": q_a_norm, "q_b": q_b, "kv_a_norm": kv_a_norm, "w_uk": w_uk,
               "w_uv": w_uv, "o_proj": o_proj}
    b, kq, h, q, r, dr, nope, nh, v = _check(op, x, weights, kv_cache, page_table, prefix_lens, positions, tree_mask)
    if validate:
        check_paged_kv(op, page_table, prefix_lens, kq, kv_cache.shape[0], kv_cache.shape[1])
    if validate and tree_mask is not None and not capturing():
        check_tree_mask(op, tree_mask, kq)
    return _launch(x, weights, kv_cache, page_table, prefix_lens, positions, tree_mask, eps, rope_theta, sm_scale,
                   (b, kq, h, q, r, dr, nope, nh, v))[0]


def _launch(x, weights, kv_cache, page_table, prefix_lens, positions, tree_mask, eps, rope_theta, sm_scale, dims):
    """Launch the kernel on checked arguments: (out [B, KQ, H], the intermediates {qkv, qb, q_latent, q_pe, v})."""
    from specverify.kernels.mla_block import _mla_block_kernel

    b, kq, h, q, r, dr, nope, nh, v = dims
    m = b * kq
    page = kv_cache.shape[1]
    qkv_a, q_a_norm, q_b, kv_a_norm, w_uk, w_uv, o_proj = (weights[n] for n in
                                                           ("qkv_a", "q_a_norm", "q_b", "kv_a_norm", "w_uk", "w_uv",
                                                            "o_proj"))
    dev = x.device
    xf = x.reshape(m, h)
    na, nb = q + r + dr, nh * (nope + dr)
    qkv = torch.empty((m, na), dtype=x.dtype, device=dev)
    qb = torch.empty((m, nb), dtype=x.dtype, device=dev)
    ql = torch.empty((m, nh, r), dtype=x.dtype, device=dev)
    qr = torch.empty((m, nh, dr), dtype=x.dtype, device=dev)
    vo = torch.empty((m, nh * v), dtype=x.dtype, device=dev)
    out = torch.empty((m, h), dtype=x.dtype, device=dev)
    pos = positions.reshape(m).to(torch.int64)
    interp = dev.type != "cuda" or envvars.triton_interpret()
    pdl = pdl_launch(dev)
    capacity = page_table.shape[1] * page
    shape = (m, kq, h, q, r, dr, nope, nh, v, capacity)
    sms = sm_count(dev.type, dev.index)
    # the partials and tickets for every token count and either grid size (a few hundred KB), so a graph captured
    # after the first eager call allocates nothing; the split outputs are this call's
    sizes = [_part_size((mm, 1) + shape[2:], _plan((mm, 1) + shape[2:], sms * p)) for p in (1, 2)
             for mm in range(1, _KERNEL_MAX_M + 1)]
    part, ticket, bar = _workspace(dev, max(s[0] for s in sizes), max(s[1] for s in sizes))
    nsplit = max(_plan(shape, sms * p)["NSPLIT"] for p in (1, 2))
    ws_o = torch.empty(b * nsplit * kq * nh * r, dtype=torch.float32, device=dev)
    ws_lse = torch.empty(b * nsplit * kq * nh, dtype=torch.float32, device=dev)
    if tree_mask is None:
        mask, smb, smt = prefix_lens, 0, 0
    else:
        mask = tree_mask
        smb, smt = (0, tree_mask.stride(0)) if tree_mask.dim() == 2 else (tree_mask.stride(0), tree_mask.stride(1))
    consts = dict(MT=m, KQ=kq, H=h, Q=q, QP=_next_pow2(q), R=r, DR=dr, DRP=max(16, dr), NOPE=nope, NH=nh, V=v, PAGE=page,
                  HAS_MASK=tree_mask is not None, PREFETCH=not interp, DOT_FP32=interp, PDL=pdl)

    def args_of():
        return (xf, qkv_a, q_a_norm, q_b, kv_a_norm, w_uk, w_uv, o_proj, kv_cache, page_table, prefix_lens, pos,
                mask, qkv, qb, ql, qr, vo, ws_o, ws_lse, part, ticket, bar, out, xf.stride(0), out.stride(0),
                kv_cache.stride(0), kv_cache.stride(1), page_table.stride(0), smb, smt, float(eps),
                math.log2(rope_theta), float(sm_scale) * 1.4426950408889634)

    base = dict(consts, **({"launch_pdl": True} if pdl else {}))
    key = (shape, x.dtype, tree_mask is not None, pdl, repr(sorted(_TUNE.items())))
    cfg = dict(base, **persistent_grid(_mla_block_kernel, args_of(), dict(base, PHASE=0), dev, sms, key, _CANDIDATES,
                                       functools.partial(_plan_consts, shape), _CHOSEN, "mla_block"))
    if _TUNE:  # a bench sweep's launch: its grid, stages, warps or prefetch point instead of the chosen ones
        cand = (_TUNE.get("STAGES", cfg["STAGES"]), _TUNE.get("num_warps", cfg["num_warps"]))
        cfg = dict(base, **_plan_consts(shape, _TUNE.get("NPROG", cfg["NPROG"]), cand))
        cfg.update({k: val for k, val in _TUNE.items() if k in ("PF_O", "PREFETCH")})
        cfg.pop("PHASES", None)
    nprog = cfg["NPROG"]
    if interp or "PHASES" in _TUNE:  # programs run one after another (the interpreter), or a bench timing phases
        for phase in _TUNE.get("PHASES", range(1, 7)):  # alone: phases as launches of their own, no grid barrier
            _mla_block_kernel[(nprog,)](*args_of(), PHASE=phase, **cfg)
    else:
        _mla_block_kernel[(nprog,)](*args_of(), PHASE=0, **cfg)
    return out.view(b, kq, h), {"qkv": qkv, "qb": qb, "q_latent": ql, "q_pe": qr, "v": vo}
