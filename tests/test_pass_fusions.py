"""The verify forward's fusion slots (MLA preparation with the query absorption in one launch; the router writing the
shared expert's slot; the whole MoE block in one launch at a few tokens) compute what the unfused op chain computes.

Runs the tiny MLA stand-ins in bf16 through specverify's op table (the Triton interpreter on the CPU), with the
projection rules widened so our GEMV serves the tiny shapes, against the same table with the fusion slots emptied;
both against an fp64 reference forward over the same (bf16-rounded) weights.
"""
import pytest
import torch

from specverify import gemv as gemv_mod
from specverify.forward.model import VerifyModel
from specverify.forward.ops import Ops, specverify_ops

_ALL = ((16, (1, 1 << 30), (1, 1 << 30)),)
FUSIONS = ("mla_prep_absorb", "route_shared", "moe_block")  # the Ops slots that fuse


def _inputs(model, b, k, page_size, seed):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.tensor([5, 18][:b], dtype=torch.int32)  # the second request crosses a page boundary
    per = -(-(int(prefix.max()) + k) // page_size)
    page_table = torch.randperm(b * per + 2, generator=g)[: b * per].view(b, per).to(torch.int32)
    ids = torch.randint(0, model.config.vocab_size, (b, k), generator=g)
    pos = prefix.long()[:, None] + torch.arange(k)
    dev = model.device
    return ids.to(dev), pos.to(dev), page_table.to(dev), prefix.to(dev), b * per + 2


def _caches(model, pool, page_size, seed):
    g = torch.Generator().manual_seed(seed)
    caches = model.allocate_kv(pool, page_size)
    for layer in caches:
        for c in layer:
            c.copy_(torch.randn(c.shape, generator=g).to(c.device))
    return caches


def _count_calls(ops, slots):
    """Wrap each slot of ``ops`` in ``slots`` so its calls are counted; returns the counts (updated in place)."""
    calls = {f: 0 for f in slots}

    def wrap(name, real):
        def counted(*a, **kw):
            calls[name] += 1
            return real(*a, **kw)
        return counted

    for f in slots:
        setattr(ops, f, wrap(f, getattr(ops, f)))
    return calls


def _stacked_layers(model):
    """MoE layers whose shared expert is expert E of the stacked weights (``w13_all``): those route_shared serves."""
    return sum(not w["dense"] and "w13_all" in w for w in model.layers)


@pytest.mark.parametrize("name", ["tiny-mla-moe", "tiny-mla-grouped"])
@pytest.mark.parametrize("b, k", [(1, 1), (1, 2), (2, 3)])  # M = 1, 2 (the MoE block serves), 6 (route_shared)
def test_fused_forward_matches_the_op_chain(device, monkeypatch, name, b, k):
    monkeypatch.setattr(gemv_mod, "LINEAR_RULES", _ALL)
    page_size = 4
    model = VerifyModel(name, dtype=torch.bfloat16, seed=11, device=device)
    fused, _ = specverify_ops(model)
    assert all(getattr(fused, f) is not None for f in FUSIONS)
    calls = _count_calls(fused, FUSIONS)
    chain, _ = specverify_ops(model)
    for f in FUSIONS:
        setattr(chain, f, None)
    ids, pos, pt, prefix, pool = _inputs(model, b, k, page_size, seed=b * 10 + k)
    out = {}
    for tag, ops in (("fused", fused), ("chain", chain)):
        model.ops = ops
        caches = _caches(model, pool, page_size, seed=5)
        logits, hidden, aux = model.forward_captured(ids, pos, caches, pt, prefix, capture_layers=(1,))
        out[tag] = (logits, hidden, aux, caches)
        if tag == "fused":  # every layer ran the fused prep; every MoE layer with the stacked shared expert the
            moe = _stacked_layers(model)  # MoE block up to its token count, else the router with the shared slot
            block = b * k <= fused.moe_block_max_m
            assert calls == {"mla_prep_absorb": model.num_layers, "route_shared": 0 if block else moe,
                             "moe_block": moe if block else 0}, calls
    ref = _fp64_twin(model, name)  # fp64 truth over the same bf16 weights
    caches64 = [[c.double() for c in layer] for layer in _caches(model, pool, page_size, seed=5)]
    truth, _, aux64 = ref.forward_captured(ids, pos, caches64, pt, prefix, capture_layers=(1,))
    err = {tag: float((o[0].double() - truth).abs().max()) for tag, o in out.items()}
    scale = float(truth.abs().max())
    # the fusions move where bf16 rounds, nothing else: at most twice the chain's own error plus a floor
    assert err["fused"] <= 2 * err["chain"] + 1e-2 * scale, err
    assert not torch.isnan(out["fused"][0]).any()
    # the drafter's residual stream and the KV written into every layer agree the same way
    for a_f, a_c, a_t in zip(out["fused"][2], out["chain"][2], aux64):
        assert float((a_f.double() - a_t).abs().max()) <= 2 * float((a_c.double() - a_t).abs().max()) + \
            1e-2 * float(a_t.abs().max())
    before = _caches(model, pool, page_size, seed=5)
    slots = torch.zeros(pool, page_size, dtype=torch.bool, device=device)  # the draft tokens' slots: prefix .. prefix + k - 1
    for r in range(b):
        for p in range(int(prefix[r]), int(prefix[r]) + k):
            slots[pt[r, p // page_size], p % page_size] = True
    for lf, lc, lt, lb in zip(out["fused"][3], out["chain"][3], caches64, before):
        for cf, cc, ct, cb in zip(lf, lc, lt, lb):
            assert torch.equal(cf[~slots], cb[~slots]) and torch.equal(cc[~slots], cb[~slots])  # nothing else
            e_f = float((cf[slots].double() - ct[slots]).abs().max())
            e_c = float((cc[slots].double() - ct[slots]).abs().max())
            assert e_f <= 2 * e_c + 1e-2 * float(ct.abs().max()), (e_f, e_c)


@pytest.mark.parametrize("name", ["tiny-mla-moe", "tiny-mla-grouped"])  # sigmoid + bias, one group; grouped routing
@pytest.mark.parametrize("b, k", [(1, 1), (2, 3)])  # one token (M = 1); M = 6 tokens over two requests
def test_route_shared_forward_equals_route_then_append(device, monkeypatch, name, b, k):
    # the router writing the shared slot feeds fused_moe the very ids and weights route + append_shared_expert did:
    # the same expert kernel over the same inputs, so logits, hidden states and KV are equal bit for bit
    monkeypatch.setattr(gemv_mod, "LINEAR_RULES", _ALL)
    page_size = 4
    model = VerifyModel(name, dtype=torch.bfloat16, seed=11, device=device)
    assert _stacked_layers(model) > 0
    fused, _ = specverify_ops(model)
    fused.moe_block = None  # the composed MoE path is what this test is about
    calls = _count_calls(fused, ("route_shared", "route", "experts_with_shared", "experts"))
    chain, _ = specverify_ops(model)
    chain.route_shared = chain.moe_block = None
    ids, pos, pt, prefix, pool = _inputs(model, b, k, page_size, seed=b * 10 + k)
    out = {}
    for tag, ops in (("fused", fused), ("chain", chain)):
        model.ops = ops
        caches = _caches(model, pool, page_size, seed=5)
        logits, hidden, _ = model.forward_captured(ids, pos, caches, pt, prefix)
        out[tag] = (logits, hidden, caches)
    moe = _stacked_layers(model)
    # one routing launch with the shared slot and the plain expert pass per MoE layer; no route, no append
    assert calls == {"route_shared": moe, "route": 0, "experts_with_shared": 0, "experts": moe}, calls
    assert not torch.isnan(out["fused"][0]).any()
    assert torch.equal(out["fused"][0], out["chain"][0]) and torch.equal(out["fused"][1], out["chain"][1])
    for lf, lc in zip(out["fused"][2], out["chain"][2]):
        for cf, cc in zip(lf, lc):
            assert torch.equal(cf, cc)


def test_route_shared_slot_only_in_specverify_tables():
    # the reference and SGLang tables compose route + the shared expert themselves: no route_shared
    from specverify.forward.ops import Ops

    assert Ops().route_shared is None
    ops, _ = specverify_ops(None)
    assert ops.route_shared is not None and ops.experts_with_shared is not None


def _fp64_twin(model, name):
    """The same model in fp64 over the same (bf16-rounded) weights, on the reference table: the truth."""
    ref = VerifyModel(name, dtype=torch.float64, seed=11, device=model.device)
    for key, w in model._sets.items():
        for n, t in w.items():
            if isinstance(t, torch.Tensor) and n != "q_b_folded":  # the fp64 truth takes no fold
                ref._sets[key][n].copy_(t.double())
    ref.embed.copy_(model.embed.double())
    ref.lm_head.copy_(model.lm_head.double())
    ref.ops = Ops()
    return ref


# M = 2 and 6 tokens on our GEMV (the fold); M = 6 with the GEMV's rule cut to 4 tokens (qkv_a on torch: no fold);
# M = 6 above the fold's own limit (no fold, linear_sumsq not asked); 16-row GEMV tiles: q_lora's sums of squares
# in two tiles' partials
@pytest.mark.parametrize("b, k, max_m, fold_max, block_n", [(1, 2, 16, 16, 64), (2, 3, 16, 16, 64),
                                                            (2, 3, 4, 16, 64), (2, 3, 16, 4, 64), (1, 2, 16, 16, 16)])
def test_folded_q_norm_forward_matches_the_norm_chain(device, monkeypatch, b, k, max_m, fold_max, block_n):
    """q_a's RMSNorm folded into q_b (its scale from the qkv_a GEMV's epilogue, applied in prep_absorb) gives the
    logits and KV of the chain with the norm, within the bf16 error budget; the norm kernel is really gone."""
    import specverify.forward.model as model_mod

    monkeypatch.setattr(gemv_mod, "LINEAR_RULES", ((max_m, (1, 1 << 30), (1, 1 << 30)),))
    monkeypatch.setattr(model_mod, "FOLD_Q_NORM_MAX_M", fold_max)
    monkeypatch.setitem(gemv_mod._CONFIG, "BLOCK_N", block_n)
    max_m = min(max_m, fold_max)
    name, page_size = "tiny-mla-moe", 4
    model = VerifyModel(name, dtype=torch.bfloat16, seed=11, device=device)
    c = model.config
    # seed 19: no expert choice near a tie at these inputs (a routing flip between bf16 and fp64 makes both errors
    # ~1/3 of the logits and the bound below loose)
    g = torch.Generator().manual_seed(19)
    for w in model._sets.values():  # a norm weight far from ones, so the fold is not the identity
        w["q_a_norm"].copy_((1 + 0.5 * torch.randn(c.q_lora_rank, generator=g)).to(w["q_a_norm"]))
        model_mod.attach_folded_q_b(w)
    ops, _ = specverify_ops(model)
    calls = _count_calls(ops, ("linear_sumsq", "mla_prep_absorb"))
    q_norms = []
    real_rmsnorm = ops.rmsnorm

    def rmsnorm(x, w, eps):  # q_a's norm is the only one as wide as q_lora (hidden 64, the latent's is fused)
        q_norms.append(x.shape[-1] == c.q_lora_rank)
        return real_rmsnorm(x, w, eps)

    ops.rmsnorm = rmsnorm
    model.ops = ops
    ids, pos, pt, prefix, pool = _inputs(model, b, k, page_size, seed=b * 10 + k)
    out = {}
    for fold in (True, False):
        monkeypatch.setattr(model_mod, "FOLD_Q_NORM", fold)
        q_norms.clear()
        caches = _caches(model, pool, page_size, seed=5)
        logits, _, aux = model.forward_captured(ids, pos, caches, pt, prefix, capture_layers=(1,))
        out[fold] = (logits, aux, caches)
        taken = fold and b * k <= max_m
        assert sum(q_norms) == (0 if taken else model.num_layers), (fold, q_norms)
    # linear_sumsq asked once per layer while the switch is on; it serves (and the norm is skipped) only on the GEMV
    asked = model.num_layers if b * k <= fold_max else 0
    assert calls == {"linear_sumsq": asked, "mla_prep_absorb": 2 * model.num_layers}, calls
    ref = _fp64_twin(model, name)
    caches64 = [[t.double() for t in layer] for layer in _caches(model, pool, page_size, seed=5)]
    truth, _, aux64 = ref.forward_captured(ids, pos, caches64, pt, prefix, capture_layers=(1,))
    assert not torch.isnan(out[True][0]).any()
    if b * k > max_m:  # no fold: the very same launches
        assert torch.equal(out[True][0], out[False][0])
        return
    err = {fold: float((o[0].double() - truth).abs().max()) for fold, o in out.items()}
    # the fold moves where bf16 rounds (q_b * g once; the scale after q_b, in fp32), nothing else
    assert err[True] <= 2 * err[False] + 1e-2 * float(truth.abs().max()), err
    for a_f, a_c, a_t in zip(out[True][1], out[False][1], aux64):
        assert float((a_f.double() - a_t).abs().max()) <= 2 * float((a_c.double() - a_t).abs().max()) + \
            1e-2 * float(a_t.abs().max())
    for lf, lc, lt in zip(out[True][2], out[False][2], caches64):  # the KV, over the whole pool
        e_f = float((lf[0].double() - lt[0]).abs().max())
        e_c = float((lc[0].double() - lt[0]).abs().max())
        assert e_f <= 2 * e_c + 1e-2 * float(lt[0].abs().max()), (e_f, e_c)


def test_fold_slot_only_in_specverify_tables(monkeypatch):
    # the reference and SGLang tables keep q_a's RMSNorm: no linear_sumsq; the synthetic model holds the folded q_b
    # where the fold can run (the rule LoadedVerifyModel shares: bf16, a qkv_a shape our GEMV serves)
    import specverify.forward.model as model_mod

    assert Ops().linear_sumsq is None
    ops, _ = specverify_ops(None)
    assert ops.linear_sumsq is not None
    monkeypatch.setattr(gemv_mod, "LINEAR_RULES", _ALL)
    model = VerifyModel("tiny-mla-moe", dtype=torch.bfloat16, seed=3)
    for w in model._sets.values():
        torch.testing.assert_close(w["q_b_folded"], w["q_b"] * w["q_a_norm"], rtol=0, atol=0)
    # bf16 only: fp16's range is short for the un-normed q, fp32 / fp64 models never run our GEMV
    assert all("q_b_folded" not in w for w in VerifyModel("tiny-mla-moe", dtype=torch.float32, seed=3)._sets.values())
    # a qkv_a our GEMV does not serve: no copy (it would never be read)
    monkeypatch.setattr(gemv_mod, "LINEAR_RULES", ())
    assert all("q_b_folded" not in w for w in VerifyModel("tiny-mla-moe", dtype=torch.bfloat16, seed=3)._sets.values())
    assert model_mod.FOLD_Q_NORM is True
