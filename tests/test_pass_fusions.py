"""The verify forward's fusion slots (MLA preparation with the query absorption in one launch) compute what the
unfused op chain computes.

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
FUSIONS = ("mla_prep_absorb",)  # the Ops slots that fuse


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


@pytest.mark.parametrize("name", ["tiny-mla-moe", "tiny-mla-grouped"])
@pytest.mark.parametrize("b, k", [(1, 1), (2, 3)])
def test_fused_forward_matches_the_op_chain(device, monkeypatch, name, b, k):
    monkeypatch.setattr(gemv_mod, "LINEAR_RULES", _ALL)
    page_size = 4
    model = VerifyModel(name, dtype=torch.bfloat16, seed=11, device=device)
    fused, _ = specverify_ops(model)
    assert all(getattr(fused, f) is not None for f in FUSIONS)
    calls = []
    real = fused.mla_prep_absorb
    fused.mla_prep_absorb = lambda *a: (calls.append(1), real(*a))[1]
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
        if tag == "fused":  # every layer ran the fused slot
            assert len(calls) == model.num_layers, calls
    # fp64 truth over the same bf16 weights
    ref = VerifyModel(name, dtype=torch.float64, seed=11, device=device)
    for key, w in model._sets.items():
        for n, t in w.items():
            if isinstance(t, torch.Tensor):
                ref._sets[key][n].copy_(t.double())
    ref.embed.copy_(model.embed.double())
    ref.lm_head.copy_(model.lm_head.double())
    ref.ops = Ops()
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
