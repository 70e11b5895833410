"""The op tables of the verify forward, one per provider.

:class:`Ops` is the table :class:`specverify.forward.model.VerifyModel` runs every op through; its defaults are the
plain-torch references of :mod:`specverify.reference` (the ``reference`` provider). :func:`specverify_ops` puts our
kernels in piece by piece; a piece whose kernel is missing or fails its import stays on the reference and the
table's ``pieces`` says so. :func:`sglang_ops` composes SGLang's own Triton kernels (wrapped with specverify's
semantics in :mod:`specverify.peers.sglang`) the way SGLang's Triton attention backend and MoE layer call them.
:func:`provider_ops` picks a table by provider name (what ``specverify bench verify-wall --impl`` takes).

Slot signatures (``b`` requests of ``k`` nodes, ``M = b * k`` tokens); the defaults' docstrings give dtypes

===================  ===========================================================================================
slot                 arguments -> result
===================  ===========================================================================================
attention_mla        q_latent [b, k, h, R], q_rope [b, k, h, Dr] (a strided view), cache, page_table, prefix_lens,
                     tree_mask, sm_scale -> o_latent [b, k, h, R]
attention_gqa        q [b, k, hq, D], k_cache, v_cache, page_table, prefix_lens, tree_mask, sm_scale
                     -> [b, k, hq, D]
route                logits [M, E], :class:`RouteParams` -> (ids [M, top_k], weights [M, top_k])
experts              hidden [M, H], w13 [E, 2I, H], w2 [E, H, I], ids, weights, quant=None -> [M, H]; with
                     quantised weights ``quant`` is their :class:`specverify.moe.MoEQuant` (tables that cannot run
                     them refuse the model at build time)
experts_with_shared  as ``experts`` over ``[E + 1, ...]`` weights whose expert E is the shared one; None: the
                     shared expert runs as a separate MLP
experts_plus_shared  hidden, w13, w2, ids, weights, quant, shared_w13 [2I, H], shared_w2 [H, I] -> [M, H]:
                     quantised routed experts plus an unquantised shared expert (weight 1, hidden's dtype) in the
                     experts' own launches (a fusion; None: the shared expert runs as a separate MLP after them)
route_shared         logits [M, E], :class:`RouteParams`, shared_id -> (ids [M, top_k + 1], weights [M, top_k + 1]):
                     ``route`` with the shared expert's slot (shared_id, weight 1) written by the router; with
                     ``experts_with_shared`` set, the forward then runs ``experts`` over the ``[E + 1, ...]`` weights
                     (one launch less); None: ``route`` then ``experts_with_shared``
accept_greedy        target_ids, draft_tokens, parents, max_depth -> (accepted_nodes, accept_len, accepted_tokens)
compact_kv           caches, page_table, prefix_lens, accepted_nodes, accept_len (in place)
rmsnorm              x, weight, eps -> normed
add_rmsnorm          x, residual, weight, eps -> (normed, x + residual)
mla_prep             q, kv, positions, norm_w, cache, page_table, prefix_lens, eps, theta, nope: latent norm, RoPE
                     and the KV write, in place
gqa_prep             q, k, v, positions, q_norm, k_norm, k_cache, v_cache, page_table, prefix_lens, eps, theta:
                     q/k norm, RoPE and the KV write, in place
silu_mul             gate_up [M, 2I] -> [M, I]
mla_absorb_q         q, w_uk, nope -> q_latent [b, k, h, R]
mla_up_v             o_latent, w_uv -> [b, k, h * V]
linear               x [..., K], w [N, K] -> x @ w.T
linear_sumsq         x [..., K], w [N, K], cols -> (x @ w.T, partials fp32 [P, M]) with ``partials.sum(0)`` each
                     token's sum of squares of its first ``cols`` outputs as stored, or None where the projection
                     has no such epilogue at this shape (nothing launched); with ``mla_prep_absorb`` set, the forward
                     folds q_a's RMSNorm away through it (:data:`specverify.forward.model.FOLD_Q_NORM`); None: never
mla_prep_absorb      q, kv, positions, norm_w, w_uk, cache, page_table, prefix_lens, eps, theta, nope
                     [, q_sumsq=, q_dim=] -> q_latent: mla_prep then mla_absorb_q in one launch; with the keywords
                     (only when ``linear_sumsq`` is set) q is q_b's output over ``q_b_folded`` and q_a's RMSNorm
                     scale is applied to q_latent and q's rope part (:func:`specverify.fused_ops.mla_prep_absorb`);
                     None: the two slots
moe_block            hidden [M, H], router [E, H], :class:`RouteParams`, w13_all [E + 1, 2I, H], w2_all
                     [E + 1, H, I] -> [M, H]: the router GEMV, routing and the routed + shared experts in one launch,
                     run up to ``moe_block_max_m`` tokens (a fusion; None: the forward composes linear,
                     route_shared and experts)
write_kv             :func:`specverify.reference.kv.write_draft_kv` (not called by the forward: the prep ops write)
===================  ===========================================================================================
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from specverify.peers import sglang as sglang_peer
from specverify.reference.accept import greedy_accept_reference
from specverify.reference.attention import tree_attention_mla_reference, tree_attention_reference
from specverify.reference.fused_ops import (add_rmsnorm_reference, gqa_prep_reference, mla_absorb_q_reference,
                                            mla_kv_prep_reference, mla_up_v_reference, rmsnorm_reference,
                                            silu_mul_reference)
from specverify.reference.kv import compact_kv_reference, write_draft_kv
from specverify.reference.moe import fused_moe_reference, route_reference

#: Provider names, in the order ``verify-wall`` runs them by default.
PROVIDERS = ("reference", "specverify", "sglang", "sglang-flashinfer")


# ------------------------------------------------------------------------------------------------------------
# the table and its reference defaults


def _torch_dtype(t: torch.Tensor):
    """Attention accumulation of the torch path: fp32 on a GPU (what a plain torch verify pass computes in, the
    timing baseline), the batch-invariant fp64 definition elsewhere (CPU exactness tests)."""
    return torch.float32 if t.device.type == "cuda" else None


def _matmul(x, w):
    return x @ w.t()


def _torch_attention_mla(q_latent, q_rope, kv_cache, page_table, prefix_lens, tree_mask, sm_scale, **kw):
    kw.setdefault("compute_dtype", _torch_dtype(q_latent))
    return tree_attention_mla_reference(q_latent, q_rope, kv_cache, page_table, prefix_lens, tree_mask, sm_scale,
                                        **kw)


def _torch_attention_gqa(q, k_cache, v_cache, page_table, prefix_lens, tree_mask, sm_scale, **kw):
    kw.setdefault("compute_dtype", _torch_dtype(q))
    return tree_attention_reference(q, k_cache, v_cache, page_table, prefix_lens, tree_mask, sm_scale, **kw)


@dataclass
class Ops:
    """The op table a model runs through. ``pieces`` names, per component, which implementation is used."""

    attention_mla: Callable = _torch_attention_mla
    attention_gqa: Callable = _torch_attention_gqa
    write_kv: Callable = write_draft_kv
    route: Callable = None  # (logits, config) -> (ids, weights)
    experts: Callable = fused_moe_reference  # (hidden, w13, w2, ids, weights, quant=None): quant a MoEQuant
    accept_greedy: Callable = greedy_accept_reference
    compact_kv: Callable = compact_kv_reference
    rmsnorm: Callable = rmsnorm_reference
    add_rmsnorm: Callable = add_rmsnorm_reference  # (x, residual, weight, eps) -> (normed, x + residual)
    mla_prep: Callable = None  # (q, kv, positions, norm_w, cache, page_table, prefix_lens, eps, theta, nope)
    gqa_prep: Callable = None  # (q, k, v, positions, q_norm, k_norm, k_cache, v_cache, pt, prefix, eps, theta)
    silu_mul: Callable = silu_mul_reference
    # (hidden, w13_all, w2_all, ids, weights, quant=None): expert E is the shared one
    experts_with_shared: Callable = None
    # a fusion; None: the forward runs the unquantised shared expert of quantised layers as a separate MLP
    experts_plus_shared: Callable = None  # (hidden, w13, w2, ids, weights, quant, shared_w13, shared_w2)
    # a fusion; None: the forward composes route and experts_with_shared
    route_shared: Callable = None  # (logits, config, shared_id) -> (ids, weights) [M, top_k + 1]
    mla_absorb_q: Callable = mla_absorb_q_reference  # (q, w_uk, nope) -> q_latent [b, k, h, R]
    mla_up_v: Callable = mla_up_v_reference  # (o_latent, w_uv) -> [b, k, h * V]
    linear: Callable = None  # (x [..., K], w [N, K]) -> x @ w.T: the projections that may leave cuBLAS
    # a fusion (q_a's RMSNorm folded away, with mla_prep_absorb's q_sumsq); None: the forward runs the norm
    linear_sumsq: Callable = None  # (x, w, cols) -> (x @ w.T, partials fp32 [P, M]) or None (not served here)
    # a fusion; None: the forward composes mla_prep and mla_absorb_q. (q, kv, positions, norm_w, w_uk, cache, pt,
    # prefix, eps, theta, nope, q_sumsq=None, q_dim=None) -> q_latent; the keywords only with linear_sumsq set
    mla_prep_absorb: Callable = None
    # a fusion; None (or above moe_block_max_m tokens): the forward composes linear, route_shared and experts
    moe_block: Callable = None  # (hidden, router, RouteParams, w13_all, w2_all) -> [M, H]
    moe_block_max_m: int = 0
    pieces: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.route is None:
            self.route = _route_with_config
        if self.mla_prep is None:
            self.mla_prep = mla_kv_prep_reference
        if self.gqa_prep is None:
            self.gqa_prep = gqa_prep_reference
        if self.linear is None:
            self.linear = _matmul
        for name in ("attention", "moe_route", "experts", "acceptance", "kv_compaction", "allreduce",
                     "small_ops"):
            self.pieces.setdefault(name, "reference")


def _route_with_config(logits, cfg):
    return route_reference(
        logits, cfg.num_experts_per_tok, scoring=cfg.scoring_func, correction_bias=cfg.correction_bias,
        n_group=cfg.n_group, topk_group=cfg.topk_group, renormalize=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor)


@dataclass
class RouteParams:
    """What the routing op needs from the config, plus the layer's correction bias tensor."""

    num_experts_per_tok: int
    scoring_func: str
    correction_bias: torch.Tensor | None
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    n_routed_experts: int


