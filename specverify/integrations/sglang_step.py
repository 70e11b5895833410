"""SGLang runs our whole verify step: a ``MegakernelSpec`` for ``DeepseekV3ForCausalLM`` (Kimi-K2, DeepSeek-V3) and
``KimiK25ForConditionalGeneration`` (Kimi-K2.5, which wraps a ``DeepseekV3ForCausalLM`` as ``.language_model``).

SGLang 0.5.23's ``--enable-nvidia-megakernel`` lets an external package replace a model's whole decode and
target-verify step (``sglang.kernels.plugin_kernels.nvidia.spec``, wired in
``sglang.srt.kernel_plugins.nvidia.binding``). SGLang looks the spec up through the entry point named
``nvidia_megakernel`` in group ``sglang.srt.plugins`` (pyproject.toml: ``nvidia_megakernel =
specverify.integrations.sglang_step:register``), checks it against the resolved server settings, calls
:func:`build_step` once the weights are loaded, and wraps ``model.forward``: for every forward
:meth:`VerifyStep.plan` (host only) says whether the step is ours, and :meth:`VerifyStep.forward` runs it in place
of the model's own forward.

This module is a thin adapter from SGLang's objects onto :mod:`specverify.forward.step`, which needs no SGLang
(``specverify bench verify-wall --impl sglang-step`` drives the same functions on a GPU without SGLang)::

    SGLang ForwardBatch + ForwardView  ->  VerifyStep._inputs: ids, positions, prefix lengths, the per-layer latent
                                           KV buffers, page_table_from_metadata, tree_mask_from_links
                                       ->  LoadedVerifyModel.forward_captured (our op table, model_ops)
                                       ->  LogitsProcessorOutput (logits, hidden states as capture_hidden_mode asks)

What is ours and what stays SGLang's
------------------------------------
Ours, for TARGET_VERIFY at the server's draft length (chains and trees) and decode: the embedding, every layer
(fused q_a/kv_a projection, latent norm, RoPE, the draft KV write, absorbed-MLA tree attention, the MoE router with
its correction bias, routed experts with the shared expert, the dense MLP, the fused residual norms) and the LM
head. SGLang's: every other forward mode (EXTEND / prefill, draft model), the sampler and the verify acceptance.

Kimi-K2.5's W4A16 int4 routed experts run ours (``fused_moe(..., quant=...)`` over SGLang's tensors) where SGLang
holds them in our layout: its Triton W4A16 runner (``CompressedTensorsWNA16TritonMoE``, ``--moe-runner-backend
triton``; :func:`int4_experts_quant`). Other quantised routed experts (Marlin's repacked int4, SGLang's default on
Hopper; FP8 block, ...) stay SGLang's: the layer's weight dict carries ``experts_fn``
(:func:`sglang_experts_fn`), which hands our routing to the layer's own ``FusedMoE`` as a ``StandardTopKOutput``, so
SGLang's quant method (``quant_method.apply``) runs those experts inside our forward while attention, routing, the
shared expert and the norms stay ours. ``build_step(..., experts="sglang")`` sends every MoE layer that way (the
CPU tests drive it over unquantised experts).

Kimi-K2.5 (``KimiK25ForConditionalGeneration``): the step reads the weights and config of its
``.language_model`` / ``hf_config.text_config`` and replaces the wrapper's forward, returning what it returns (the
language model's ``LogitsProcessorOutput``). The vision tower and image embeddings are SGLang's: :meth:`VerifyStep.plan`
gives every batch that carries multimodal inputs (``ForwardBatch.contains_mm_inputs()``) to SGLang's own forward.
SGLang's wrapper reads those inputs only outside decode and TARGET_VERIFY (the prefix KV already holds the images),
so a captured decode graph, which replays the decision made at capture, computes the same thing either way.

Weights (:func:`read_weights`): every tensor our layout needs is a view of SGLang's parameter where the layouts
agree, which is all of them except the expert stack with the shared expert appended (``w13_all`` / ``w2_all``),
built only when the op table fuses the shared expert into the expert pass. That stack is copied once, and SGLang's
routed-expert and shared-expert parameters are then re-pointed at views of it, so no memory is held twice. The
one copy held beside SGLang's parameters: each MLA layer's q_b times q_a's norm weight (``q_b_folded``, where the
fold can run; :class:`~specverify.forward.step.LoadedVerifyModel`), counted in ``held_extra_bytes``. The
expert stacks of layers whose routed experts stay SGLang's are not read at all.

RoPE and the softmax scale are the model's: DeepSeek-V3 / Kimi-K2 use YaRN (``deepseek_yarn``) rotary tables in
the interleaved (GPT-J) layout and an mscale-corrected softmax scale, which the generic
:class:`~specverify.forward.model.VerifyModel` does not model. :func:`~specverify.forward.step.model_ops` makes
``mla_prep`` read SGLang's ``cos_sin_cache`` (a shared tensor; still one fused launch with the Triton op table) and
calls ``attention_mla`` with ``self_attn.scaling``.

Tensor parallel (:data:`TP_SIZES`): at SGLang's TP size > 1 each rank builds the forward over its own shards, which
SGLang's parameters already are: ``q_b`` / ``kv_b`` (hence ``w_kc`` / ``w_vc``) / ``o_proj`` split by heads, the dense
MLP, the shared expert and the routed experts on the intermediate dimension, the embedding and LM head on SGLang's
padded vocabulary (:func:`read_weights` takes this rank's rows from ``VocabParallelEmbedding.shard_indices``); the
fused q_a/kv_a projection, the norms and the router are replicated. The collectives are SGLang's own calls
(:func:`sglang_collectives`: ``tensor_model_parallel_all_reduce`` / ``tensor_model_parallel_all_gather`` on its TP
group, so its custom all-reduce and graph-capture handling apply), where SGLang's DeepseekV2 makes them: one
all-reduce of the embedding, of each attention output (``o_proj`` does not reduce; SGLang's layer boundary does) and
of each MLP / MoE output (routed plus shared expert, summed before the reduce), and the logits all-gather cut to the
vocabulary. Attention TP must equal TP and the shared expert and dense MLP must be TP-split: DP attention and EP are
refused by SGLang, an all-to-all MoE backend, a replicated shared expert (``SGLANG_SHARED_EXPERT_TP1``) or dense MLP
(``--moe-dense-tp-size 1``) and shapes the TP size does not divide by :func:`config_disable_reasons` /
:func:`model_disable_reasons`.

Limits of this release (each refused with one reason, see :func:`config_disable_reasons` and
:func:`model_disable_reasons`; SGLang itself refuses every :class:`Feature` the spec does not list: DP attention,
expert parallelism, context parallelism, LoRA, pipeline parallelism, ...): tensor parallel sizes 1, 2, 4, 8 (tested
at 2 on the CPU over gloo, not yet over NCCL or SGLang's custom all-reduce); unquantised
attention, dense-MLP, shared-expert and LM-head weights (routed experts in any format SGLang's ``FusedMoE`` runs on
a standard top-k output are served, except with SGLang's shared-experts fusion over quantised stacks); a bf16/auto
KV cache; the Triton-family attention backends (``triton``, ``specverify``), whose metadata gives the prefix KV ids.
CUDA-graph capture is designed for (no host sync, fixed shapes per width) but not yet run; the quantised expert
kernels (Marlin, FP8 block) have not run inside the step (the CPU tests run SGLang's unquantised expert path and a
stand-in quant method through the same hook).
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

import torch

from sglang.kernels.plugin_kernels.nvidia.spec import (MEGAKERNEL_API_VERSION, Feature, MegakernelSpec, Numerics,
                                                       NumericsKind, Requirements, Step)
from specverify.configs import ModelConfig
from specverify.forward.ops import RouteParams, provider_ops
from specverify.forward.step import (LoadedVerifyModel, model_ops, page_table_from_metadata, slot_table_width,
                                     tree_mask_from_links)

logger = logging.getLogger("specverify.sglang")

#: The HF architecture the spec serves (Kimi-K2 and DeepSeek-V3 checkpoints name it).
ARCHITECTURE = "DeepseekV3ForCausalLM"
#: Wrappers of a DeepseekV3ForCausalLM the spec also serves: architecture -> the attribute holding the language model
#: (its HF config is ``hf_config.text_config``).
WRAPPERS = {"KimiK25ForConditionalGeneration": "language_model"}
#: Every architecture :func:`register` registers the spec for.
ARCHITECTURES = (ARCHITECTURE, *WRAPPERS)
#: ``experts=`` values of :func:`build_step`: ``auto`` (ours where we have a kernel for the format, SGLang's module
#: otherwise) or ``sglang`` (every MoE layer's routed experts through its SGLang module).
EXPERTS = ("auto", "sglang")
#: ``module:attribute`` SGLang's registry imports the spec from.
SPEC_PATH = "specverify.integrations.sglang_step:SPEC"
SPEC_NAME = "specverify-verify-step"
#: The widest step covered (rows = requests x tokens per request).
MAX_ROWS = 1024
#: Attention backends whose forward metadata (``kv_indptr`` / ``kv_indices``) the step reads the prefix KV ids from.
ATTENTION_BACKENDS = frozenset({"triton", "specverify"})
#: Speculative algorithms whose verify input is an ``EagleVerifyInput`` (the tree links the step reads).
SPEC_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "NEXTN"})
#: Tensor-parallel sizes served (``SPEC.requires.tp_sizes``; SGLang refuses the others itself): every rank runs our
#: forward over its own shards, the collectives through SGLang's TP group (:func:`sglang_collectives`).
TP_SIZES = frozenset({1, 2, 4, 8})

#: Declared agreement with SGLang's own forward on the same batch, measured by tests/sglang/test_sglang_step.py on
#: SGLang's real DeepseekV3ForCausalLM (tiny config, CPU, 2 requests x 4 draft tokens, 3 layers): max |difference|
#: over every verify row relative to the largest |value| of SGLang's forward (logits ~3.7). Measured: fp32 logits
#: <= 1.3e-6, hidden states <= 1.2e-6, draft KV <= 1.1e-6, greedy tokens equal; bf16 logits 1.7e-2 (reference op
#: table) and 2.3e-2 (specverify's Triton kernels). Against an fp32 forward over the same bf16-rounded weights, our
#: bf16 step errs at most ``bf16_error_vs_sglang_bf16_error`` times what SGLang's own bf16 forward errs (measured:
#: 0.221 against 0.219, both dominated by top-k routing flips).
TOLERANCES = {
    "logits_max_rel_fp32": 1e-5,
    "hidden_max_rel_fp32": 1e-5,
    "logits_max_rel_bf16": 5e-2,
    "greedy_token_mismatches_fp32": 0.0,
    "bf16_error_vs_sglang_bf16_error": 2.0,
}

_MiB = 2 ** 20


def register() -> None:
    """Entry point ``nvidia_megakernel`` (group ``sglang.srt.plugins``): registers :data:`SPEC` for every
    architecture of :data:`ARCHITECTURES` in SGLang's megakernel registry (the spec module is imported only when
    SGLang asks)."""
    from sglang.kernels.plugin_kernels.nvidia import spec as megakernel_spec

    for architecture in ARCHITECTURES:
        megakernel_spec.register(architecture=architecture, path=SPEC_PATH)


# ------------------------------------------------------------------------------------------------------------
# refusals


def _attr(obj, name, default=None):
    try:
        return getattr(obj, name, default)
    except Exception:  # a resolving view may raise for a field it cannot resolve
        return default


def text_config(hf_config):
    """The language model's HF config: ``hf_config.text_config`` for a wrapper (Kimi-K2.5), else ``hf_config``."""
    return _attr(hf_config, "text_config") or hf_config


