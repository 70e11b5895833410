"""(c) SGLang runs our whole verify step (``--enable-nvidia-megakernel``): SGLang's real ``DeepseekV3ForCausalLM``
built from a tiny config (``dsv3_harness.py``), the spec installed through SGLang's own ``install_megakernel``, and
SGLang's own forward and ours run on the same batch.

Every comparison runs SGLang's forward first (its KV write is the reference), poisons the draft tokens' KV slots
with NaN, then runs the installed forward (ours): logits, hidden states and the KV written must agree within the
spec's declared :data:`~specverify.integrations.sglang_step.TOLERANCES`, greedy tokens exactly; and the test fails
if SGLang's layer loop ran during our step (``layer_calls``) or our forward did not (``calls``).

Sizes and why: two requests with different prefixes (5 and 11 tokens; 13 with page size 16, so the draft tokens
cross a page); 4 draft tokens (a tree with a sibling pair and a grandchild, and a chain); 3 layers (a dense layer
0, two MoE layers with 16 experts, top-4, one shared expert); kv_lora_rank 64 (and Kimi-K2's 512); n_group 1 (and
DeepSeek-V3's grouped routing, 4 groups, top-2). One harness lives at a time (SGLang's runtime context is global).

Kimi-K2.5: SGLang's real ``KimiK25ForConditionalGeneration`` (a one-layer MoonViT, the same tiny language model as
its ``text_config``) through the same binding. Routed experts that stay SGLang's: the unquantised ones forced through
the layer's ``FusedMoE`` (``experts="sglang"``), and a stand-in quant method (the real Marlin / FP8 block kernels
need CUDA) that delegates to the unquantised one and counts its ``apply`` calls.

Tensor parallel: two processes (``tp_worker.py``), each SGLang's real model at TP 2 over a gloo world on the CPU (its
own shards drawn from a seed of its rank, the replicated weights alike), SGLang's forward and ours compared on each
rank, and every collective of ours counted on SGLang's TP group coordinator.
"""
from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed: run in the venv made by .ci/sglang_env.sh")

from dsv3_harness import Dsv3Harness, interpreter_bf16_dot  # noqa: E402

from specverify.integrations import sglang_step as step  # noqa: E402
from specverify.tree import DraftTree  # noqa: E402

PREFIX = (5, 11)
TREES = (DraftTree([-1, 0, 0, 1]), DraftTree([-1, 0, 1, 0]))  # different trees per request
CHAIN = (DraftTree.chain(4), DraftTree.chain(4))

_CURRENT: dict = {}


def harness(key, **kwargs) -> Dsv3Harness:
    """The harness for ``key``, built on first use; the previous one is closed (one at a time)."""
    if _CURRENT.get("key") != key:
        if "h" in _CURRENT:
            _CURRENT.pop("h").close()
        prefix = kwargs.pop("prefix", PREFIX)
        _CURRENT.update(key=key, h=Dsv3Harness(**kwargs))
        _CURRENT["h"].prefill(prefix)
    return _CURRENT["h"]


@pytest.fixture(scope="module", autouse=True)
def _close_last():
    yield
    if "h" in _CURRENT:
        _CURRENT.pop("h").close()
        _CURRENT.clear()


def compare(h, fb, dtype_tag="fp32", count=None):
    """SGLang's forward, then ours (installed) on the same batch; returns (sglang_out, our_out, stats).
    ``count``: a callable counting something (SGLang expert calls); ``stats["counted"]`` is its increase during our
    forward."""
    locs = fb.out_cache_loc.tolist()
    ref = h.run(fb, h.sglang_forward)
    kv_ref = h.kv_rows(locs)
    h.poison(locs)
    calls, layer_calls = sum(h.built.calls.values()), h.layer_calls
    counted = count() if count else 0
    out = h.run(fb)
    counted = (count() if count else 0) - counted
    assert h.layer_calls == layer_calls, "SGLang's own layer loop ran during the step: our forward did not replace it"
    assert sum(h.built.calls.values()) == calls + 1, "our verify forward did not run"
    kv = h.kv_rows(locs)
    assert not torch.isnan(kv).any(), "our forward left draft KV slots unwritten"
    a, b = ref.next_token_logits.float(), out.next_token_logits.float()
    assert b.shape == a.shape and b.dtype == torch.float32
    scale = a.abs().max().item()
    stats = {"logits": (a - b).abs().max().item() / scale,
             "kv": (kv_ref.float() - kv.float()).abs().max().item() / kv_ref.float().abs().max().item(),
             "greedy_mismatches": int((a.argmax(-1) != b.argmax(-1)).sum()), "counted": counted}
    if ref.hidden_states is not None:
        assert out.hidden_states is not None and out.hidden_states.shape == ref.hidden_states.shape
        hs = ref.hidden_states.float()
        stats["hidden"] = (hs - out.hidden_states.float()).abs().max().item() / hs.abs().max().item()
    tol = step.TOLERANCES[f"logits_max_rel_{dtype_tag}"]
    assert stats["logits"] <= tol, stats
    assert stats["kv"] <= tol, stats
    if dtype_tag == "fp32":
        assert stats["greedy_mismatches"] == 0, stats
        if "hidden" in stats:
            assert stats["hidden"] <= step.TOLERANCES["hidden_max_rel_fp32"], stats
    print(f"measured ({dtype_tag}):", stats)
    return ref, out, stats