# ------------------------------------------------------------------------------------------------------------
# specverify


def _try(module: str, *names: str):
    try:
        mod = importlib.import_module(module)
        return [getattr(mod, n) for n in names], None
    except Exception as exc:  # a missing piece falls back to the reference, and the table says why
        return None, f"{module}: {type(exc).__name__}: {exc}"


def specverify_ops(model):
    """(Ops, note) with every available specverify kernel swapped in.

    ``model`` is not read (every table takes it, see :func:`provider_ops`). A kernel module that does not import
    leaves its pieces on the reference; ``note`` then names the module and the error.
    """
    ops = Ops()
    missing = []
    fns, why = _try("specverify.attention", "tree_attention", "tree_attention_mla")
    if fns:
        tree_attention, tree_attention_mla = fns

        def attention_mla(q_latent, q_rope, cache, page_table, prefix_lens, tree_mask, sm_scale):
            return tree_attention_mla(q_latent, q_rope, cache, page_table=page_table, prefix_lens=prefix_lens,
                                      tree_mask=tree_mask, sm_scale=sm_scale, impl="triton")

        def attention_gqa(q, k_cache, v_cache, page_table, prefix_lens, tree_mask, sm_scale):
            return tree_attention(q, k_cache, v_cache, page_table=page_table, prefix_lens=prefix_lens,
                                  tree_mask=tree_mask, sm_scale=sm_scale, impl="triton")

        ops.attention_mla, ops.attention_gqa = attention_mla, attention_gqa
        ops.pieces["attention"] = "triton"
    else:
        missing.append(why)
    fns, why = _try("specverify.moe", "moe_route", "fused_moe", "append_shared_expert")
    if fns:
        moe_route, fused_moe, append_shared_expert = fns

        def route_shared(logits, p, shared_id):
            # with shared_id the router writes the shared expert's slot itself: no append launch before the experts
            return moe_route(logits, top_k=p.num_experts_per_tok, scoring=p.scoring_func,
                             correction_bias=p.correction_bias, n_group=p.n_group, topk_group=p.topk_group,
                             renormalize=p.norm_topk_prob, routed_scaling_factor=p.routed_scaling_factor,
                             shared_expert_id=shared_id, impl="triton")

        def route(logits, p):
            return route_shared(logits, p, None)

        def experts(hidden, w13, w2, ids, weights, quant=None):
            return fused_moe(hidden, w13, w2, ids, weights, quant=quant, impl="triton")

        def experts_with_shared(hidden, w13_all, w2_all, ids, weights, quant=None):
            # the shared expert is expert E of the stacked weights, chosen by every token with weight 1
            ids, weights = append_shared_expert(ids, weights, w13_all.shape[0] - 1, impl="triton")
            return fused_moe(hidden, w13_all, w2_all, ids, weights, quant=quant, impl="triton")

        def experts_plus_shared(hidden, w13, w2, ids, weights, quant, shared_w13, shared_w2):
            # the unquantised shared expert inside the quantised experts' launches (int4 quads; else beside them)
            return fused_moe(hidden, w13, w2, ids, weights, quant=quant, shared_expert=(shared_w13, shared_w2),
                             impl="triton")

        ops.route, ops.experts, ops.experts_with_shared = route, experts, experts_with_shared
        ops.route_shared, ops.experts_plus_shared = route_shared, experts_plus_shared
        ops.pieces["shared_expert"] = "triton (fused into the expert pass)"
        ops.pieces["moe_route"] = "triton"
        ops.pieces["experts"] = "triton"
    else:
        missing.append(why)
    fns, why = _try("specverify.moe_layer", "moe_block", "MOE_BLOCK_MAX_M")
    if fns:
        moe_block, max_m = fns

        def moe_block_op(hidden, router, p, w13_all, w2_all):
            return moe_block(hidden, router, w13_all, w2_all, top_k=p.num_experts_per_tok, scoring=p.scoring_func,
                             correction_bias=p.correction_bias, n_group=p.n_group, topk_group=p.topk_group,
                             renormalize=p.norm_topk_prob, routed_scaling_factor=p.routed_scaling_factor).out

        ops.moe_block, ops.moe_block_max_m = moe_block_op, max_m
        ops.pieces["moe_block"] = "triton (one persistent launch at a few tokens)"
    else:
        missing.append(why)
    fns, why = _try("specverify.accept", "verify_greedy")
    if fns:
        (verify_greedy,) = fns

        def accept(target_ids, draft_tokens, parents, max_depth):
            # the Ops slot returns (accepted_nodes, accept_len, accepted_tokens), as greedy_accept_reference does;
            # verify_greedy returns the tokens first
            tokens, accept_len, nodes = verify_greedy(draft_tokens, parents, target_ids=target_ids, impl="triton")
            return nodes, accept_len, tokens

        ops.accept_greedy = accept
        ops.pieces["acceptance"] = "triton"
    else:
        missing.append(why)
    fns, why = _try("specverify.kv_cache", "compact_kv")
    if fns:
        (compact_kv,) = fns

        def compact(caches, page_table, prefix_lens, nodes, acc):
            return compact_kv(caches, page_table, prefix_lens, nodes, acc, impl="triton")

        ops.compact_kv = compact
        ops.pieces["kv_compaction"] = "triton"
    else:
        missing.append(why)
    fns, why = _try("specverify.fused_ops", "rmsnorm", "mla_kv_prep", "gqa_prep", "silu_mul", "mla_absorb_q",
                    "mla_up_v", "mla_prep_absorb")
    if fns:
        rmsnorm, mla_kv_prep, gqa_prep, silu_mul, mla_absorb_q, mla_up_v, mla_prep_absorb = fns
        ops.rmsnorm = lambda x, w, eps: rmsnorm(x, w, eps, impl="triton")
        ops.add_rmsnorm = lambda x, r, w, eps: rmsnorm(x, w, eps, residual=r, impl="triton")

        def mla_prep(q, kv, positions, norm_w, cache, page_table, prefix_lens, eps, theta, nope):
            return mla_kv_prep(q, kv, positions, norm_w, cache, page_table, prefix_lens, eps=eps, theta=theta,
                               nope_dim=nope, impl="triton")

        def gqa(q, k, v, positions, qn, kn, kc, vc, page_table, prefix_lens, eps, theta):
            return gqa_prep(q, k, v, positions, qn, kn, kc, vc, page_table, prefix_lens, eps=eps, theta=theta,
                            impl="triton")

        def prep_absorb(q, kv, positions, norm_w, w_uk, cache, page_table, prefix_lens, eps, theta, nope,
                        q_sumsq=None, q_dim=None):
            return mla_prep_absorb(q, kv, positions, norm_w, w_uk, cache, page_table, prefix_lens, eps=eps,
                                   theta=theta, nope_dim=nope, q_sumsq=q_sumsq, q_dim=q_dim, impl="triton")

        ops.mla_prep, ops.gqa_prep, ops.mla_prep_absorb = mla_prep, gqa, prep_absorb
        ops.silu_mul = lambda gu: silu_mul(gu, impl="triton")
        ops.mla_absorb_q = lambda q, w_uk, nope: mla_absorb_q(q, w_uk, nope, impl="triton")
        ops.mla_up_v = lambda o_latent, w_uv: mla_up_v(o_latent, w_uv, impl="triton")
        ops.pieces["small_ops"] = "triton"
    else:
        missing.append(why)
    fns, why = _try("specverify.gemv", "linear", "linear_sumsq")
    if fns:
        ops.linear, ops.linear_sumsq = fns
        ops.pieces["projections"] = "triton gemv where faster, else cuBLAS"
    else:
        missing.append(why)
    note = ("reference used for: " + "; ".join(missing)) if missing else ""
    return ops, note