def language_model(model):
    """The ``DeepseekV2ForCausalLM`` the step reads: ``model`` itself, or the language model a wrapper of
    :data:`WRAPPERS` holds (None for a wrapper without one, e.g. an encoder-only Kimi-K2.5)."""
    attr = WRAPPERS.get(type(model).__name__)
    return getattr(model, attr, None) if attr else model


def _attention_left_unquantised(quant_config) -> bool:
    """Whether a checkpoint's quantisation config names the attention layers among those it leaves unquantised
    (compressed-tensors ``ignore``, HF ``modules_to_not_convert``, ModelOpt ``ignored_layers``), as the
    experts-only checkpoints (Kimi-K2.5's W4A16 routed experts) do. A pre-check only: :func:`model_disable_reasons`
    reads every module's quant method after load."""
    if not isinstance(quant_config, dict):
        return False
    names = [n for key in ("ignore", "modules_to_not_convert", "ignored_layers") for n in quant_config.get(key) or ()]
    return any("self_attn" in str(n) for n in names)


def config_disable_reasons(cfg, hf_config) -> list[str]:
    """Before the weights load: what the resolved server settings and the HF config ask that the step cannot serve,
    one reason each. (SGLang adds one reason per refused :class:`Feature` and per unmet :class:`Requirements`.)
    A wrapper's (Kimi-K2.5's) model fields are read from ``hf_config.text_config``."""
    reasons = []
    text = text_config(hf_config)
    if _attr(hf_config, "encoder_only"):
        reasons.append("config.encoder_only: the model holds no language model for the step to run")
    checkpoint = _attr(hf_config, "quantization_config") or _attr(text, "quantization_config")
    named = checkpoint.get("quant_method") if isinstance(checkpoint, dict) else \
        (type(checkpoint).__name__ if checkpoint else None)
    method = _attr(cfg, "quantization") or named
    if method and not (method == named and _attention_left_unquantised(checkpoint)):
        reasons.append(f"quantised checkpoint ({method}) whose quantisation does not leave the attention layers "
                       "unquantised: the step reads unquantised attention, dense-MLP, shared-expert and LM-head "
                       "weights (quantised routed experts are served: they run through SGLang's quant method); use "
                       "a bf16 checkpoint or one quantised in its routed experts only (e.g. Kimi-K2.5's), or drop "
                       "--enable-nvidia-megakernel")
    kv_dtype = str(_attr(cfg, "kv_cache_dtype") or "auto")
    if kv_dtype not in ("auto", "bfloat16", "bf16"):
        reasons.append(f"--kv-cache-dtype {kv_dtype}: the step's attention reads a bf16 latent KV cache; start "
                       "with --kv-cache-dtype auto")
    backends = {k: _attr(cfg, k) for k in ("attention_backend", "prefill_attention_backend",
                                           "decode_attention_backend")}
    bad = {k: v for k, v in backends.items() if v is not None and v not in ATTENTION_BACKENDS}
    if bad:
        got = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in bad.items())
        reasons.append(f"{got}: the step reads the prefix KV ids from the Triton attention metadata; start with "
                       f"--attention-backend {' or '.join(sorted(ATTENTION_BACKENDS))}")
    algo = _attr(cfg, "speculative_algorithm")
    if algo is not None and str(algo).upper() not in SPEC_ALGORITHMS:
        reasons.append(f"--speculative-algorithm {algo}: the step reads the EAGLE verify input's tree; use one of "
                       f"{sorted(SPEC_ALGORITHMS)}")
    if _attr(cfg, "enable_dp_lm_head"):
        reasons.append("--enable-dp-lm-head: the step's LM head is the tensor-parallel one")
    tp = int(_attr(cfg, "tp_size", 1) or 1)
    if tp in TP_SIZES:  # SGLang refuses a size outside TP_SIZES itself
        why = tp_shape_disable_reason(text, tp)
        if why:
            reasons.append(why)
    a2a = _attr(cfg, "moe_a2a_backend")
    if a2a is not None and str(a2a) not in ("none", "None"):
        reasons.append(f"--moe-a2a-backend {a2a}: the step's experts take the tokens of their own rank (plain MoE "
                       "tensor parallelism); start without --moe-a2a-backend")
    if tp > 1 and _attr(cfg, "moe_dense_tp_size") == 1:
        reasons.append("--moe-dense-tp-size 1 at tp_size > 1: the step's dense MLP is tensor-parallel (sharded and "
                       "all-reduced), not replicated; start without --moe-dense-tp-size")
    if _attr(text, "q_lora_rank") is None:
        reasons.append("config.q_lora_rank is None (no q_a projection, DeepSeek-V2-Lite style): the step needs "
                       "the fused q_a/kv_a projection")
    router = (_attr(text, "topk_method", "noaux_tc"), _attr(text, "scoring_func", "sigmoid"))
    if router != ("noaux_tc", "sigmoid"):
        reasons.append(f"router {router[0]}/{router[1]}: the step routes DeepSeek-V3's noaux_tc sigmoid router only")
    return reasons


