"""(a) SGLang's own plugin loader finds our entry point and every hook target really changed."""
from __future__ import annotations

import importlib.metadata
import pkgutil

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed: run in the venv made by .ci/sglang_env.sh")

from specverify.integrations import sglang as plugin  # noqa: E402


@pytest.mark.parametrize("key", sorted(plugin.SGLANG_TARGETS))
def test_target_exists_in_installed_sglang(key):
    # One test per target, so an SGLang upgrade that moves one fails with that target's name and dotted path.
    try:
        plugin.resolve_target(key)
    except LookupError as exc:
        pytest.fail(str(exc))


def test_entry_point_is_discovered():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    ours = [ep for ep in eps if ep.name == "specverify"]
    assert ours, f"no 'specverify' entry point in group sglang.srt.plugins; found {[ep.name for ep in eps]}"
    assert ours[0].value == "specverify.integrations.sglang:register"
    assert ours[0].load() is plugin.register


def test_attention_backend_registered_and_in_cli_choices(sglang_loaded):
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, DRAFT_ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    assert ATTENTION_BACKENDS.get("specverify") is plugin.create_attention_backend
    assert "specverify" in ATTENTION_BACKEND_CHOICES
    # The EAGLE draft runs a built-in backend; we must not pretend to be one.
    assert "specverify" not in DRAFT_ATTENTION_BACKEND_CHOICES


def test_cli_accepts_the_backend(sglang_loaded):
    # The parser SGLang builds after load_plugins() must accept the new choice.
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "dummy", "--attention-backend", "specverify"])
    assert ns.attention_backend == "specverify"


@pytest.mark.parametrize("key, wrapper", [
    ("routing", "routing_around"),
    ("alignment", "alignment_around"),
    ("allreduce_chooser", "allreduce_chooser_around"),
])
def test_hook_took_effect(sglang_loaded, key, wrapper):
    # SGLang swallows plugin errors, so check the patched attribute itself: an around-wrapper whose __wrapped__
    # is SGLang's original and which calls our hook.
    from sglang.srt.plugins.hook_registry import HookRegistry

    dotted = plugin.SGLANG_TARGETS[key].dotted
    assert dotted in HookRegistry._patched, f"{dotted} was not patched by SGLang's HookRegistry"
    patched = pkgutil.resolve_name(dotted)
    assert hasattr(patched, "__wrapped__"), f"{dotted} is not wrapped"
    hooks = [h for _, h, _ in HookRegistry._hooks[dotted]]
    assert getattr(plugin, wrapper) in hooks


def test_routing_hook_patches_the_name_select_experts_calls(sglang_loaded):
    from sglang.srt.layers.moe import topk

    # select_experts looks up the module global `biased_grouped_topk`; the alias behind it stays SGLang's.
    assert topk.biased_grouped_topk.__wrapped__ is topk.biased_grouped_topk_gpu
    assert "biased_grouped_topk(" in __import__("inspect").getsource(topk.select_experts)


def test_alignment_patch_propagated_to_fused_moe(sglang_loaded):
    import importlib

    # The package re-exports the function under the submodule's name, so reach the modules through importlib.
    fused_moe = importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe")
    mod = importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size")
    assert fused_moe.moe_align_block_size is mod.moe_align_block_size
    assert hasattr(fused_moe.moe_align_block_size, "__wrapped__")


def test_parts_follow_environment(sglang_loaded, monkeypatch):
    for name in ("SPECVERIFY_SGLANG_ATTENTION", "SPECVERIFY_SGLANG_ROUTING", "SPECVERIFY_SGLANG_ALLREDUCE"):
        monkeypatch.setenv(name, "0")
    try:
        plugin.register()
        assert plugin.REGISTERED == {}
        monkeypatch.setenv("SPECVERIFY_SGLANG_ROUTING", "1")
        plugin.register()
        assert set(plugin.REGISTERED) == {"routing"}
    finally:
        monkeypatch.undo()
        plugin.register()  # idempotent: restores the full record without stacking wrappers
    from sglang.srt.plugins.hook_registry import HookRegistry

    hooks = [h for _, h, _ in HookRegistry._hooks[plugin.SGLANG_TARGETS["routing"].dotted]]
    assert hooks.count(plugin.routing_around) == 1


def test_allreduce_chooser_declines_without_cuda(sglang_loaded):
    plugin.reset_stats()
    got = plugin.allreduce_chooser_around(lambda group, device: "sglang-class", group=None, device="cpu")
    if torch.cuda.is_available():
        pytest.skip("has CUDA: the chooser returns our class here (covered on the GPU machine)")
    assert got == "sglang-class" and plugin.STATS["allreduce_declined"] == 1


def test_allreduce_chooser_off_switch(sglang_loaded, monkeypatch):
    monkeypatch.setenv("SPECVERIFY_ALLREDUCE", "off")
    assert plugin.allreduce_chooser_around(lambda group, device: "sglang-class", None, "cpu") == "sglang-class"


def test_allreduce_adapter_has_sglang_interface():
    try:
        cls = plugin.sglang_allreduce_class()
    except Exception as exc:
        pytest.skip(f"specverify.comm not importable here: {exc}")
    from sglang.srt.distributed.device_communicators.custom_all_reduce import CustomAllreduce

    for name in ("should_custom_ar", "custom_all_reduce", "capture", "close"):
        assert callable(getattr(cls, name, None)), name
        assert callable(getattr(CustomAllreduce, name, None)), f"SGLang's class lost {name}"


def test_routing_hook_declines_what_it_does_not_cover(sglang_loaded):
    plugin.reset_stats()
    logits = torch.randn(3, 8)
    sentinel = object()

    def original(**kw):
        return sentinel

    # fused shared experts: SGLang appends shared-expert slots we do not produce
    got = plugin.routing_around(original, hidden_states=logits, gating_output=logits, correction_bias=torch.zeros(8),
                                topk=2, renormalize=True, num_expert_group=1, topk_group=1,
                                num_fused_shared_experts=1, routed_scaling_factor=1.0,
                                apply_routed_scaling_factor_on_output=False)
    assert got is sentinel
    # per-token (dynamic) bias
    got = plugin.routing_around(original, hidden_states=logits, gating_output=logits,
                                correction_bias=torch.zeros(3, 8), topk=2, renormalize=True)
    assert got is sentinel
    assert plugin.STATS["routing_declined"] == 2 and plugin.STATS["routing_ours"] == 0


def test_alignment_hook_declines_unknown_ids(sglang_loaded):
    calls = []
    ids = torch.zeros(2, 2, dtype=torch.int32)
    plugin.alignment_around(lambda *a, **k: calls.append(a), ids, 16, 8)
    assert calls, "an alignment not produced by our routing must go to SGLang's function"


def test_graph_pool_flag_is_inert(sglang_loaded, monkeypatch, caplog):
    monkeypatch.setenv("SPECVERIFY_SGLANG_GRAPH_POOL", "1")
    with caplog.at_level("WARNING", logger="specverify.sglang"):
        plugin.register()
    assert "experimental" in caplog.text
    assert "graph_pool" not in plugin.REGISTERED