# ------------------------------------------------------------------------------------------------------------
# sglang


def sglang_ops(model, attention: str = "triton"):
    """An :class:`Ops` table running what SGLang runs for each mode (see :mod:`specverify.peers.sglang`).

    Parameters
    ----------
    model : specverify.forward.model.VerifyModel
        Read for its config (whether it has routed experts: then SGLang's router, alignment and fused MoE are
        pieces of its pass).
    attention : {"triton", "flashinfer"}
        SGLang's attention backend: ``triton`` (its default on sm_120, and the kernels below) or ``flashinfer``
        (its ``flashinfer`` MLA backend, an sm_90 choice: FlashInfer's ``BatchMLAPagedAttentionWrapper`` for
        decode and chain verify, see :mod:`specverify.peers.flashinfer`; MLA models only, trees refused).

    Returns
    -------
    ops : Ops
        ``attention_mla`` / ``attention_gqa`` (SGLang's decode kernel at k = 1, its extend kernel with the full custom
        mask for k > 1; metadata, split counts and the mask refreshed inside every forward; with ``attention=
        "flashinfer"`` FlashInfer's MLA wrapper, planned on the host in eager forwards, so a graph replay is valid
        only for the last eager forward's page table and lengths), ``route`` (SGLang's
        router), ``experts`` (SGLang's alignment and fused-MoE kernels). Acceptance, KV compaction and the small ops
        stay specverify's reference by design (SGLang runs CUDA / ``sgl_kernel`` ops there, which cannot be
        installed beside the GPU machine's torch); ``note`` names them. ``ops.pieces`` names the SGLang pieces, and
        ``ops.pieces["incomplete"]`` is set (``"<piece>: <why>; ..."``) when a piece SGLang runs for this model
        cannot be had here: the reference then stands in, so the pass is not SGLang's and no total may be quoted
        for it (``specverify bench verify-wall`` skips such a provider and says why).
    note : str
        What is SGLang's, what was substituted, what stays on the reference by design, and what is missing.

    Raises
    ------
    RuntimeError
        When SGLang's attention kernel cannot be imported (the reason is in the message).
    ValueError
        A model with quantised experts (``experts_quant``): this table runs SGLang's unquantised fused MoE.
    """
    if getattr(model, "experts_quant", None) is not None:
        raise ValueError(f"sglang_ops runs SGLang's unquantised fused MoE, but the model's experts are "
                         f"{model.experts_quant}; build the model with experts_quant=None for the SGLang provider")
    ok, why = sglang_peer.available()
    if not ok:
        raise RuntimeError(why)
    if attention not in ("triton", "flashinfer"):
        raise ValueError(f"sglang_ops: attention must be 'triton' or 'flashinfer', got {attention!r}")
    mods, why = sglang_peer.pieces()
    ops = Ops()
    used, ref, subs, missing = [], [], [], []
    cfg = model.config
    if attention == "flashinfer":
        _flashinfer_attention(ops, cfg, used, subs, missing)
    else:
        attn = sglang_peer.VerifyAttention()
        ops.attention_mla, ops.attention_gqa = attn.mla, attn.gqa
        ops.pieces["attention"] = "sglang"
        used.append("attention: decode_attention_fwd at k = 1 (split-KV decode; kv indices and num_kv_splits from "
                    "get_num_kv_splits_triton refreshed once per forward, persistent attn_logits / attn_lse) and "
                    "extend_attention_fwd for k > 1 (TARGET_VERIFY with the full [k, prefix + k] custom mask, chains "
                    "included; once per forward the whole mask buffer is memset and the draft cells rewritten, as "
                    "build_tree_kernel_efficient does every step)")
        subs.append("attention inputs: draft K/V rows gathered from the cache per layer (SGLang passes the "
                    "projected K/V); the mask's draft cells written by a torch scatter (SGLang: its build-tree "
                    "kernel); the mask buffer spans this batch and page table, SGLang's its captured batch and the "
                    "model's context")
        if mods.get("decode") is None:
            missing.append(f"decode attention (k = 1): {why.get('decode')}")
    moe = bool(getattr(cfg, "n_routed_experts", 0))
    if mods.get("router") is not None:
        def route(logits, p):
            return sglang_peer.route(logits, p.correction_bias, top_k=p.num_experts_per_tok, scoring=p.scoring_func,
                                     n_group=p.n_group, topk_group=p.topk_group, renormalize=p.norm_topk_prob,
                                     routed_scaling_factor=p.routed_scaling_factor)

        ops.route = route
        ops.pieces["moe_route"] = "sglang"
        used.append("routing: moe_fused_gate")
    elif moe:
        missing.append(f"routing (moe_fused_gate): {why.get('router')}")
    if mods.get("experts") is not None and mods.get("align") is not None:
        fused_experts = sglang_peer.fused_experts
        ops.experts = lambda hidden, w13, w2, ids, weights: fused_experts(hidden, w13, w2, weights, ids)
        ops.pieces["experts"] = "sglang"
        used.append("experts: SGLang alignment + invoke_fused_moe_kernel x2 + act_and_mul_triton + combine")
        subs.append("activation: SGLang's act_and_mul_triton instead of its JIT-CUDA silu_and_mul "
                    "(sglang.kernels.ops.activation, built through tvm_ffi and nvcc at first use; not tried here)")
        if moe:
            # the alignment path for the verify-wall's largest pass is decided per call; name the rule here
            al = mods["align"]
            if al.large is None:
                subs.append(f"alignment: SGLang's Triton moe_align_small_numel also beyond its gate (numel > "
                            f"{al.limit} or <= 64 experts), where SGLang calls sgl_kernel.moe_align_block_size "
                            "(not installed)")
            if mods["experts"].cuda_sum is None:
                subs.append("expert sum: moe_sum_reduce_triton also above 32 tokens, where SGLang calls "
                            "sgl_kernel.moe_sum_reduce (not installed)")
    elif moe:
        missing.append(f"experts (SGLang's Triton fused MoE): {why.get('experts') or why.get('align')}")
    ref += ["acceptance (SGLang runs tree greedy verification as JIT CUDA/sgl_kernel on CUDA, not Triton)",
            "kv compaction", "rmsnorm/rope/KV write/activation small ops (SGLang: CUDA / sgl_kernel ops)",
            "dense MLP and shared expert GEMMs (torch matmul, as SGLang's unquantised linear layers)"]
    if missing:
        ops.pieces["incomplete"] = "; ".join(missing)
    note = (f"sglang {mods.get('version')}: " + "; ".join(used)
            + (". substituted: " + "; ".join(subs) if subs else "")
            + ". specverify's reference by design: " + "; ".join(ref)
            + (". MISSING, the reference stands in (not SGLang's pass): " + "; ".join(missing) if missing else ""))
    return ops, note