def tp_shape_disable_reason(text, tp: int) -> str | None:
    """Why the model's shapes cannot be split ``tp`` ways as SGLang splits them (heads, the dense, shared-expert
    and routed-expert intermediate sizes), or None. The vocabulary is padded by SGLang and needs no divisibility."""
    sizes = {"num_attention_heads": _attr(text, "num_attention_heads"),
             "intermediate_size": _attr(text, "intermediate_size"),
             "moe_intermediate_size": _attr(text, "moe_intermediate_size")}
    bad = [f"{k} {v} is not divisible by it" for k, v in sizes.items() if isinstance(v, int) and v % tp]
    experts = _attr(text, "n_routed_experts")
    if isinstance(experts, int) and experts < tp:
        bad.append(f"n_routed_experts {experts} is smaller")
    if not bad:
        return None
    return (f"tp_size {tp}: {', '.join(bad)}; each rank holds whole heads and an equal share of every intermediate "
            f"dimension; start with a tp_size of {sorted(TP_SIZES)} that divides them")


def sglang_experts_disable_reason(mlp) -> str | None:
    """Why a ``DeepseekV2MoE`` layer's routed experts cannot run through its SGLang module on our routing
    (:func:`sglang_experts_fn`), or None."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.topk import TopKOutputFormat

    experts = mlp.experts
    if not isinstance(experts, FusedMoE):
        return f"{type(experts).__name__} is not SGLang's FusedMoE"
    fmt = getattr(getattr(mlp.topk, "topk_config", None), "output_format", None)
    if fmt is not TopKOutputFormat.STANDARD:
        name = getattr(fmt, "name", fmt)
        return (f"its runner takes a {name} top-k output (it routes from the router logits itself), not our "
                "routing; start with a --moe-runner-backend that takes standard top-k ids and weights (triton, "
                "marlin)")
    if mlp.num_fused_shared_experts:
        return ("SGLang fused the shared expert into the expert stack (shared-experts fusion); start with "
                "--disable-shared-experts-fusion")
    return None


def model_disable_reasons(model, hf_config) -> list[str]:
    """After load, on each rank: what the loaded model holds that the step cannot read, one reason each. A wrapper
    (:data:`WRAPPERS`) is checked through its language model."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod, UnquantizedLinearMethod
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV2MoE

    lm = language_model(model)
    if lm is None:
        return [f"{type(model).__name__} holds no language model (.{WRAPPERS[type(model).__name__]} is None: an "
                "encoder-only config)"]
    if not isinstance(lm, DeepseekV2ForCausalLM):
        return [f"{type(model).__name__} is not SGLang's DeepseekV2ForCausalLM family (or a wrapper of one: "
                f"{sorted(WRAPPERS)}); the step reads its modules"]
    reasons = []

    def quant(module):
        qm = getattr(module, "quant_method", None)
        name = type(qm).__name__
        ok = qm is None or isinstance(qm, UnquantizedLinearMethod) or name == "UnquantizedEmbeddingMethod"
        return None if ok else name

    attn_q, mlp_q, expert_q, absorbed = [], [], [], []
    for i, layer in enumerate(lm.model.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            continue
        for name in ("fused_qkv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj"):
            q = quant(getattr(attn, name, None))
            if q:
                attn_q.append(f"layer {i} {name}: {q}")
        if attn.w_kc is None or attn.w_vc is None or getattr(attn, "use_deep_gemm_bmm", False) or \
                not (isinstance(attn.w_scale, float) and attn.w_scale == 1.0):
            absorbed.append(i)
        mlp = layer.mlp
        if isinstance(mlp, DeepseekV2MoE):
            qm = getattr(mlp.experts, "quant_method", None)
            if not isinstance(mlp.experts, FusedMoE) or not isinstance(qm, UnquantizedFusedMoEMethod):
                # not a format we read: the experts run through SGLang's module, if they can
                why = sglang_experts_disable_reason(mlp)
                if why:
                    expert_q.append(f"layer {i} ({type(qm).__name__}): {why}")
            if mlp.shared_experts is not None:
                for name in ("gate_up_proj", "down_proj"):
                    q = quant(getattr(mlp.shared_experts, name))
                    if q:
                        mlp_q.append(f"layer {i} shared_experts.{name}: {q}")
            if getattr(mlp.gate, "e_score_correction_bias_vl", None) is not None:
                reasons.append(f"layer {i}: a vision correction bias (e_score_correction_bias_vl) the router does "
                               "not take")
        else:
            for name in ("gate_up_proj", "down_proj"):
                q = quant(getattr(mlp, name))
                if q:
                    mlp_q.append(f"layer {i} mlp.{name}: {q}")
    if attn_q:
        reasons.append(f"quantised attention weights ({attn_q[0]}; {len(attn_q)} in all): the step reads "
                       "unquantised attention projections only")
    if absorbed:
        reasons.append(f"layers {absorbed[:4]}{'...' if len(absorbed) > 4 else ''} hold no unscaled absorbed "
                       "W_UK / W_UV (self_attn.w_kc / w_vc; post_load_weights not run, or quantised kv_b_proj)")
    if expert_q:
        reasons.append(f"routed experts the step can neither read nor hand to SGLang's experts module "
                       f"({expert_q[0]}; {len(expert_q)} layers in all)")
    if mlp_q:
        reasons.append(f"quantised MLP weights ({mlp_q[0]}): the step reads unquantised dense and shared-expert "
                       "MLPs only")
    if quant(lm.lm_head):
        reasons.append(f"quantised LM head ({quant(lm.lm_head)})")
    reasons += _tp_model_disable_reasons(lm)
    lp = lm.logits_processor
    if getattr(lp, "logit_scale", None) is not None or getattr(lp, "final_logit_softcapping", None):
        reasons.append("logit scale / final logit softcapping: the step's LM head applies neither")
    rope = getattr(lm.model.layers[0].self_attn, "rotary_emb", None)
    if rope is None or not hasattr(rope, "cos_sin_cache"):
        reasons.append("no rotary table (self_attn.rotary_emb.cos_sin_cache) to read")
    return reasons


def _tp_model_disable_reasons(lm) -> list[str]:
    """At SGLang's TP size > 1: what is not split the way our forward reduces it (each rank's attention heads,
    dense MLP and shared expert sharded on the TP group, their outputs summed by one all-reduce each)."""
    from sglang.srt.models.deepseek_v2 import DeepseekV2MoE
    from sglang.srt.runtime_context import get_parallel

    tp = int(get_parallel().tp_size)
    if tp == 1:
        return []
    reasons = []
    for i, layer in enumerate(lm.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn, "num_local_heads", None) is not None and attn.num_local_heads * tp != attn.num_heads:
            reasons.append(f"layer {i}: {attn.num_local_heads} attention heads on this rank of {attn.num_heads} "
                           f"at tp_size {tp} (attention TP differs from TP: DP attention)")
            break
        if isinstance(mlp, DeepseekV2MoE):
            if getattr(mlp, "_shared_expert_tp1", False):
                reasons.append(f"layer {i}: the shared expert is replicated (SGLANG_SHARED_EXPERT_TP1 or an "
                               "all-to-all MoE backend), the step's is tensor-parallel; unset SGLANG_SHARED_EXPERT_TP1")
                break
        elif mlp.gate_up_proj.output_size_per_partition * tp != mlp.gate_up_proj.output_size:
            reasons.append(f"layer {i}: the dense MLP is not split on the TP group (--moe-dense-tp-size); the step's "
                           "is tensor-parallel")
            break
    if getattr(lm.model.embed_tokens, "tp_size", tp) != tp or getattr(lm.lm_head, "tp_size", tp) != tp:
        reasons.append("the embedding or LM head is not split on the TP group (--enable-dp-lm-head); the step's "
                       "are vocabulary-parallel over the TP group")
    return reasons


# ------------------------------------------------------------------------------------------------------------
# config and weights


def model_config_from_hf(hf) -> ModelConfig:
    """Our :class:`~specverify.configs.ModelConfig` from SGLang's loaded HF config (DeepSeek-V3 fields)."""
    return ModelConfig(
        name=f"sglang-{(hf.architectures or [ARCHITECTURE])[0]}", source="SGLang's loaded model (hf_config)",
        hidden_size=hf.hidden_size, num_hidden_layers=hf.num_hidden_layers, vocab_size=hf.vocab_size,
        num_attention_heads=hf.num_attention_heads, attention="mla",
        num_key_value_heads=getattr(hf, "num_key_value_heads", hf.num_attention_heads),
        q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, intermediate_size=hf.intermediate_size,
        first_k_dense_replace=hf.first_k_dense_replace, n_routed_experts=hf.n_routed_experts,
        n_shared_experts=hf.n_shared_experts or 0, num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size, n_group=hf.n_group or 1, topk_group=hf.topk_group or 1,
        routed_scaling_factor=float(hf.routed_scaling_factor), scoring_func=hf.scoring_func,
        e_score_correction_bias=getattr(hf, "topk_method", "noaux_tc") == "noaux_tc",
        norm_topk_prob=bool(hf.norm_topk_prob), rms_norm_eps=hf.rms_norm_eps,
        rope_theta=float(getattr(hf, "rope_theta", 10000.0)),
    )


@dataclass
class WeightReport:
    """What :func:`read_weights` shared and copied."""

    shared_tensors: int = 0
    shared_bytes: int = 0
    copied_tensors: int = 0
    copied_bytes: int = 0  #: bytes written once at build (the expert stacks with the shared expert appended)
    held_extra_bytes: int = 0  #: bytes the step holds beyond SGLang's parameters after build


#: SGLang's compressed-tensors W4A16 MoE scheme whose loaded weights are already our int4 layout
#: (``CompressedTensorsWNA16TritonMoE``: its Triton runner, ``--moe-runner-backend triton``; Marlin's repacked
#: weights are not).
INT4_TRITON_SCHEME = "CompressedTensorsWNA16TritonMoE"


def int4_experts_quant(experts):
    """A :class:`specverify.moe.MoEQuant` for a ``FusedMoE`` whose routed experts SGLang holds in our int4 layout, or
    None. That is the case after ``CompressedTensorsWNA16TritonMoE.process_weights_after_loading`` (the layer's
    ``is_triton_converted``): ``w13_weight_packed`` uint8 [E, 2I, H / 2] and ``w2_weight_packed`` [E, H, I / 2] (the
    checkpoint's int32 words transposed and viewed as bytes, low nibble first) with ``w13_weight_scale`` [E, 2I, H /
    g] / ``w2_weight_scale`` [E, H, I / g], 4-bit, symmetric (code - 8), group size g a power of two. Anything else
    (Marlin's repacked weights, another bit width, zero points, channel-wise scales) gives None: those experts stay
    SGLang's module."""
    from specverify.moe import MoEQuant

    scheme = getattr(experts, "scheme", None)
    if type(scheme).__name__ != INT4_TRITON_SCHEME or not getattr(experts, "is_triton_converted", False):
        return None
    g = getattr(scheme, "group_size", None)
    if getattr(scheme, "num_bits", None) != 4 or not getattr(scheme, "sym", False) or \
            not isinstance(g, int) or g < 2 or g & (g - 1):
        return None
    names = ("w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale")
    tensors = [getattr(experts, n, None) for n in names]
    if any(t is None for t in tensors) or tensors[0].dtype != torch.uint8 or tensors[1].dtype != torch.uint8:
        return None
    return MoEQuant("int4", tensors[2].data, tensors[3].data, group_size=g)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _stack_shared_expert(experts, shared, report: WeightReport):
    """[E + 1, ...] stacks of the routed experts and the shared one (expert E); SGLang's parameters are re-pointed
    at views of the stacks (contiguous, same shapes), so the copy is made once and nothing is held twice."""
    e = experts.w13_weight.shape[0]
    w13_all = torch.cat([experts.w13_weight.data, shared.gate_up_proj.weight.data.unsqueeze(0)], 0)
    w2_all = torch.cat([experts.w2_weight.data, shared.down_proj.weight.data.unsqueeze(0)], 0)
    experts.w13_weight.data = w13_all[:e]
    experts.w2_weight.data = w2_all[:e]
    shared.gate_up_proj.weight.data = w13_all[e]
    shared.down_proj.weight.data = w2_all[e]
    report.copied_tensors += 2
    report.copied_bytes += _nbytes(w13_all) + _nbytes(w2_all)
    return w13_all, w2_all


def read_weights(model, config: ModelConfig, *, stack_shared_expert: bool,
                 sglang_experts: dict | None = None) -> tuple[dict, WeightReport]:
    """Our per-layer weight dicts (the layout of :class:`~specverify.forward.model.VerifyModel`) read from SGLang's
    loaded ``DeepseekV2ForCausalLM``, as views of its parameters wherever the layouts agree.

    ``stack_shared_expert``: build ``w13_all`` / ``w2_all`` (the shared expert as expert E) for an op table whose
    expert pass runs the shared expert; SGLang's expert parameters then view those stacks. Otherwise the routed
    stacks and the shared MLP are SGLang's tensors as they are.

    ``sglang_experts``: layer index -> the ``experts_fn`` (:func:`sglang_experts_fn`) of the MoE layers whose routed
    experts stay SGLang's module; their expert stacks are not read (``w13`` / ``w2`` None, no ``w13_all``), their
    shared expert is read as its own MLP.
    """
    from sglang.srt.models.deepseek_v2 import DeepseekV2MoE

    report = WeightReport()
    seen = set()

    def share(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            report.shared_tensors += 1
            report.shared_bytes += _nbytes(t)
        return t

    def share_shared_mlp(w: dict, shared) -> None:  # the shared expert as its own MLP, SGLang's tensors
        if shared is not None:
            w["shared_gate_up"] = share(shared.gate_up_proj.weight.data)
            w["shared_down"] = share(shared.down_proj.weight.data)

    c = config
    vocab = c.vocab_size
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    embed, lm_head = model.model.embed_tokens, model.lm_head
    if getattr(embed, "tp_size", 1) > 1:
        # this rank's shard of SGLang's padded vocabulary: rows [0, end - start) hold token ids [start, end)
        # (VocabParallelEmbedding.shard_indices; no added vocabulary), the rest padding (read whole: a rank may hold
        # padding only); the LM head keeps its whole padded shard, whose gathered logits SGLang (and
        # LoadedVerifyModel) cut to the vocabulary
        idx = embed.shard_indices
        if idx.num_added_elements:
            raise ValueError(f"the embedding holds {idx.num_added_elements} added (LoRA) vocabulary rows on this "
                             "rank; the step reads the original vocabulary only")
        vocab_range = (int(idx.org_vocab_start_index), int(idx.org_vocab_end_index))
        out = {"embed": share(embed.weight.data),
               "lm_head": share(lm_head.weight.data), "vocab_range": vocab_range}
    else:
        out = {"embed": share(embed.weight.data[:vocab]), "lm_head": share(lm_head.weight.data[:vocab])}
    out.update(final_norm=share(model.model.norm.weight.data), layers=[])
    for layer_index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        w = {"attn_norm": share(layer.input_layernorm.weight.data),
             "mlp_norm": share(layer.post_attention_layernorm.weight.data)}
        # q_a and kv_a are already one matrix in SGLang (fused_qkv_a_proj_with_mqa): our qkv_a as it is
        w["qkv_a"] = share(attn.fused_qkv_a_proj_with_mqa.weight.data)
        w["q_a"], w["kv_a"] = w["qkv_a"][: c.q_lora_rank], w["qkv_a"][c.q_lora_rank:]
        w["q_a_norm"] = share(attn.q_a_layernorm.weight.data)
        w["kv_a_norm"] = share(attn.kv_a_layernorm.weight.data)
        w["q_b"] = share(attn.q_b_proj.weight.data.view(-1, qk, c.q_lora_rank))  # [heads, nope + rope, q_lora]
        w["w_uk"] = share(attn.w_kc)  # [heads, nope, kv_lora] (strided view of kv_b_proj's absorbed half)
        w["w_uv"] = share(attn.w_vc)  # [heads, kv_lora, v]
        w["o"] = share(attn.o_proj.weight.data)
        mlp = layer.mlp
        if not isinstance(mlp, DeepseekV2MoE):
            w["dense"] = True
            w["gate_up"] = share(mlp.gate_up_proj.weight.data)
            w["down"] = share(mlp.down_proj.weight.data)
        else:
            w["dense"] = False
            e = c.n_routed_experts
            w["router"] = share(mlp.gate.weight.data)
            bias = mlp.gate.e_score_correction_bias
            w["bias"] = None if bias is None else share(bias.data)
            experts, shared = mlp.experts, mlp.shared_experts
            if layer_index in (sglang_experts or {}):  # the experts stay SGLang's module (quantised, or asked)
                w["experts_fn"] = sglang_experts[layer_index]
                w["w13"] = w["w2"] = None
                share_shared_mlp(w, shared)
            elif (quant := int4_experts_quant(experts)) is not None:
                # int4 experts SGLang holds in our layout: our int4 kernels over its tensors
                w["w13"], w["w2"] = share(experts.w13_weight_packed.data), share(experts.w2_weight_packed.data)
                w["w13_scale"], w["w2_scale"] = share(quant.w13_scale), share(quant.w2_scale)
                w["quant"] = quant
                share_shared_mlp(w, shared)  # unquantised, apart (Kimi-K2.5 leaves its shared expert in bf16)
            elif mlp.num_fused_shared_experts:  # SGLang already appended the shared expert(s) to the stacks
                w["w13_all"] = share(experts.w13_weight.data)
                w["w2_all"] = share(experts.w2_weight.data)
                if mlp.num_fused_shared_experts == 1:
                    w["shared_gate_up"], w["shared_down"] = w["w13_all"][e], w["w2_all"][e]
                w["w13"], w["w2"] = w["w13_all"][:e], w["w2_all"][:e]
            elif shared is not None and stack_shared_expert and \
                    shared.gate_up_proj.weight.shape[0] == experts.w13_weight.shape[1]:
                w["w13_all"], w["w2_all"] = _stack_shared_expert(experts, shared, report)
                w["w13"], w["w2"] = w["w13_all"][:e], w["w2_all"][:e]
                w["shared_gate_up"], w["shared_down"] = w["w13_all"][e], w["w2_all"][e]
            else:
                w["w13"], w["w2"] = share(experts.w13_weight.data), share(experts.w2_weight.data)
                share_shared_mlp(w, shared)
            w["route"] = RouteParams(c.num_experts_per_tok, c.scoring_func, w["bias"], c.n_group, c.topk_group,
                                     c.norm_topk_prob, c.routed_scaling_factor, e)
        out["layers"].append(w)
    return out, report


def sglang_experts_fn(mlp):
    """The ``experts_fn`` (see :meth:`~specverify.forward.model.VerifyModel._mlp`) of a ``DeepseekV2MoE`` layer
    whose routed experts stay SGLang's: our routing handed to the layer's own ``FusedMoE`` forward (dispatcher, then
    ``quant_method.apply``, then combine) as the ``StandardTopKOutput`` SGLang's ``TopK`` would give it.

    SGLang's convention for the routed scaling factor is the module's: the top-k weights carry it only where the
    experts fuse it into the top-k (``routed_scaling_factor_fused_in_topk``), else the experts' runner applies it
    (Triton, Marlin on CUDA) or ``DeepseekV2MoE.forward_normal`` multiplies afterwards (the CPU path, KTransformers);
    ``maybe_fuse_routed_scale_and_shared_add`` scales for the MXFP4 methods that defer it. Our weights carry the
    factor, so they are divided by it where the module expects them without, and the output gets the post-scale
    ``forward_normal`` applies. A runner that may write its output over its input (``moe_runner_config.inplace``)
    gets a copy: our shared expert reads the input afterwards.

    Raises
    ------
    ValueError
        The layer's experts cannot take our routing (:func:`sglang_experts_disable_reason` says why).
    """
    from sglang.srt.layers.moe.kt_ep_wrapper import KTEPWrapperMethod
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.quantization.mxfp4_flashinfer_trtllm_moe import maybe_fuse_routed_scale_and_shared_add
    from sglang.srt.models import deepseek_v2 as dsv2

    why = sglang_experts_disable_reason(mlp)
    if why:
        raise ValueError(f"layer {mlp.layer_id}'s routed experts cannot run through SGLang's module: {why}")
    experts = mlp.experts
    scale = float(mlp.routed_scaling_factor)
    in_topk = bool(getattr(mlp, "routed_scaling_factor_fused_in_topk", False))
    # the post-scale condition of DeepseekV2MoE.forward_normal (sglang/srt/models/deepseek_v2.py), on its flags
    on = {name: bool(getattr(dsv2, name, False)) for name in ("_is_cuda", "_is_musa", "_is_xpu", "_use_aiter")}
    post_scale = (not (on["_is_cuda"] or on["_is_musa"] or on["_is_xpu"]) and not (on["_use_aiter"] and in_topk)) \
        or isinstance(experts.quant_method, KTEPWrapperMethod)
    inplace = bool(experts.moe_runner_config.inplace)

    def run(hidden, ids, weights, router_logits):
        topk = StandardTopKOutput(topk_weights=weights if in_topk else weights / scale, topk_ids=ids,
                                  router_logits=router_logits)
        out = experts(hidden.clone() if inplace else hidden, topk)
        if post_scale:
            out = out * scale
        return maybe_fuse_routed_scale_and_shared_add(experts, out, None, scale)

    return run


def sglang_collectives():
    """The collectives :class:`~specverify.forward.step.LoadedVerifyModel` calls at TP > 1: SGLang's own
    ``tensor_model_parallel_all_reduce`` / ``tensor_model_parallel_all_gather`` (its TP ``GroupCoordinator``, so
    its custom all-reduce, PyNccl / symmetric-memory paths and graph-capture handling serve ours), the calls
    SGLang's DeepseekV2 makes at the same places: after attention (its ``o_proj`` does not reduce; the layer
    boundary does), after the MoE (routed plus shared expert, one reduce), in the vocabulary-parallel embedding and
    in the logits processor's gather."""
    from types import SimpleNamespace

    from sglang.srt.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce

    return SimpleNamespace(all_reduce=tensor_model_parallel_all_reduce,
                           all_gather=lambda x, dim: tensor_model_parallel_all_gather(x, dim))


class VerifyStep:
    """The object :func:`build_step` returns (SGLang's ``BuiltMegakernel``): our verify forward over SGLang's
    weights, planned and run per step.

    ``model`` is what SGLang wraps the forward of: a ``DeepseekV3ForCausalLM``, or a wrapper of :data:`WRAPPERS`
    (Kimi-K2.5), whose language model (:func:`language_model`) and ``hf_config.text_config`` the step reads.
    ``experts``: ``auto`` runs the routed experts ours where we read their format (unquantised, or int4 held in our
    layout by SGLang's Triton W4A16 runner: :func:`int4_experts_quant`) and through the layer's SGLang module
    otherwise (:func:`sglang_experts_fn`); ``sglang`` sends every MoE layer's routed experts through its SGLang
    module.

    Attributes
    ----------
    widths : tuple[int, ...]
        The step widths (rows) built: every one SGLang asked for.
    calls : collections.Counter
        Steps run by mode (``target_verify``, ``decode``); tests read it to prove our forward ran.
    weights : WeightReport
    sglang_expert_layers : dict[int, str]
        MoE layers whose routed experts stay SGLang's module -> the name of its quant method.
    """

    draft_sampler = None

    def __init__(self, model, hf_config, context, *, provider: str = "auto", experts: str = "auto"):
        from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod
        from sglang.srt.models.deepseek_v2 import DeepseekV2MoE

        self.widths = tuple(context.widths)
        self.tokens = int(context.tokens_per_request)
        self.hf_config = hf_config
        self.architecture = type(model).__name__
        lm = language_model(model)
        if lm is None:
            raise ValueError(f"{self.architecture} holds no language model (an encoder-only config); the step "
                             "needs one")
        self._model = lm
        self.wrapped = lm is not model
        # what the replaced forward takes after (input_ids, positions, forward_batch), by position
        self._extra_args = ("get_embedding", "pp_proxy_tensors") if self.wrapped else ("input_embeds",
                                                                                       "pp_proxy_tensors")
        self.config = model_config_from_hf(text_config(hf_config))
        attn = lm.model.layers[0].self_attn
        ref = lm.model.embed_tokens.weight
        self.dtype, self.device = ref.dtype, ref.device
        if provider == "auto":
            provider = "specverify" if self.device.type == "cuda" else "reference"
        if provider not in ("reference", "specverify"):
            raise ValueError(f"provider must be 'auto', 'reference' or 'specverify', got {provider!r}")
        if experts not in EXPERTS:
            raise ValueError(f"experts must be one of {EXPERTS}, got {experts!r}")
        self.provider, self.experts = provider, experts
        base, self.ops_note = provider_ops(provider, None)  # neither table reads the model
        ops = model_ops(base, attn.rotary_emb.cos_sin_cache, bool(attn.rotary_emb.is_neox_style),
                        float(attn.scaling))
        fns, self.sglang_expert_layers = {}, {}
        for i, layer in enumerate(lm.model.layers):
            mlp = layer.mlp
            if isinstance(mlp, DeepseekV2MoE) and (
                    experts == "sglang" or (not isinstance(mlp.experts.quant_method, UnquantizedFusedMoEMethod)
                                            and int4_experts_quant(mlp.experts) is None)):
                fns[i] = sglang_experts_fn(mlp)
                self.sglang_expert_layers[i] = type(mlp.experts.quant_method).__name__
        # the stacks with the shared expert serve experts_with_shared (and the table's route_shared, which writes the
        # shared slot in the router); layers with an experts_fn get no stack and take the plain route
        weights, self.weights = read_weights(lm, self.config, stack_shared_expert=ops.experts_with_shared is not None,
                                             sglang_experts=fns)
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        self.tp_size, self.tp_rank = int(parallel.tp_size), int(parallel.tp_rank)
        # TP: this rank's shards (read_weights), SGLang's TP group for every collective (sglang_collectives)
        self.verify_model = LoadedVerifyModel(self.config, weights, dtype=self.dtype, device=self.device, ops=ops,
                                              tp=self.tp_size, rank=self.tp_rank,
                                              collectives=sglang_collectives() if self.tp_size > 1 else None)
        self.weights.held_extra_bytes += self.verify_model.folded_bytes  # q_b's folded copies
        if self.tp_size > 1:  # our loop's collectives (the op table's allreduce is not called)
            ops.pieces["allreduce"] = "SGLang's TP group (tensor_model_parallel_all_reduce / all_gather)"
        self.calls = collections.Counter()

    def summary(self) -> str:
        """The startup line: what runs as ours, what stays SGLang's, the weights shared / copied."""
        w = self.weights
        steps = f"TARGET_VERIFY (k={self.tokens}, chains and trees)" if self.tokens > 1 else "decode"
        pieces = ", ".join(f"{k}={v}" for k, v in self.verify_model.ops.pieces.items())
        theirs = ["every other forward mode", "sampling", "acceptance"]
        experts = "experts + shared expert"
        if self.sglang_expert_layers:
            layers = sorted(self.sglang_expert_layers)
            methods = ", ".join(sorted(set(self.sglang_expert_layers.values())))
            theirs.append(f"the routed experts of {len(layers)} MoE layers ({layers[0]}..{layers[-1]}) on our "
                          f"routing, through their FusedMoE ({methods})")
            moe = sum(not layer["dense"] for layer in self.verify_model.layers)
            experts = "shared expert" if len(layers) == moe else "the other layers' experts + shared expert"
        int4 = sum(layer.get("quant") is not None for layer in self.verify_model.layers)
        if int4:
            experts += f" (int4 in {int4} MoE layers: our kernels over SGLang's tensors)"
        if self.wrapped:
            theirs.append("the vision tower and every batch carrying multimodal inputs")
        return (f"ours ({self.architecture}, TP {self.tp_size}, rank {self.tp_rank}): {steps}: embedding, "
                f"{self.config.num_hidden_layers} layers (MLA tree "
                f"attention, MoE routing + {experts}, dense MLP, norms), LM head; op table {self.provider} "
                f"({pieces}); SGLang's: {', '.join(theirs)}; weights: {w.shared_tensors} tensors "
                f"shared ({w.shared_bytes / _MiB:.1f} MiB), {w.copied_tensors} copied once "
                f"({w.copied_bytes / _MiB:.1f} MiB, SGLang's parameters re-pointed at them), "
                f"{w.held_extra_bytes / _MiB:.1f} MiB held extra")

    # plan (host only) ---------------------------------------------------------------------------------------
    def plan(self, input_ids, forward_batch, *args, **kwargs):
        """Step("target_verify" | "decode", rows) for the steps we cover, None for SGLang's own forward (also for
        any extra input the replaced forward takes: input embeddings, pipeline proxies, an embedding request; and,
        for a wrapper, a batch carrying multimodal inputs or input embeddings)."""
        if len(args) > len(self._extra_args):
            return None
        extra = {**dict(zip(self._extra_args, args)), **kwargs}
        if any(v is not None and v is not False for v in extra.values()):
            return None
        if self.wrapped and (forward_batch.contains_mm_inputs() or
                             getattr(forward_batch, "input_embeds", None) is not None):
            return None  # image / video / audio embeddings are SGLang's (module notes)
        rows = int(input_ids.shape[0])
        mode = forward_batch.forward_mode
        if rows == 0 or rows > MAX_ROWS:
            return None
        if mode.is_target_verify():
            spec = forward_batch.spec_info
            if spec is None or not hasattr(spec, "retrieve_next_token") or \
                    int(spec.draft_token_num) != self.tokens or rows % self.tokens:
                return None
            return Step(mode="target_verify", rows=rows)
        if mode.is_decode() and self.tokens == 1:
            return Step(mode="decode", rows=rows)
        return None

    # forward -------------------------------------------------------------------------------------------------
    def _latent_caches(self, pool):
        """Per layer, the pool's latent buffer [slots, 1, kv_lora + rope] as our one-cache list; built once per
        pool (the buffers live as long as it), not on every eager step."""
        if getattr(self, "_caches_pool", None) is not pool:
            # KvPoolView offers no accessor for MLA latent buffers (see module notes): the pool's own
            bufs = (pool.get_key_buffer(layer) for layer in range(self.config.num_hidden_layers))
            self._caches = [[buf.view(buf.shape[0], 1, buf.shape[-1])] for buf in bufs]
            self._caches_pool = pool
        return self._caches

    def _inputs(self, step, input_ids, positions, forward_batch):
        view = step.view
        k = self.tokens if step.mode == "target_verify" else 1
        b = step.rows // k
        meta = view.metadata
        seq_lens = forward_batch.seq_lens[:b]
        prefix = (seq_lens if step.mode == "target_verify" else seq_lens - 1).to(torch.int32)
        cpu = forward_batch.seq_lens_cpu
        if cpu is not None and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            longest = int(cpu[:b].max()) + (k if step.mode == "target_verify" else 0)
        else:  # a graph: the widest request the attention metadata can describe
            longest = int(meta.kv_indices.numel()) + k
        table = page_table_from_metadata(meta.kv_indptr, meta.kv_indices, forward_batch.out_cache_loc[: b * k],
                                         prefix, k, slot_table_width(longest))
        caches = self._latent_caches(view.kv_pool.pool)
        tree_mask = None
        if step.mode == "target_verify" and int(forward_batch.spec_info.topk) > 1:
            spec = forward_batch.spec_info
            tree_mask = tree_mask_from_links(spec.retrieve_next_token[:b], spec.retrieve_next_sibling[:b])
        return (input_ids.view(b, k), positions.view(b, k), caches, table, prefix, tree_mask)

    def forward(self, step, original, input_ids, positions, forward_batch, *args, **kwargs):
        """Run ``step`` in place of the model's forward; returns what it returns (a ``LogitsProcessorOutput``)."""
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        ids, pos, caches, table, prefix, tree_mask = self._inputs(step, input_ids, positions, forward_batch)
        capture = tuple(self._model.model.layers_to_capture) if self._model.capture_aux_hidden_states else ()
        logits, hidden, aux = self.verify_model.forward_captured(ids, pos, caches, table, prefix, tree_mask,
                                                                 capture_layers=capture)
        self.calls[step.mode] += 1
        rows = step.rows
        logits = logits.view(rows, -1)
        buffer = getattr(forward_batch, "next_token_logits_buffer", None)
        if buffer is not None and tuple(buffer.shape) == tuple(logits.shape) and buffer.dtype == torch.float32:
            buffer.copy_(logits)
            logits = buffer
        mode = forward_batch.capture_hidden_mode
        hidden = hidden.view(rows, -1)
        stored = last = None
        if mode is not None and mode.need_capture():
            if capture:
                stored = torch.cat([a.reshape(rows, -1) for a in aux], -1) if len(aux) > 1 else \
                    aux[0].reshape(rows, -1)
                if mode.is_full() and getattr(self._model.logits_processor, "keep_last_hidden_states", False):
                    last = hidden
            else:
                stored = hidden
        return LogitsProcessorOutput(next_token_logits=logits, hidden_states=stored, last_hidden_states=last,
                                     mm_input_embeds=getattr(forward_batch, "mm_input_embeds", None))


def build_step(model, hf_config, context, *, provider: str = "auto", experts: str = "auto") -> VerifyStep:
    """SGLang's ``build``: our forward over the loaded model's weights (see :class:`VerifyStep`)."""
    start = time.perf_counter()
    step = VerifyStep(model, hf_config, context, provider=provider, experts=experts)
    logger.info("specverify verify step built in %.1f s: %s", time.perf_counter() - start, step.summary())
    return step


#: The spec SGLang's registry imports (:data:`SPEC_PATH`).
SPEC = MegakernelSpec(
    name=SPEC_NAME,
    requires=Requirements(isas=frozenset({"sm_90", "sm_120"}), tp_sizes=TP_SIZES,
                          dtypes=frozenset({"bfloat16"})),
    features=frozenset({Feature.SPECULATIVE_DECODING}),
    numerics=Numerics(kind=NumericsKind.TOLERANCE, tolerances=TOLERANCES),
    max_rows=MAX_ROWS,
    build=build_step,
    api_version=MEGAKERNEL_API_VERSION,
    model_disable_reasons=model_disable_reasons,
    config_disable_reasons=config_disable_reasons,
)
