"""Op tables for the verify-wall providers.

``specverify_ops`` puts our kernels into the model's :class:`~specverify.reference.model.Ops` table piece by
piece; a piece whose kernel is missing or fails its import stays on the reference and the table's ``pieces`` says
so. ``sglang_ops`` composes SGLang's own Triton kernels (see :mod:`specverify.peers.sglang`) the way SGLang's
Triton attention backend and MoE layer call them.
"""
from __future__ import annotations

import importlib
import logging


log = logging.getLogger("specverify")


def _try(module: str, *names: str):
    try:
        mod = importlib.import_module(module)
        return [getattr(mod, n) for n in names], None
    except Exception as exc:  # a missing piece falls back to the reference, and the table says why
        return None, f"{module}: {type(exc).__name__}: {exc}"


def specverify_ops(model):
    """(Ops, note) with every available specverify kernel swapped in."""
    from specverify.reference.model import Ops

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

        def route(logits, p):
            return moe_route(logits, top_k=p.num_experts_per_tok, scoring=p.scoring_func,
                             correction_bias=p.correction_bias, n_group=p.n_group, topk_group=p.topk_group,
                             renormalize=p.norm_topk_prob, routed_scaling_factor=p.routed_scaling_factor,
                             impl="triton")

        def experts(hidden, w13, w2, ids, weights):
            return fused_moe(hidden, w13, w2, ids, weights, impl="triton")

        def experts_with_shared(hidden, w13_all, w2_all, ids, weights):
            # the shared expert is expert E of the stacked weights, chosen by every token with weight 1
            ids, weights = append_shared_expert(ids, weights, w13_all.shape[0] - 1, impl="triton")
            return fused_moe(hidden, w13_all, w2_all, ids, weights, impl="triton")

        ops.route, ops.experts, ops.experts_with_shared = route, experts, experts_with_shared
        ops.pieces["shared_expert"] = "triton (fused into the expert pass)"
        ops.pieces["moe_route"] = "triton"
        ops.pieces["experts"] = "triton"
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
                    "mla_up_v")
    if fns:
        rmsnorm, mla_kv_prep, gqa_prep, silu_mul, mla_absorb_q, mla_up_v = fns
        ops.rmsnorm = lambda x, w, eps: rmsnorm(x, w, eps, impl="triton")
        ops.add_rmsnorm = lambda x, r, w, eps: rmsnorm(x, w, eps, residual=r, impl="triton")

        def mla_prep(q, kv, positions, norm_w, cache, page_table, prefix_lens, eps, theta, nope):
            return mla_kv_prep(q, kv, positions, norm_w, cache, page_table, prefix_lens, eps=eps, theta=theta,
                               nope_dim=nope, impl="triton")

        def gqa(q, k, v, positions, qn, kn, kc, vc, page_table, prefix_lens, eps, theta):
            return gqa_prep(q, k, v, positions, qn, kn, kc, vc, page_table, prefix_lens, eps=eps, theta=theta,
                            impl="triton")

        ops.mla_prep, ops.gqa_prep = mla_prep, gqa
        ops.silu_mul = lambda gu: silu_mul(gu, impl="triton")
        ops.mla_absorb_q = lambda q, w_uk, nope: mla_absorb_q(q, w_uk, nope, impl="triton")
        ops.mla_up_v = lambda o_latent, w_uv: mla_up_v(o_latent, w_uv, impl="triton")
        ops.pieces["small_ops"] = "triton"
    else:
        missing.append(why)
    note = ("reference used for: " + "; ".join(missing)) if missing else ""
    return ops, note


def sglang_ops(model):
    """(Ops, note) composed from SGLang's Triton kernels; raises RuntimeError with the reason if unavailable."""
    try:
        peer = importlib.import_module("specverify.peers.sglang")
    except ImportError as exc:
        raise RuntimeError(f"SGLang peer module unavailable: {exc}") from exc
    ok, reason = peer.available()
    if not ok:
        raise RuntimeError(reason)
    return peer.make_ops(model)
