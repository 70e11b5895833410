"""The verify forward with quantised experts (``VerifyModel(experts_quant=...)``): Kimi-K2.5's int4 routed experts
(shared expert in bf16) and the fp8 block experts of DeepSeek-V3 / Kimi-K2 (shared expert stacked, fp8 too), through
specverify's op table (the Triton interpreter on the CPU) and the reference table, against an fp64 forward over the
dequantised weights; and the bytes the floor counts for them."""
import pytest
import torch

from specverify import gemv as gemv_mod
from specverify.configs import expert_param_bytes, per_rank_shapes, verify_bytes
from specverify.forward import model as model_mod
from specverify.forward.model import VerifyModel
from specverify.forward.ops import Ops, specverify_ops

from test_pass_fusions import _caches, _count_calls, _inputs

_ALL = ((16, (1, 1 << 30), (1, 1 << 30)),)
_EXPERT_KEYS = {"w13", "w2", "w13_all", "w2_all", "shared_w13", "shared_w2", "w13_scale", "w2_scale"}


def _record_routing(ops, into):
    """Wrap the routing slots of ``ops`` so each call appends its routed ids (sorted, shared slot left out)."""
    for slot in ("route", "route_shared"):
        real = getattr(ops, slot)
        if real is None:
            continue

        def wrapped(logits, p, *a, _real=real):
            ids, w = _real(logits, p, *a)
            into.append(ids[:, :p.num_experts_per_tok].sort(-1).values.cpu())
            return ids, w
        setattr(ops, slot, wrapped)


def _replay_routing(ops, recorded):
    """Make ``ops.route`` choose the experts ``recorded`` holds, layer by layer, weighting them from its own
    logits (sigmoid scores, renormalised, scaled: the tiny models' routing): the truth then differs from our forward
    by arithmetic alone, not by a near tie that rounds to another expert."""
    layer = iter(recorded)

    def route(logits, p):
        ids = next(layer).to(logits.device).long()
        w = torch.sigmoid(logits.double()).gather(1, ids)
        if p.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return ids.int(), w * p.routed_scaling_factor
    ops.route = route


def _fp64_twin(model, name, seed):
    """The unquantised model in fp64 with the quantised model's weights, its experts dequantised: the truth."""
    ref = VerifyModel(name, dtype=torch.float64, seed=seed, device=model.device)
    for key, w in model._sets.items():
        r = ref._sets[key]
        for n, t in w.items():
            if isinstance(t, torch.Tensor) and n in r and n not in _EXPERT_KEYS and n != "q_b_folded":
                r[n].copy_(t.double())  # the bf16 shared expert of int4 layers too (a view into r's stack)
        if "quant_all" in w:  # fp8: the stack, shared expert included
            a13, a2 = w["quant_all"].dequantize(w["w13_all"], w["w2_all"], torch.float64)
            r["w13_all"].copy_(a13)
            r["w2_all"].copy_(a2)
        elif "quant" in w:
            a13, a2 = w["quant"].dequantize(w["w13"], w["w2"], torch.float64)
            r["w13"].copy_(a13)
            r["w2"].copy_(a2)
    ref.embed.copy_(model.embed.double())
    ref.lm_head.copy_(model.lm_head.double())
    ref.ops = Ops()
    return ref