# ------------------------------------------------------------------------------------------------------------
# registration and the declared contract


def test_entry_point_registers_the_spec(sglang_loaded):
    import importlib.metadata

    from sglang.kernels.plugin_kernels.nvidia import spec as mk
    from sglang.srt.kernel_plugins.nvidia import binding

    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert eps.get(mk.ENTRY_POINT) == "specverify.integrations.sglang_step:register"
    assert eps.get("specverify") == "specverify.integrations.sglang:register"  # the attention-backend plugin stays
    assert binding.plugin_reasons() == []
    for architecture in ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"):
        found, why = mk.find_spec(architectures=[architecture], isa="sm_90")
        assert found is step.SPEC, (architecture, why)


def test_spec_declares_what_it_serves():
    from sglang.kernels.plugin_kernels.nvidia.spec import Feature, NumericsKind

    s = step.SPEC
    assert s.features == frozenset({Feature.SPECULATIVE_DECODING})
    assert s.requires.isas == {"sm_90", "sm_120"} and s.requires.tp_sizes == {1, 2, 4, 8} == step.TP_SIZES
    assert s.requires.dtypes == {"bfloat16"}
    assert s.numerics.kind is NumericsKind.TOLERANCE and s.numerics.tolerances == step.TOLERANCES


# ------------------------------------------------------------------------------------------------------------
# TARGET_VERIFY through the binding: ours against SGLang's own forward


def test_tree_verify_fp32_matches_sglang(sglang_loaded):
    h = harness("fp32-tree", dtype=torch.float32, tokens=4, topk=2)
    assert isinstance(h.built, step.VerifyStep)
    ref, out, _ = compare(h, h.verify_batch(PREFIX, TREES))
    assert out.hidden_states is not None  # EAGLE reads them (capture_hidden_mode FULL)


def test_tree_server_with_a_chain_shaped_batch(sglang_loaded):
    # topk 2 server, this step's draft happens to be a chain: the mask is built from the links, not assumed
    h = harness("fp32-tree", dtype=torch.float32, tokens=4, topk=2)
    compare(h, h.verify_batch(PREFIX, CHAIN, seed=1))


def test_the_tree_mask_is_used(sglang_loaded):
    # negative control: the same tokens as a chain give other logits at a node whose ancestors differ
    h = harness("fp32-tree", dtype=torch.float32, tokens=4, topk=2)
    tree = h.run(h.verify_batch(PREFIX, TREES, seed=2)).next_token_logits
    chain = h.run(h.verify_batch(PREFIX, CHAIN, seed=2)).next_token_logits
    assert (tree.view(2, 4, -1)[0, 2] - chain.view(2, 4, -1)[0, 2]).abs().max() > 1e-3


def test_hidden_states_last_and_null(sglang_loaded):
    h = harness("fp32-tree", dtype=torch.float32, tokens=4, topk=2)
    _, out, _ = compare(h, h.verify_batch(PREFIX, TREES, seed=3, capture="last"))
    assert out.hidden_states is not None
    ref, out, _ = compare(h, h.verify_batch(PREFIX, TREES, seed=4, capture=None))
    assert ref.hidden_states is None and out.hidden_states is None


@pytest.mark.parametrize("key, kimi", [("fp32-tree", False), ("kimi-tree", True)])
def test_eagle3_aux_hidden_states(sglang_loaded, key, kimi):
    h = harness(key, dtype=torch.float32, tokens=4, topk=2, **({"kimi": True} if kimi else {}))
    # the embedding and layer 2's input (a Kimi-K2.5 wrapper hands the request to its language model)
    h.model.set_eagle3_layers_to_capture([0, 2])
    try:
        _, out, _ = compare(h, h.verify_batch(PREFIX, TREES, seed=5))
        assert out.hidden_states.shape == (8, 2 * h.cfg["hidden_size"])
    finally:
        h.lm.capture_aux_hidden_states = False
        h.lm.model.layers_to_capture = []


def test_extend_stays_sglangs(sglang_loaded):
    h = harness("fp32-tree", dtype=torch.float32, tokens=4, topk=2)
    calls, layer_calls = sum(h.built.calls.values()), h.layer_calls
    _ids, out = h.prefill((3,), seed=7)
    assert h.layer_calls == layer_calls + 1 and sum(h.built.calls.values()) == calls
    h.prefill(PREFIX)  # restore request slot 0's prefix for later tests


