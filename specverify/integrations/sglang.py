"""SGLang plugin: our verify kernels inside an unmodified SGLang 0.5.23 server.

SGLang runs every callable registered under the entry-point group ``sglang.srt.plugins`` early in each of its
processes (``sglang.srt.plugins.load_plugins``), then applies the hooks the callables registered with its
``HookRegistry``. Our entry point is ``specverify = specverify.integrations.sglang:register`` (pyproject.toml).
SGLang logs and swallows a plugin's exceptions, so the tests in ``tests/sglang`` check that every hook took effect.

What :func:`register` does, each part switched by an environment variable (``specverify.envvars``):

==================================  ==========================================================================
``SPECVERIFY_SGLANG_ATTENTION=1``   registers the attention backend ``specverify`` (``--attention-backend
                                    specverify``): TARGET_VERIFY through :func:`specverify.tree_attention` /
                                    :func:`specverify.tree_attention_mla`, every other mode SGLang's Triton backend.
``SPECVERIFY_SGLANG_ROUTING=1``     around-hooks SGLang's grouped biased top-k (the router DeepSeek-V3 / Kimi-K2
                                    MoE layers call) and its MoE block alignment: :func:`specverify.moe_route`
                                    routes and aligns in one launch; anything else goes to SGLang's functions.
``SPECVERIFY_SGLANG_ALLREDUCE=1``   around-hooks SGLang's custom-allreduce class chooser: our
                                    :class:`specverify.comm.CustomAllReduce` where it can run, SGLang's otherwise.
``SPECVERIFY_SGLANG_GRAPH_POOL=0``  experimental, not implemented in this release: one verify graph runner per
                                    draft length. Setting it to 1 logs a warning and changes nothing.
==================================  ==========================================================================

:data:`SGLANG_TARGETS` lists every SGLang name the plugin hooks, calls or relies on, as found in the 0.5.23 wheel.
A test resolves each one, so an SGLang release that moves a target fails CI with the target's name.

Importing this module imports neither SGLang nor our kernels; :func:`register` imports two light SGLang modules
(the attention registry and the CLI choices) and nothing that touches CUDA.
"""
from __future__ import annotations

import logging
import pkgutil
import weakref
from typing import Any, Callable, NamedTuple

from specverify import envvars
from specverify.integrations.sglang_stats import STATS, reset_stats
from specverify.integrations.sglang_stats import log_once as _log_once

logger = logging.getLogger("specverify.sglang")

#: SGLang version the targets below were read from.
SGLANG_VERSION = "0.5.23"

#: Name of our attention backend in SGLang's registry and ``--attention-backend`` choices.
BACKEND_NAME = "specverify"


class Target(NamedTuple):
    """One SGLang name the plugin depends on."""

    dotted: str  #: dotted path, resolvable with :func:`pkgutil.resolve_name`
    how: str  #: ``around`` (hooked), ``extend`` (mutated in place), ``subclass``, ``call`` or ``read``
    why: str  #: what the plugin does with it