@pytest.mark.parametrize("fmt", ["int4", "int4+shared-in-experts", "fp8"])
@pytest.mark.parametrize("name", ["tiny-mla-moe", "tiny-mla-grouped"])
@pytest.mark.parametrize("b, k", [(1, 1), (2, 3)])  # M = 1 (the MoE block would serve unquantised) and M = 6
def test_quantised_forward_matches_dequantised_truth(device, monkeypatch, fmt, name, b, k):
    monkeypatch.setattr(gemv_mod, "LINEAR_RULES", _ALL)
    # int4's bf16 shared expert in the q4 stream launches (ops.experts_plus_shared), or apart
    shared_in = fmt.endswith("+shared-in-experts")
    monkeypatch.setattr(model_mod, "SHARED_IN_EXPERTS", shared_in)
    fmt = fmt.removesuffix("+shared-in-experts")
    page_size, seed = 4, 13
    model = VerifyModel(name, dtype=torch.bfloat16, seed=seed, device=device, experts_quant=fmt)
    moe_sets = [w for w in model._sets.values() if not w["dense"]]
    assert moe_sets and all(w["quant"].format == fmt for w in moe_sets)
    want_dtype = torch.uint8 if fmt == "int4" else torch.float8_e4m3fn
    assert all(w["w13"].dtype == want_dtype and w["w2"].dtype == want_dtype for w in moe_sets)
    if fmt == "int4":  # the shared expert stays bf16 and apart (Kimi-K2.5 ships it unquantised)
        assert all("w13_all" not in w and w["shared_gate_up"].dtype == torch.bfloat16 for w in moe_sets)
    else:
        assert all(w["w13_all"].dtype == want_dtype for w in moe_sets)
    sv, _ = specverify_ops(model)
    calls = _count_calls(sv, ("moe_block", "experts", "experts_with_shared", "experts_plus_shared"))
    routed = {"specverify": [], "reference": []}
    _record_routing(sv, routed["specverify"])
    ids, pos, pt, prefix, pool = _inputs(model, b, k, page_size, seed=b * 10 + k)
    out = {}
    ref_ops = Ops()
    for tag, ops in (("specverify", sv), ("reference", ref_ops)):
        if tag == "reference":  # the reference table routes as our forward did too
            _replay_routing(ref_ops, routed["specverify"])
        model.ops = ops
        out[tag] = model.forward(ids, pos, _caches(model, pool, page_size, seed=5), pt, prefix)
    # the one-launch MoE block has no quantised path: every MoE layer ran the expert kernels with its format (int4's
    # with the bf16 shared expert in their launches where set)
    layers = sum(not w["dense"] for w in model.layers)
    plus = layers if shared_in else 0
    assert calls["moe_block"] == 0 and calls["experts_with_shared"] == 0, calls
    assert calls["experts"] == layers - plus and calls["experts_plus_shared"] == plus, calls
    twin = _fp64_twin(model, name, seed)
    assert len(routed["specverify"]) == layers
    _replay_routing(twin.ops, routed["specverify"])
    caches64 = [[c.double() for c in layer] for layer in _caches(model, pool, page_size, seed=5)]
    truth = twin.forward(ids, pos, caches64, pt, prefix)
    err = {tag: float((o.double() - truth).abs().max()) for tag, o in out.items()}
    assert not torch.isnan(out["specverify"]).any()
    # our kernels against the truth: at most twice the reference table's bf16 error plus a floor
    assert err["specverify"] <= 2 * err["reference"] + 1e-2 * float(truth.abs().max()), err


def test_quantised_model_checks_its_format():
    with pytest.raises(ValueError, match="experts_quant must be one of"):
        VerifyModel("tiny-mla-moe", experts_quant="int8")


def test_quantised_weight_bytes_and_floor():
    # the floor counts what the model stores: int4 codes + bf16 scales per 32, fp8 + fp32 scales per 128 x 128
    assert expert_param_bytes(None) == (2.0, 2.0)
    assert expert_param_bytes("int4") == (0.5625, 2.0)
    assert expert_param_bytes("fp8") == (1 + 4 / 16384, 1 + 4 / 16384)
    s = per_rank_shapes("kimi-k2", 8)
    plain = verify_bytes("kimi-k2", 8, 4, 4096, 1)
    for fmt in ("int4", "fp8"):
        vb = verify_bytes("kimi-k2", 8, 4, 4096, 1, experts_quant=fmt)
        routed_b, shared_b = expert_param_bytes(fmt)
        assert vb.routed_experts == pytest.approx(plain.routed_experts * routed_b / 2)
        assert vb.shared_experts == pytest.approx(plain.shared_experts * shared_b / 2)
        assert vb.attention_weights == plain.attention_weights and vb.kv_cache == plain.kv_cache
    assert s.shared_intermediate_size == s.moe_intermediate_size  # Kimi-K2's shared expert is one expert's size
    # the tiny model stores exactly what its floor counts for its experts (int4: every size divides the group)
    model = VerifyModel("tiny-mla-moe", experts_quant="int4", distinct_layers=1, num_layers=2)
    w = next(w for w in model._sets.values() if not w["dense"])
    e, two_i, half_h = w["w13"].shape
    stored = sum(t.numel() * t.element_size() for t in (w["w13"], w["w2"], w["w13_scale"], w["w2_scale"]))
    assert stored == pytest.approx(e * 3 * (two_i // 2) * (2 * half_h) * 0.5625)


def test_sglang_table_refuses_quantised_experts():
    from specverify.forward.ops import sglang_ops

    with pytest.raises(ValueError, match="unquantised fused MoE"):
        sglang_ops(VerifyModel("tiny-mla-moe", experts_quant="fp8"))