def _flashinfer_attention(ops, cfg, used, subs, missing):
    """Fill ``ops``' attention with SGLang's ``flashinfer`` MLA backend (FlashInfer's MLA wrapper), or name what
    is missing."""
    from specverify.peers import flashinfer as fi_peer  # noqa: PLC0415 - FlashInfer is optional

    if cfg.attention != "mla":
        missing.append(f"attention: SGLang's flashinfer backend for {cfg.attention} models (FlashInfer's paged "
                       "prefill with a custom mask) is not wired into this provider")
        return
    ok, version = fi_peer.available()
    if not ok:
        missing.append(f"attention (FlashInfer's MLA wrapper): {version}")
        return
    attn = fi_peer.MLAChainAttention()
    ops.attention_mla = attn.mla
    ops.pieces["attention"] = f"flashinfer {version}"
    used.append(f"attention: flashinfer {version} BatchMLAPagedAttentionWrapper (backend auto), planned as SGLang's "
                "flashinfer MLA backend plans it: page size 1 token slots, kv_len = prefix + k, causal for k > 1, "
                "decode planning at k = 1; chains only (trees refused, as that backend refuses topk > 1)")
    subs.append("FlashInfer plan: made in eager forwards (again when the page table or lengths change) and replayed "
                "by the graph, valid for the last eager forward's inputs (SGLang re-plans on the host before every "
                "replay, CPU time outside the GPU pass)")


# ------------------------------------------------------------------------------------------------------------
# by name


def provider_ops(provider: str, model):
    """(Ops, note) for ``provider`` (one of :data:`PROVIDERS`); raises RuntimeError with the reason when it cannot
    be built."""
    if provider == "reference":
        return Ops(), ""
    if provider == "specverify":
        return specverify_ops(model)
    if provider == "sglang":
        return sglang_ops(model)
    if provider == "sglang-flashinfer":
        return sglang_ops(model, attention="flashinfer")
    raise RuntimeError(f"unknown provider {provider!r}; expected one of {', '.join(PROVIDERS)}")