def test_weights_are_sglangs_storage(sglang_loaded):
    h = harness("fp32-tree", dtype=torch.float32, tokens=4, topk=2)
    vm, m = h.built.verify_model, h.model
    attn = m.model.layers[1].self_attn
    w = vm.layers[1]
    assert w["qkv_a"].data_ptr() == attn.fused_qkv_a_proj_with_mqa.weight.data_ptr()
    assert w["w_uk"].data_ptr() == attn.w_kc.data_ptr() and w["w_uv"].data_ptr() == attn.w_vc.data_ptr()
    assert w["router"].data_ptr() == m.model.layers[1].mlp.gate.weight.data_ptr()
    assert w["bias"].data_ptr() == m.model.layers[1].mlp.gate.e_score_correction_bias.data_ptr()
    assert vm.lm_head.data_ptr() == m.lm_head.weight.data_ptr()
    assert h.built.weights.copied_bytes == 0  # the reference op table runs the shared expert as its own MLP


def test_chain_server_fp32_matches_sglang(sglang_loaded):
    h = harness("fp32-chain", dtype=torch.float32, tokens=4, topk=1)
    compare(h, h.verify_batch(PREFIX, CHAIN))


@pytest.mark.parametrize("key, config", [
    ("kv512", {"kv_lora_rank": 512}),                             # Kimi-K2's latent width
    ("grouped", {"n_group": 4, "topk_group": 2}),                 # DeepSeek-V3's grouped routing
])
def test_tree_verify_other_shapes(sglang_loaded, key, config):
    h = harness(key, dtype=torch.float32, tokens=4, topk=2, **config)
    compare(h, h.verify_batch(PREFIX, TREES))


def test_paged_pool_crossing_a_page(sglang_loaded):
    # page size 16: request 1's drafts sit at positions 13..16, across its first page boundary
    h = harness("paged", dtype=torch.float32, tokens=4, topk=2, page_size=16, prefix=(5, 13))
    compare(h, h.verify_batch((5, 13), TREES))


def test_decode_step_matches_sglang(sglang_loaded):
    # kv_lora_rank 512: SGLang's Triton MLA decode kernel does not build for a 64-wide latent under the interpreter
    h = harness("decode", dtype=torch.float32, tokens=None, topk=None, kv_lora_rank=512)
    assert h.built.tokens == 1
    compare(h, h.decode_batch(PREFIX))
    assert h.built.calls["decode"] == 1


def test_bf16_specverify_kernels_match_sglang(sglang_loaded):
    # our Triton kernels (interpreter) in bf16: the expert pass with the shared expert appended, SGLang's expert
    # parameters re-pointed at the stacks (copied once); SGLang's forward runs on the same re-pointed weights
    with interpreter_bf16_dot():
        import msgspec

        spec = msgspec.structs.replace(step.SPEC, build=functools.partial(step.build_step, provider="specverify"))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(step, "SPEC", spec)
            h = harness("bf16-specverify", dtype=torch.bfloat16, tokens=4, topk=2)
        assert h.built.provider == "specverify"
        assert h.built.weights.copied_tensors == 4 and h.built.weights.held_extra_bytes == h.built.verify_model.folded_bytes
        moe = h.model.model.layers[1].mlp
        w = h.built.verify_model.layers[1]
        assert moe.experts.w13_weight.data_ptr() == w["w13_all"].data_ptr()
        assert moe.shared_experts.gate_up_proj.weight.data_ptr() == w["w13_all"][-1].data_ptr()
        compare(h, h.verify_batch(PREFIX, TREES), dtype_tag="bf16")


def test_bf16_error_is_within_twice_sglangs_own(sglang_loaded):
    # the tolerance derived, not guessed: against an fp32 forward over the same (bf16-rounded) weights and tokens,
    # our bf16 step errs at most twice what SGLang's own bf16 forward errs, plus a floor
    h = harness("fp32-rounded", dtype=torch.float32, tokens=4, topk=2, megakernel=False,
                round_weights_to=torch.bfloat16)
    exact = h.run(h.verify_batch(PREFIX, TREES)).next_token_logits.float()
    with interpreter_bf16_dot():
        h = harness("bf16", dtype=torch.bfloat16, tokens=4, topk=2)
        _, ours_out, _ = compare(h, h.verify_batch(PREFIX, TREES), dtype_tag="bf16")
        sglang = h.run(h.verify_batch(PREFIX, TREES), h.sglang_forward).next_token_logits.float()
    ours = ours_out.next_token_logits.float()
    scale = exact.abs().max().item()
    err_sglang = (sglang - exact).abs().max().item() / scale
    err_ours = (ours - exact).abs().max().item() / scale
    print(f"bf16 vs fp32: sglang {err_sglang:.3g}, ours {err_ours:.3g}")
    ratio = step.TOLERANCES["bf16_error_vs_sglang_bf16_error"]
    assert err_ours <= ratio * err_sglang + 1e-3, (err_ours, err_sglang)