#: Every SGLang 0.5.23 name the plugin hooks, extends, subclasses, calls or reads. Keys are stable; values are
#: what we found in the wheel. ``tests/sglang/test_sglang_plugin.py`` resolves each one.
SGLANG_TARGETS: dict[str, Target] = {
    # plugin framework
    "load_plugins": Target("sglang.srt.plugins.load_plugins", "read",
                           "runs entry points of group sglang.srt.plugins, then HookRegistry.apply_hooks()"),
    "hook_registry": Target("sglang.srt.plugins.hook_registry.HookRegistry", "call",
                            "register(target, hook, HookType.AROUND); apply_hooks() patches and propagates"),
    "hook_type": Target("sglang.srt.plugins.hook_registry.HookType", "read", "AROUND"),
    # attention
    "attention_registry": Target("sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS", "extend",
                                 "name -> factory(model_runner); we add 'specverify'"),
    "attention_choices": Target("sglang.srt.arg_groups.choices.ATTENTION_BACKEND_CHOICES", "extend",
                                "--attention-backend / --prefill- / --decode-attention-backend choices"),
    "add_attention_choices": Target("sglang.srt.arg_groups.choices.add_attention_backend_choices", "call",
                                    "public way to extend the choices list"),
    "draft_attention_choices": Target("sglang.srt.arg_groups.choices.DRAFT_ATTENTION_BACKEND_CHOICES", "read",
                                      "the EAGLE draft backend must be one of these built-ins (not ours)"),
    "triton_backend": Target("sglang.srt.layers.attention.triton_backend.TritonAttnBackend", "subclass",
                             "our backend is a TritonAttnBackend that swaps the verify kernel"),
    "triton_extend_kernel": Target(
        "sglang.srt.layers.attention.triton_backend.TritonAttnBackend._forward_extend_kernel", "subclass",
        "the one call that runs extend attention after the KV write; we override it for TARGET_VERIFY"),
    "triton_init_metadata": Target(
        "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.init_forward_metadata", "subclass",
        "eager metadata; we add page table, prefix lengths and the packed tree mask"),
    "triton_init_metadata_out_graph": Target(
        "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.init_forward_metadata_out_graph",
        "subclass", "graph capture/replay metadata (host side)"),
    "triton_init_graph_state": Target(
        "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.init_cuda_graph_state", "subclass",
        "static buffers for graphs; we add ours and pick the verify-mask layout"),
    "triton_verify_mask": Target("sglang.srt.layers.attention.triton_backend.TritonAttnBackend.verify_mask",
                                 "subclass", "property: the mask buffer + layout the tree builder fills"),
    "triton_update_verify_buffers": Target(
        "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.update_verify_buffers_to_fill_after_draft",
        "subclass", "verify-buffer update hook after draft (no-op for the Triton family)"),
    "verify_mask": Target("sglang.srt.layers.attention.verify_mask.VerifyMask", "call",
                          "struct(buffer, mode, max_bs, is_read) returned by the verify_mask property"),
    "tree_mask_mode": Target("sglang.kernels.ops.speculative.spec_tree.TreeMaskMode", "read",
                             "FULL_MASK = per request [D, prefix + D]; QLEN_ONLY = per request [D, D]"),
    "model_runner_page_size": Target("sglang.srt.model_executor.model_runner.ModelRunner", "read",
                                     "runner.page_size, req_to_token_pool, token_to_kv_pool, model_config"),
    # MoE
    "routing": Target("sglang.srt.layers.moe.topk.biased_grouped_topk", "around",
                      "the name select_experts calls for DeepSeek-V3 / Kimi-K2 (use_grouped_topk + bias)"),
    "routing_caller": Target("sglang.srt.layers.moe.topk.select_experts", "read",
                             "TopK.forward_cuda -> select_experts -> biased_grouped_topk(**kwargs)"),
    "alignment": Target("sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size.moe_align_block_size",
                        "around", "Triton fused-MoE alignment; E + 1 buckets, pad id = topk_ids.numel()"),
    "alignment_caller": Target("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe.moe_align_block_size",
                               "read", "from-import in fused_moe; HookRegistry propagates the patch there"),
    # allreduce
    "allreduce_chooser": Target(
        "sglang.srt.distributed.device_communicators.custom_all_reduce.dispatch_custom_allreduce", "around",
        "GroupCoordinator.__init__ imports it lazily and builds CAClass(group=cpu_group, device=device)"),
    "allreduce_stock": Target("sglang.srt.distributed.device_communicators.custom_all_reduce.CustomAllreduce",
                              "read", "the duck-typed interface: disabled, should_custom_ar, custom_all_reduce, "
                              "capture(), close()"),
    # graph runners / adaptive speculation (experimental graph pool; not hooked yet)
    "adaptive_controller": Target("sglang.srt.speculative.adaptive_runtime_state.AdaptiveController", "read",
                                  "swaps SpecRuntimeState (draft + verify graph runners) per step count"),
    "spec_runtime_state": Target("sglang.srt.speculative.adaptive_runtime_state.SpecRuntimeState", "read",
                                 "target_graph_runner per speculative_num_draft_tokens"),
    "verify_graph_runner": Target("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner",
                                  "read", "captures TARGET_VERIFY graphs of the target model"),
    "draft_graph_runner": Target("sglang.srt.speculative.eagle_draft_cuda_graph_runner.EAGLEDraftCudaGraphRunner",
                                 "read", "EAGLE multi-step draft graphs"),
    # test kit (CPU tests)
    "kit_dense_verify": Target(
        "sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner."
        "run_dense_eagle_verify_case", "call", "dense/GQA target-verify case runner (tree: D=3, topk=2)"),
    "kit_mla_verify": Target(
        "sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner."
        "run_mla_eagle_verify_case", "call", "MLA target-verify case runner"),
    # peer kernels (exactness tests, bench/sglang_peer.py)
    "peer_extend_attention": Target("sglang.kernels.ops.attention.extend_attention.extend_attention_fwd", "call",
                                    "Triton extend attention with custom mask (SGLang's verify kernel)"),
    "peer_decode_attention": Target("sglang.kernels.ops.attention.decode_attention.decode_attention_fwd", "call",
                                    "Triton split-KV decode"),
    "peer_moe_fused_gate": Target("sglang.kernels.ops.moe.moe_fused_gate.moe_fused_gate", "call", "Triton router"),
    "peer_moe_align_small": Target("sglang.kernels.ops.moe.moe_align_small_numel.moe_align_small_numel", "call",
                                   "one-launch alignment for <= 64 slots"),
    "peer_build_tree": Target("sglang.kernels.ops.speculative.spec_tree.sgl_build_tree_kernel_triton", "call",
                              "EAGLE tree build (mask, positions, retrieve links) in Triton"),
    "peer_verify_greedy": Target("sglang.kernels.ops.speculative.spec_tree.verify_tree_greedy_triton", "call",
                                 "greedy tree acceptance in Triton"),
    "peer_fused_moe_kernel": Target(
        "sglang.kernels.ops.moe.fused_moe_triton_kernels.invoke_fused_moe_kernel", "call",
        "Triton fused-MoE GEMM launcher"),
}


def resolve_target(key: str) -> Any:
    """Resolve :data:`SGLANG_TARGETS` ``[key]`` in the installed SGLang.

    Raises
    ------
    LookupError
        The target does not exist; the message names it and the SGLang version the table was written for.
    """
    target = SGLANG_TARGETS[key]
    try:
        return pkgutil.resolve_name(target.dotted)
    except Exception as exc:  # ImportError, AttributeError, ValueError
        raise LookupError(
            f"SGLang target {key!r} = {target.dotted} ({target.why}) is missing from the installed SGLang "
            f"({exc.__class__.__name__}: {exc}); the plugin was written against sglang=={SGLANG_VERSION}: "
            f"update SGLANG_TARGETS in specverify/integrations/sglang.py"
        ) from exc


# --------------------------------------------------------------------------------------------------- register

#: What the last :func:`register` call registered: part -> list of targets (the tests compare with SGLang's state).
REGISTERED: dict[str, list[str]] = {}


def register() -> None:
    """The SGLang plugin entry point: register the backend and the hooks that the environment enables.

    Cheap: no CUDA, no kernel import (those happen on first use, inside SGLang's worker processes). Idempotent.

    Notes
    -----
    Hooks are applied by SGLang right after all plugins ran (``HookRegistry.apply_hooks``), which imports the
    hooked modules. Each hook declines to SGLang's own function for any input our kernels do not cover.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    REGISTERED.clear()
    if envvars.get_flag("SPECVERIFY_SGLANG_ATTENTION"):
        _register_attention_backend()
        REGISTERED["attention"] = [SGLANG_TARGETS["attention_registry"].dotted,
                                   SGLANG_TARGETS["attention_choices"].dotted]
    if envvars.get_flag("SPECVERIFY_SGLANG_ROUTING"):
        _register_hook(HookRegistry, HookType, "routing", routing_around)
        _register_hook(HookRegistry, HookType, "alignment", alignment_around)
        REGISTERED["routing"] = [SGLANG_TARGETS["routing"].dotted, SGLANG_TARGETS["alignment"].dotted]
    if envvars.get_flag("SPECVERIFY_SGLANG_ALLREDUCE"):
        _register_hook(HookRegistry, HookType, "allreduce_chooser", allreduce_chooser_around)
        REGISTERED["allreduce"] = [SGLANG_TARGETS["allreduce_chooser"].dotted]
    if envvars.get_flag("SPECVERIFY_SGLANG_GRAPH_POOL"):
        logger.warning("SPECVERIFY_SGLANG_GRAPH_POOL=1: the per-draft-length verify graph pool is experimental and "
                       "not implemented in this release; SGLang's own graph runners are used")


def _register_hook(registry, hook_type, key: str, hook: Callable) -> None:
    target = SGLANG_TARGETS[key].dotted
    # Idempotent: a second register() in one process must not stack a second wrapper.
    if any(h is hook for _, h, _ in registry._hooks.get(target, [])):
        return
    registry.register(target, hook, hook_type.AROUND)


def _register_attention_backend() -> None:
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention import attention_registry

    if BACKEND_NAME not in attention_registry.ATTENTION_BACKENDS:
        attention_registry.register_attention_backend(BACKEND_NAME)(create_attention_backend)
    if BACKEND_NAME not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([BACKEND_NAME])


def create_attention_backend(model_runner):
    """SGLang backend factory for ``--attention-backend specverify`` (imports SGLang's Triton backend lazily)."""
    from specverify.integrations.sglang_backend import make_backend

    return make_backend(model_runner)


# ------------------------------------------------------------------------------------------------- MoE routing

_ROUTING_PARAMS = ("hidden_states", "gating_output", "correction_bias", "topk", "renormalize", "num_expert_group",
                   "topk_group", "num_fused_shared_experts", "routed_scaling_factor",
                   "apply_routed_scaling_factor_on_output")
_ROUTING_DEFAULTS = {"num_expert_group": None, "topk_group": None, "num_fused_shared_experts": 0,
                     "routed_scaling_factor": None, "apply_routed_scaling_factor_on_output": False}

# Alignment fusion: the routing hook learns, from the alignment hook, which block size fused_moe asks for at a
# given (tokens, top_k, experts) and from then on aligns in the same launch as the routing; the alignment hook
# returns that result when it is handed the very topk_ids tensor the routing returned.
_BLOCK_SIZE_BY_SHAPE: dict[tuple[int, int, int], int] = {}
_LAST_ALIGNMENT: dict[str, Any] = {"ids": None, "num_experts": None, "alignment": None}


def _kernels_usable(t) -> tuple[bool, str]:
    if t.is_cuda:
        return True, ""
    if envvars.triton_interpret():
        return True, ""
    return False, f"tensor on {t.device} (needs CUDA or TRITON_INTERPRET=1)"


def _routing_args(args: tuple, kwargs: dict) -> dict:
    if not args:
        merged = dict(_ROUTING_DEFAULTS)
        merged.update(kwargs)
        return merged
    merged = dict(_ROUTING_DEFAULTS)
    merged.update(zip(_ROUTING_PARAMS, args))
    merged.update(kwargs)
    return merged


def _routing_decline_reason(a: dict) -> str:
    import torch

    logits, bias = a.get("gating_output"), a.get("correction_bias")
    if logits is None or not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        return "gating_output is not a 2-D tensor"
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"gating_output dtype {logits.dtype}"
    if a.get("num_fused_shared_experts"):
        return "fused shared experts (SGLang appends shared-expert slots)"
    if bias is None or not isinstance(bias, torch.Tensor) or bias.dim() != 1:
        return "correction_bias is not one vector (per-token dynamic bias)"
    e = logits.shape[1]
    n_group = a.get("num_expert_group") or 1
    topk_group = a.get("topk_group") or 1
    if e > 1024 or e % n_group or not 1 <= topk_group <= n_group:
        return f"expert layout E={e}, n_group={n_group}, topk_group={topk_group}"
    if not 1 <= int(a["topk"]) <= e:
        return f"top_k={a['topk']}"
    ok, why = _kernels_usable(logits)
    if not ok:
        return why
    return ""


def routing_around(original: Callable, *args, **kwargs):
    """Around-hook on SGLang's ``biased_grouped_topk``: route with :func:`specverify.moe_route`.

    Keeps SGLang's contract: returns ``(topk_weights fp32 [M, top_k], topk_ids int32 [M, top_k])``; the order of
    the k slots is not part of it (SGLang's own router returns them unsorted). Every id is in ``[0, E)``, rows of
    NaN logits included (weight-0 fillers, see :func:`specverify.moe_route`'s Notes), so SGLang's expert kernels,
    which index by id, stay in range. Declines to ``original`` (logged
    once per reason) for fused shared experts, per-token bias, unsupported expert layouts, non-CUDA tensors or
    when ``specverify.moe`` cannot be imported.
    Renormalisation differs from SGLang's only by SGLang's 1e-20 added to the sum (ours divides where the sum is
    > 0), invisible in fp32 unless the chosen scores sum below ~1e-13.
    """
    a = _routing_args(args, kwargs)
    reason = _routing_decline_reason(a)
    route = None
    if not reason:
        try:
            from specverify.moe import moe_route as route
        except Exception as exc:  # kernels not built/importable in this environment
            reason = f"specverify.moe unavailable ({exc.__class__.__name__}: {exc})"
    if reason:
        STATS["routing_declined"] += 1
        _log_once("routing:" + reason, f"specverify routing declined to SGLang's biased_grouped_topk: {reason}")
        return original(*args, **kwargs)
    logits, bias = a["gating_output"], a["correction_bias"]
    top_k, e = int(a["topk"]), logits.shape[1]
    scale = float(a["routed_scaling_factor"]) if (a["apply_routed_scaling_factor_on_output"]
                                                   and a["routed_scaling_factor"] is not None) else 1.0
    block_size = _BLOCK_SIZE_BY_SHAPE.get((logits.shape[0], top_k, e))
    out = route(logits, top_k=top_k, scoring="sigmoid", correction_bias=bias,
                n_group=int(a["num_expert_group"] or 1), topk_group=int(a["topk_group"] or 1),
                renormalize=bool(a["renormalize"]), routed_scaling_factor=scale, block_size=block_size)
    STATS["routing_ours"] += 1
    if block_size is None:
        ids, weights = out
        _LAST_ALIGNMENT.update(ids=None, num_experts=None, alignment=None)
    else:
        ids, weights, alignment = out
        _LAST_ALIGNMENT.update(ids=weakref.ref(ids), num_experts=e, alignment=alignment)
    return weights, ids


_ALIGN_PARAMS = ("topk_ids", "block_size", "num_experts", "ignore_invalid_expert")


def alignment_around(original: Callable, *args, **kwargs):
    """Around-hook on SGLang's Triton-MoE ``moe_align_block_size``.

    When handed the ``topk_ids`` our routing hook just returned, it returns the alignment that
    :func:`specverify.moe_route` produced in the same launch (SGLang's conventions: int32 buffers, expert runs in
    expert order padded to ``block_size`` with the id ``topk_ids.numel()``, ``num_tokens_post_padded`` int32 [1];
    filtered (-1) slots are skipped where SGLang puts them in its extra bucket 0, which fused_moe never reads).
    Otherwise it records the block size for that shape (so the next routing call aligns too) and declines to
    ``original``. Options ours does not cover (``ignore_invalid_expert``, ``return_inactive_prefix_count``,
    ``pad_expert_ids``) always decline.
    """
    a = dict(zip(_ALIGN_PARAMS, args))
    a.update(kwargs)
    topk_ids, block_size, num_experts = a.get("topk_ids"), a.get("block_size"), a.get("num_experts")
    special = a.get("ignore_invalid_expert") or a.get("return_inactive_prefix_count") or a.get("pad_expert_ids")
    last = _LAST_ALIGNMENT["ids"]
    if (not special and last is not None and last() is topk_ids and _LAST_ALIGNMENT["num_experts"] == num_experts
            and _LAST_ALIGNMENT["alignment"].block_size == block_size):
        al = _LAST_ALIGNMENT["alignment"]
        STATS["alignment_ours"] += 1
        return al.sorted_token_ids, al.expert_ids, al.num_tokens_post_padded
    if (not special and topk_ids is not None and getattr(topk_ids, "dim", lambda: 0)() == 2
            and isinstance(block_size, int) and block_size > 0 and block_size & (block_size - 1) == 0
            and block_size <= 256 and isinstance(num_experts, int)):
        _BLOCK_SIZE_BY_SHAPE[(topk_ids.shape[0], topk_ids.shape[1], num_experts)] = block_size
    STATS["alignment_declined"] += 1
    return original(*args, **kwargs)


# --------------------------------------------------------------------------------------------------- allreduce

_ADAPTER: list[type] = []


def sglang_allreduce_class() -> type:
    """Our :class:`specverify.comm.CustomAllReduce` with SGLang's duck-typed method names added.

    SGLang calls ``CAClass(group=cpu_group, device=device)``, reads ``disabled``, and calls
    ``should_custom_ar(x)``, ``custom_all_reduce(x)`` (result or None), ``capture()`` and ``close()``.
    """
    if _ADAPTER:
        return _ADAPTER[0]
    from specverify.comm import CustomAllReduce

    class SGLangCustomAllReduce(CustomAllReduce):
        """:class:`specverify.comm.CustomAllReduce` under the names SGLang's GroupCoordinator calls."""

        def should_custom_ar(self, inp) -> bool:
            return (not self.disabled) and bool(self.should_use(inp))

        def custom_all_reduce(self, inp):
            if not self.should_custom_ar(inp):
                return None
            STATS["allreduce_ours"] += 1
            return self.all_reduce(inp)

    _ADAPTER.append(SGLangCustomAllReduce)
    return SGLangCustomAllReduce


def allreduce_chooser_around(original: Callable, *args, **kwargs):
    """Around-hook on SGLang's ``dispatch_custom_allreduce(group, device)``: our class when it can run here.

    Declines to SGLang's choice when ``SPECVERIFY_ALLREDUCE=off``, when CUDA is absent, or when
    ``specverify.comm`` cannot be imported (CuPy missing). A constructed instance that finds the IPC path
    unusable sets ``disabled`` itself, exactly like SGLang's class, and SGLang then falls back to NCCL.
    """
    reason = ""
    if envvars.get("SPECVERIFY_ALLREDUCE").strip().lower() == "off":
        reason = "SPECVERIFY_ALLREDUCE=off"
    else:
        try:
            import torch

            if not torch.cuda.is_available():
                reason = "no CUDA device"
            else:
                cls = sglang_allreduce_class()
        except Exception as exc:
            reason = f"specverify.comm unavailable ({exc.__class__.__name__}: {exc})"
    if reason:
        STATS["allreduce_declined"] += 1
        _log_once("allreduce:" + reason, f"specverify allreduce declined to SGLang's chooser: {reason}")
        return original(*args, **kwargs)
    return cls


__all__ = [
    "BACKEND_NAME", "REGISTERED", "SGLANG_TARGETS", "SGLANG_VERSION", "STATS", "Target",
    "alignment_around", "allreduce_chooser_around", "create_attention_backend", "register", "reset_stats",
    "resolve_target", "routing_around", "sglang_allreduce_class",
]