# ------------------------------------------------------------------------------------------------------------
# Kimi-K2.5: SGLang's KimiK25ForConditionalGeneration around the same language model


def test_kimi_tree_verify_fp32_matches_sglang(sglang_loaded):
    from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration

    h = harness("kimi-tree", dtype=torch.float32, tokens=4, topk=2, kimi=True)
    assert isinstance(h.model, KimiK25ForConditionalGeneration) and h.lm is h.model.language_model
    assert h.built.wrapped and step.language_model(h.model) is h.lm
    assert step.model_disable_reasons(h.model, h.model_config.hf_config) == []
    assert "KimiK25ForConditionalGeneration" in h.built.summary() and "vision tower" in h.built.summary()
    w = h.built.verify_model.layers[1]
    assert w["qkv_a"].data_ptr() == h.lm.model.layers[1].self_attn.fused_qkv_a_proj_with_mqa.weight.data_ptr()
    ref, out, _ = compare(h, h.verify_batch(PREFIX, TREES))
    assert type(out) is type(ref) and out.hidden_states is not None  # what the wrapper's forward returns


def test_kimi_multimodal_batch_stays_sglangs(sglang_loaded):
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalInputs

    h = harness("kimi-tree", dtype=torch.float32, tokens=4, topk=2, kimi=True)
    fb = h.verify_batch(PREFIX, TREES, seed=6)
    assert h.built.plan(fb.input_ids, fb) is not None  # the batch without images is ours
    assert h.built.plan(fb.input_ids, fb, False) is not None  # get_embedding=False, by position
    assert h.built.plan(fb.input_ids, fb, get_embedding=True) is None  # an embedding request is SGLang's
    # request 0 carries an image (its prefix holds the image tokens' KV); request 1 none
    fb.mm_inputs = [MultimodalInputs(mm_items=[MultimodalDataItem(modality=Modality.IMAGE)]), None]
    assert fb.contains_mm_inputs()
    assert h.built.plan(fb.input_ids, fb) is None
    calls, layer_calls = sum(h.built.calls.values()), h.layer_calls
    out = h.run(fb)  # through the installed dispatch: SGLang's own wrapper forward runs
    assert h.layer_calls == layer_calls + 1 and sum(h.built.calls.values()) == calls
    assert out.next_token_logits.shape == (8, h.cfg["vocab_size"])


# ------------------------------------------------------------------------------------------------------------
# routed experts that stay SGLang's: our routing through the layer's own FusedMoE and quant method


def _count_expert_forwards(lm):
    """A callable counting the forwards of every MoE layer's SGLang experts module (forward hooks)."""
    runs = []
    for layer in lm.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts.register_forward_hook(lambda *args: runs.append(1))
    return lambda: len(runs)


def test_sglang_experts_path_fp32_matches_sglang(sglang_loaded):
    # unquantised experts forced through SGLang's FusedMoE (its CPU path, moe_forward_native) on our routing
    import msgspec

    spec = msgspec.structs.replace(step.SPEC, build=functools.partial(step.build_step, experts="sglang"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step, "SPEC", spec)
        h = harness("fp32-sglang-experts", dtype=torch.float32, tokens=4, topk=2)
    built = h.built
    assert built.experts == "sglang" and sorted(built.sglang_expert_layers) == [1, 2]
    for i in (1, 2):
        w = built.verify_model.layers[i]
        assert "experts_fn" in w and "w13_all" not in w and w["w13"] is None and "shared_gate_up" in w
    assert "layers (1..2) on our routing, through their FusedMoE (UnquantizedFusedMoEMethod)" in built.summary()
    count = _count_expert_forwards(h.lm)
    _, _, stats = compare(h, h.verify_batch(PREFIX, TREES), count=count)
    assert stats["counted"] == 2, "SGLang's experts modules did not run inside our forward"
    _, _, stats = compare(h, h.verify_batch(PREFIX, CHAIN, seed=1), count=count)
    assert stats["counted"] == 2


class _CountingMoEMethod(torch.nn.Module):
    """Stands for a quantised FusedMoE method (Marlin W4A16, FP8 block; their kernels need CUDA): delegates to the
    layer's unquantised method and counts its ``apply`` calls. Every other attribute is the wrapped method's."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.applied = 0

    def apply(self, layer, dispatch_output):
        self.applied += 1
        return self.inner.apply(layer=layer, dispatch_output=dispatch_output)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)


def _quantise_experts(model):
    """``prepare`` for the harness: every MoE layer's quant method becomes a counting stand-in named as Kimi-K2.5's."""
    lm = getattr(model, "language_model", model)
    for layer in lm.model.layers:
        if hasattr(layer.mlp, "experts"):
            experts = layer.mlp.experts
            experts.quant_method = type("CompressedTensorsWNA16MoEMethod", (_CountingMoEMethod,), {})(
                experts.quant_method)


def test_quantised_experts_run_through_their_quant_method(sglang_loaded):
    h = harness("fp32-quant-experts", dtype=torch.float32, tokens=4, topk=2, prepare=_quantise_experts)
    assert _model_reasons(h) == []  # no longer refused
    built = h.built
    assert built.experts == "auto"
    assert built.sglang_expert_layers == {1: "CompressedTensorsWNA16MoEMethod", 2: "CompressedTensorsWNA16MoEMethod"}
    assert "CompressedTensorsWNA16MoEMethod" in built.summary()
    methods = [layer.mlp.experts.quant_method for layer in h.lm.model.layers[1:]]
    _, _, stats = compare(h, h.verify_batch(PREFIX, TREES), count=lambda: sum(m.applied for m in methods))
    assert stats["counted"] == 2, "the layers' quant methods did not run inside our forward"
    assert built.weights.copied_bytes == 0


INT4_GROUP = 32


def _int4_triton_experts(model):
    """``prepare`` for the harness: every MoE layer's routed experts as SGLang's Triton W4A16 runner holds Kimi-K2.5's
    int4 experts after loading (``CompressedTensorsWNA16TritonMoE``: ``w13_weight_packed`` uint8 [E, 2I, H / 2],
    ``w13_weight_scale`` [E, 2I, H / 32], ``is_triton_converted``), quantised from the layer's weights; the quant
    method a counting stand-in. The unquantised parameters are replaced by the dequantised values, so SGLang's own
    forward (the reference, through the stand-in's unquantised apply) computes the same experts."""
    from specverify.reference.quant import dequantize_int4, quantize_int4

    lm = getattr(model, "language_model", model)
    for layer in lm.model.layers:
        if not hasattr(layer.mlp, "experts"):
            continue
        ex = layer.mlp.experts
        for name in ("w13", "w2"):
            weight = getattr(ex, f"{name}_weight")
            packed, scale = quantize_int4(weight.data.float(), INT4_GROUP)
            scale = scale.to(weight.dtype)
            weight.data.copy_(dequantize_int4(packed, scale, INT4_GROUP, weight.dtype))
            setattr(ex, f"{name}_weight_packed", torch.nn.Parameter(packed, requires_grad=False))
            setattr(ex, f"{name}_weight_scale", torch.nn.Parameter(scale, requires_grad=False))
        ex.is_triton_converted = True
        ex.scheme = type(step.INT4_TRITON_SCHEME, (), dict(num_bits=4, sym=True, group_size=INT4_GROUP))()
        ex.quant_method = type("CompressedTensorsWNA16MoEMethod", (_CountingMoEMethod,), {})(ex.quant_method)


def _check_int4_layers(h):
    built = h.built
    assert built.sglang_expert_layers == {}  # every MoE layer's experts are ours
    assert "(int4 in 2 MoE layers: our kernels over SGLang's tensors)" in built.summary()
    for i in (1, 2):
        w, ex = built.verify_model.layers[i], h.lm.model.layers[i].mlp.experts
        assert w["quant"].format == "int4" and w["quant"].group_size == INT4_GROUP and "w13_all" not in w
        assert w["w13"].data_ptr() == ex.w13_weight_packed.data_ptr()  # SGLang's storage, not a copy
        assert w["quant"].w2_scale.data_ptr() == ex.w2_weight_scale.data_ptr()
    methods = [layer.mlp.experts.quant_method for layer in h.lm.model.layers[1:]]
    return lambda: sum(m.applied for m in methods)


def test_int4_triton_experts_run_ours_fp32(sglang_loaded):
    # the reference table over SGLang's int4 tensors (dequantised in fp32) against SGLang's forward over the same
    # dequantised weights: fp32 agreement, and SGLang's quant method is not called inside our forward
    h = harness("fp32-int4-triton", dtype=torch.float32, tokens=4, topk=2, prepare=_int4_triton_experts)
    count = _check_int4_layers(h)
    _, _, stats = compare(h, h.verify_batch(PREFIX, TREES), count=count)
    assert stats["counted"] == 0, "SGLang's experts ran inside our forward"


def test_int4_triton_experts_run_our_kernels_bf16(sglang_loaded):
    # our int4 expert kernels (interpreter) in bf16 over SGLang's tensors
    with interpreter_bf16_dot():
        import msgspec

        spec = msgspec.structs.replace(step.SPEC, build=functools.partial(step.build_step, provider="specverify"))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(step, "SPEC", spec)
            h = harness("bf16-int4-triton", dtype=torch.bfloat16, tokens=4, topk=2, prepare=_int4_triton_experts)
        assert h.built.provider == "specverify"
        count = _check_int4_layers(h)
        _, _, stats = compare(h, h.verify_batch(PREFIX, TREES), dtype_tag="bf16", count=count)
        assert stats["counted"] == 0


def test_int4_marlin_or_other_formats_stay_sglangs():
    # only the Triton runner's converted layout is read: Marlin's scheme, an unconverted layer, another bit width,
    # asymmetric codes or channel-wise scales give None (those experts stay SGLang's module)
    def experts(scheme_name=step.INT4_TRITON_SCHEME, converted=True, **scheme):
        fields = dict(num_bits=4, sym=True, group_size=32)
        fields.update(scheme)
        return SimpleNamespace(scheme=type(scheme_name, (), fields)(), is_triton_converted=converted,
                               w13_weight_packed=torch.zeros(2, 8, 16, dtype=torch.uint8),
                               w2_weight_packed=torch.zeros(2, 32, 2, dtype=torch.uint8),
                               w13_weight_scale=torch.ones(2, 8, 1), w2_weight_scale=torch.ones(2, 32, 1))

    assert step.int4_experts_quant(experts()).format == "int4"
    for bad in (experts("CompressedTensorsWNA16MoE"), experts(converted=False), experts(num_bits=8),
                experts(sym=False), experts(group_size=-1), experts(group_size=24)):
        assert step.int4_experts_quant(bad) is None


# ------------------------------------------------------------------------------------------------------------
# tensor parallel: two ranks, each SGLang's real model over its shards (tests/sglang/tp_worker.py)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_tp(tmp_path, world=2, timeout_s=600, **opts):
    """``world`` processes of tp_worker.py (a gloo world over 127.0.0.1); their result dicts by rank."""
    worker = os.path.join(os.path.dirname(__file__), "tp_worker.py")
    port = str(_free_port())
    args = [f"{k}={v}" for k, v in opts.items()]
    procs, logs = [], []
    for rank in range(world):
        logs.append(open(tmp_path / f"rank{rank}.log", "w"))
        procs.append(subprocess.Popen([sys.executable, worker, str(rank), str(world), port,
                                       str(tmp_path / f"rank{rank}.json"), *args],
                                      stdout=logs[-1], stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
    tails = {r: (tmp_path / f"rank{r}.log").read_text()[-3000:] for r, c in enumerate(codes) if c}
    assert not tails, tails
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("tag, opts", [
    ("fp32", dict(dtype="float32", topk=2)),                                       # a tree server, reference ops
    ("bf16", dict(dtype="bfloat16", topk=2, provider="specverify")),               # our Triton kernels, the
                                                                                   # shared expert stacked per rank
    ("fp32", dict(dtype="float32", topk=1, experts="sglang")),                     # a chain server, the routed
                                                                                   # experts through SGLang's FusedMoE
], ids=["fp32-tree", "bf16-specverify", "fp32-chain-sglang-experts"])
def test_tp2_verify_matches_sglang(sglang_loaded, tmp_path, tag, opts):
    # vocab 500: SGLang pads it to 512 (a multiple of 64), so rank 1 holds 244 token rows and 12 padding rows
    results = _run_tp(tmp_path, world=2, vocab=500, **opts)
    layers = results[0]["layers"]
    tol = step.TOLERANCES
    for rank, r in enumerate(results):
        print(f"measured ({tag}, TP 2, rank {rank}):", {k: r[k] for k in ("logits", "hidden", "kv", "counts")})
        assert r["built"] == "VerifyStep" and r["tp"] == 2 and r["rank_of_model"] == rank, r
        assert not r["sglang_layer_loop_ran"], "SGLang's own layer loop ran during the step"
        assert r["ours_ran"] == 1, "our verify forward did not run"
        assert r["shape"] == r["sglang_shape"] == [8, 500] and not r["kv_nan"], r
        assert r["logits"] <= tol[f"logits_max_rel_{tag}"] and r["kv"] <= tol[f"logits_max_rel_{tag}"], r
        if tag == "fp32":
            assert r["hidden"] <= tol["hidden_max_rel_fp32"], r
            assert r["greedy"] == r["sglang_greedy"], r
        # every collective of ours went through SGLang's TP group coordinator: the embedding, each layer's attention
        # and MLP outputs; the logits gather
        assert r["counts"] == {"all_reduce": 1 + 2 * layers, "all_gather": 1}, r["counts"]
        assert "TP 2" in r["summary"] and f"rank {rank}" in r["summary"]
        assert r["model_reasons"] == [], r["model_reasons"]
        assert len(r["shared_tp1_reasons"]) == 1 and "shared expert is replicated" in r["shared_tp1_reasons"][0]
        if opts.get("provider") == "specverify":
            assert r["provider"] == "specverify" and r["copied_tensors"] == 4  # each rank stacks its own shards
        if opts.get("experts") == "sglang":
            assert r["sglang_expert_layers"] == [1, 2]
    assert [r["vocab_range"] for r in results] == [[0, 256], [256, 500]]
    assert results[0]["embed_rows"] == results[1]["embed_rows"] == 256
    assert results[0]["greedy"] == results[1]["greedy"]


def test_loaded_model_at_tp_needs_the_engines_collectives():
    from specverify.forward.step import LoadedVerifyModel

    with pytest.raises(ValueError, match="collectives"):
        LoadedVerifyModel(step.model_config_from_hf(_hf()), {"layers": []}, dtype=torch.float32, device="cpu",
                          ops=None, tp=2, rank=0)
    with pytest.raises(ValueError, match="rank in"):
        LoadedVerifyModel(step.model_config_from_hf(_hf()), {"layers": []}, dtype=torch.float32, device="cpu",
                          ops=None, tp=2, rank=2)


# ------------------------------------------------------------------------------------------------------------
# refusals: one reason each


def _server_cfg(**overrides):
    """The resolved server settings SGLang's refusal checks read, for a served EAGLE setup; ``overrides`` change
    one of them."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    cfg = dict(pp_size=1, nnodes=1, enable_dp_attention=False, attn_dp_size=1, ep_size=1, enable_eplb=False,
               attn_cp_size=1, dcp_size=1, enable_prefill_cp=False, speculative_algorithm="EAGLE",
               enable_two_batch_overlap=False, enable_single_batch_overlap=False, enable_lora=False,
               lora_paths=None, disaggregation_mode="null", enable_return_routed_experts=False,
               enable_return_indexer_topk=False, enable_hierarchical_cache=False,
               disaggregation_decode_enable_offload_kvcache=False, enable_lmcache=False, enable_flexkv=False,
               enable_hisparse=False, enable_memory_saver=False, enable_weights_cpu_backup=False, cpu_offload_gb=0,
               offload_group_size=0, enable_torch_compile=False, enable_deterministic_inference=False,
               rl_on_policy_target=None, tp_size=1, watchdog_timeout=300,
               cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend=Backend.DISABLED)),
               quantization=None, kv_cache_dtype="auto", attention_backend="triton",
               prefill_attention_backend=None, decode_attention_backend=None, enable_dp_lm_head=False)
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


def _hf(**overrides):
    from dsv3_harness import tiny_config

    return SimpleNamespace(**{**tiny_config(), **overrides})


def _kimi_hf(**text_overrides):
    """Kimi-K2.5's config as the refusal checks see it: the wrapper's architecture, the model in text_config."""
    return SimpleNamespace(architectures=["KimiK25ForConditionalGeneration"], text_config=_hf(**text_overrides))


#: Shaped like Kimi-K2.5's quantization_config: W4A16 int4 groups of 32 on every Linear except the ignored ones
#: (attention, shared experts, dense MLPs, LM head, vision): the routed experts only.
KIMI_K25_QUANT = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "group_size": 32,
                                                                    "symmetric": True, "strategy": "group"}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:vision_tower.*", "re:mm_projector.*"],
}


def _reasons(cfg, hf=None):
    from sglang.srt.kernel_plugins.nvidia import binding

    spec, reasons = binding.megakernel_disable_reasons(cfg=cfg, hf_config=hf or _hf(), isa="sm_90")
    assert spec is step.SPEC
    return reasons


def test_served_setup_has_no_reason(sglang_loaded):
    assert _reasons(_server_cfg()) == []
    assert _reasons(_server_cfg(), _kimi_hf()) == []


def test_experts_only_quantised_checkpoint_passes_the_config_check(sglang_loaded):
    # the routed experts run through SGLang's quant method; model_disable_reasons checks every module after load
    assert _reasons(_server_cfg(), _kimi_hf(quantization_config=KIMI_K25_QUANT)) == []
    assert _reasons(_server_cfg(), _hf(quantization_config=KIMI_K25_QUANT)) == []
    assert _reasons(_server_cfg(quantization="compressed-tensors"), _hf(quantization_config=KIMI_K25_QUANT)) == []
    # online fp8 over it quantises every linear layer
    reasons = _reasons(_server_cfg(quantization="fp8"), _hf(quantization_config=KIMI_K25_QUANT))
    assert len(reasons) == 1 and "quantised checkpoint (fp8)" in reasons[0], reasons


@pytest.mark.parametrize("text, words", [
    ({"q_lora_rank": None}, "q_lora_rank is None"),
    ({"topk_method": "group_limited_greedy", "scoring_func": "softmax"}, "noaux_tc sigmoid router only"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "quantised checkpoint (fp8)"),
])
def test_kimi_config_refusal_reads_text_config(sglang_loaded, text, words):
    reasons = _reasons(_server_cfg(), _kimi_hf(**text))
    assert len(reasons) == 1 and words in reasons[0], reasons


@pytest.mark.parametrize("overrides, hf, words", [
    ({"enable_dp_attention": True, "attn_dp_size": 2}, {}, "DP attention"),
    ({"ep_size": 8}, {}, "expert parallelism"),
    ({"attn_cp_size": 2}, {}, "context parallelism"),
    ({"enable_lora": True}, {}, "LoRA"),
    ({"pp_size": 2}, {}, "pipeline parallelism"),
    ({"tp_size": 16}, {}, "tp_size 16 is not one of"),                                 # SGLang's own check
    ({"tp_size": 8}, {}, "num_attention_heads 4"),                                     # served size, 4 heads
    ({"tp_size": 2, "moe_dense_tp_size": 1}, {}, "--moe-dense-tp-size 1"),
    ({"moe_a2a_backend": "deepep"}, {}, "--moe-a2a-backend deepep"),
    ({"kv_cache_dtype": "fp8_e4m3"}, {}, "--kv-cache-dtype fp8_e4m3"),
    ({"quantization": "fp8"}, {}, "quantised checkpoint (fp8)"),                       # online: every linear layer
    ({}, {"quantization_config": {"quant_method": "compressed-tensors"}}, "quantised checkpoint (compressed-tensors)"),
    ({}, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},  # DeepSeek-V3's FP8
     "quantised checkpoint (fp8)"),
    ({"attention_backend": "fa3"}, {}, "--attention-backend fa3"),
    ({"speculative_algorithm": "NGRAM"}, {}, "--speculative-algorithm NGRAM"),
    ({"enable_dp_lm_head": True}, {}, "--enable-dp-lm-head"),
    ({}, {"q_lora_rank": None}, "q_lora_rank is None"),
    ({}, {"topk_method": "group_limited_greedy", "scoring_func": "softmax"}, "noaux_tc sigmoid router only"),
])
def test_config_refusal(sglang_loaded, overrides, hf, words):
    reasons = _reasons(_server_cfg(**overrides), _hf(**hf))
    assert len(reasons) == 1 and words in reasons[0], reasons


class _FakeQuant:  # stands for a quantised linear method (the refusal reads its class name)
    pass


def _model_reasons(h):
    return step.model_disable_reasons(h.model, h.model_config.hf_config)


def test_model_refusals(sglang_loaded):
    from sglang.srt.layers.moe.topk import TopKOutputFormat

    h = harness("fp32-tree", dtype=torch.float32, tokens=4, topk=2)
    assert _model_reasons(h) == []
    attn = h.model.model.layers[1].self_attn
    mlp = h.model.model.layers[1].mlp
    quantised = (mlp.experts, "quant_method", type("CompressedTensorsWNA16MoEMethod", (_CountingMoEMethod,), {})(
        mlp.experts.quant_method))
    cases = [
        ([(attn.q_b_proj, "quant_method", type("Fp8LinearMethod", (_FakeQuant,), {})())],
         "quantised attention weights"),
        ([quantised], None),  # quantised routed experts run through SGLang's quant method: no reason
        ([quantised, (mlp.topk.topk_config, "output_format", TopKOutputFormat.BYPASSED)], "BYPASSED top-k output"),
        ([quantised, (mlp, "num_fused_shared_experts", 1)], "--disable-shared-experts-fusion"),
        ([(mlp.shared_experts.down_proj, "quant_method", type("Fp8LinearMethod", (_FakeQuant,), {})())],
         "quantised MLP weights"),
        ([(attn, "w_kc", None)], "absorbed W_UK / W_UV"),
    ]
    for settings, words in cases:
        # set and restore by hand: MonkeyPatch would delete a submodule attribute on undo (not in __dict__)
        old = [getattr(obj, attr) for obj, attr, _ in settings]
        for obj, attr, value in settings:
            setattr(obj, attr, value)
        try:
            reasons = _model_reasons(h)
        finally:
            for (obj, attr, _), value in zip(settings, old):
                setattr(obj, attr, value)
        if words is None:
            assert reasons == [], reasons
        else:
            assert len(reasons) == 1 and words in reasons[0], (words, reasons)
    assert _model_reasons(h) == []


def test_model_refusal_other_architecture(sglang_loaded):
    reasons = step.model_disable_reasons(torch.nn.Linear(2, 2), None)
    assert len(reasons) == 1 and "DeepseekV2ForCausalLM" in reasons[0]


def test_model_refusal_wrapper_without_language_model(sglang_loaded):
    wrapper = type("KimiK25ForConditionalGeneration", (torch.nn.Module,), {})()
    wrapper.language_model = None  # an encoder-only Kimi-K2.5
    reasons = step.model_disable_reasons(wrapper, None)
    assert len(reasons) == 1 and "holds no language model" in reasons[0]
