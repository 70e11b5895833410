"""router_route: a MoE layer's router GEMV and routing in one launch (issue 22).

Against the definition: logits = x @ router^T (fp32; tolerance from the dot's length), the routing of
route_reference on the kernel's own logits (ids exact, weights to fp32 rounding: the same formula), the shared
expert as the last slot (its id, weight 1 exactly). Every torch.empty of the launcher is NaN / -7 poisoned and the
workspace is rebuilt per test, so an unwritten output or partial cannot pass. CPU runs use the Triton interpreter;
the GPU tests run the Kimi-K2 and DeepSeek-V3 rank shapes at 1-16 tokens, twice and in a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

from test_moe import _poison_torch_empty

import specverify.moe_layer as layer_mod
from specverify.moe_layer import router_route
from specverify.reference.moe import route_reference

# (H, E, top_k, scoring, bias, n_group, topk_group, renormalize, scale); each row says why it is there
CASES = {
    "kimi": (256, 48, 6, "sigmoid", True, 1, 1, True, 2.827),  # Kimi-K2's recipe: sigmoid, bias, one group
    "grouped": (192, 64, 4, "sigmoid", True, 4, 2, True, 2.5),  # DeepSeek-V3's: groups; H not a tile multiple;
    "softmax": (128, 20, 3, "softmax", False, 1, 1, False, 1.0),  # two row tiles. Qwen-style: no bias, no renorm,
}  # odd top_k, E not a tile multiple


def _inputs(case, m, seed, device, dtype=torch.bfloat16):
    h, e, top_k, scoring, has_bias, n_group, topk_group, renorm, scale = CASES[case]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g).to(dtype).to(device)
    router = (torch.randn(e, h, generator=g) * h ** -0.5).to(dtype).to(device)
    bias = (torch.randn(e, generator=g) * 0.05).to(device) if has_bias else None
    kw = dict(top_k=top_k, scoring=scoring, correction_bias=bias, n_group=n_group, topk_group=topk_group,
              renormalize=renorm, routed_scaling_factor=scale)
    return x, router, kw


def check_route(res, x, router, kw, shared_id):
    m, h = x.shape
    e = router.shape[0]
    top_k = kw["top_k"]
    k_all = top_k + (shared_id is not None)
    assert res.topk_ids.shape == (m, k_all) and res.topk_ids.dtype == torch.int32
    assert res.topk_weights.shape == (m, k_all) and res.topk_weights.dtype == torch.float32
    assert res.router_logits.shape == (m, e) and res.router_logits.dtype == torch.float32
    # logits: fp32 sums of h bf16 products, in the kernel's order
    want = x.double() @ router.double().T
    mag = x.double().abs() @ router.double().abs().T
    tol = 4 * h * 2.0 ** -24 * mag + 1e-30
    assert ((res.router_logits.double() - want).abs() <= tol).all(), "router logits"
    ids, w = route_reference(res.router_logits, top_k, scoring=kw["scoring"], correction_bias=kw["correction_bias"],
                             n_group=kw["n_group"], topk_group=kw["topk_group"], renormalize=kw["renormalize"],
                             routed_scaling_factor=kw["routed_scaling_factor"])
    assert torch.equal(res.topk_ids[:, :top_k], ids), "routed ids"
    torch.testing.assert_close(res.topk_weights[:, :top_k], w, rtol=4 * 2.0 ** -23, atol=1e-12)
    if shared_id is not None:
        assert torch.equal(res.topk_ids[:, top_k].cpu(), torch.full((m,), shared_id, dtype=torch.int32))
        assert torch.equal(res.topk_weights[:, top_k].cpu(), torch.ones(m)), "shared slot weight: exactly 1"


@pytest.fixture
def fresh_workspace(monkeypatch):
    """A NaN-poisoned launcher (torch.empty) and a workspace built for this test."""
    _poison_torch_empty(monkeypatch, layer_mod)
    monkeypatch.setattr(layer_mod, "_RR_WS", {})


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("m", [1, 3, 6])
def test_router_route_matches_reference(case, m, device, fresh_workspace):
    """m = 6: the finishing program routes in two rounds of 4 rows, the second one partly past M."""
    x, router, kw = _inputs(case, m, seed=100 * m + len(case), device=device)
    shared = CASES[case][1]  # the stacked layout: the shared expert after the routed ones
    check_route(router_route(x, router, shared_expert_id=shared, **kw), x, router, kw, shared)


def test_router_route_without_shared_slot(device, fresh_workspace):
    x, router, kw = _inputs("grouped", 4, seed=5, device=device)
    check_route(router_route(x, router, **kw), x, router, kw, None)


@pytest.mark.parametrize("programs", [6, 40])
def test_router_route_split_k(programs, monkeypatch, fresh_workspace):
    """More programs than row tiles: H = 640 (5 chunks of 128) cut into 3 parts of unequal length (6 programs over
    2 tiles) or one chunk a part (40 programs), so the tickets sum several partials per tile."""
    monkeypatch.setitem(CASES, "wide", (640, 48, 6, "sigmoid", True, 1, 1, True, 2.827))
    monkeypatch.setattr(layer_mod, "sm_count", lambda *a: programs)
    tiles, split = layer_mod.router_route_split(48, 640, programs)
    assert tiles == 2 and split == {6: 3, 40: 5}[programs]
    for m in (1, 5):
        x, router, kw = _inputs("wide", m, seed=programs + m, device="cpu")
        check_route(router_route(x, router, shared_expert_id=48, **kw), x, router, kw, 48)


def test_router_route_tickets_left_at_zero(device, fresh_workspace):
    """The tickets are back at zero after a call, so the next call (or graph replay) starts clean; a second call
    with new inputs and another token count is right too."""
    for seed, m in ((1, 2), (2, 16)):
        x, router, kw = _inputs("kimi", m, seed=seed, device=device)
        check_route(router_route(x, router, shared_expert_id=48, **kw), x, router, kw, 48)
        (_, ticket), = layer_mod._RR_WS.values()
        assert int(ticket.abs().sum()) == 0


def test_router_route_non_finite_logits(device, fresh_workspace):
    """A NaN hidden row makes every logit of that row NaN: the routing's contract gives the fillers 0..top_k - 1
    with weight 0 (and the other rows route as usual)."""
    x, router, kw = _inputs("grouped", 3, seed=11, device=device)
    x[1, 7] = float("nan")
    res = router_route(x, router, shared_expert_id=64, **kw)
    top_k = kw["top_k"]
    assert torch.equal(res.topk_ids[1, :top_k].cpu(), torch.arange(top_k, dtype=torch.int32))
    assert (res.topk_weights[1, :top_k] == 0).all()
    keep = torch.tensor([0, 2], device=x.device)
    check_route(res._replace(topk_ids=res.topk_ids[keep], topk_weights=res.topk_weights[keep],
                             router_logits=res.router_logits[keep]), x[keep], router, kw, 64)


def test_router_route_fp16(device, fresh_workspace):
    x, router, kw = _inputs("kimi", 2, seed=7, device=device, dtype=torch.float16)
    check_route(router_route(x, router, shared_expert_id=48, **kw), x, router, kw, 48)


@pytest.mark.parametrize("bad, err, match", [
    (dict(x=torch.zeros(0, 256, dtype=torch.bfloat16)), ValueError, "M must be in 1..16"),
    (dict(x=torch.zeros(17, 256, dtype=torch.bfloat16)), ValueError, "M must be in 1..16"),
    (dict(x=torch.zeros(1, 128, dtype=torch.bfloat16)), ValueError, "expected hidden"),
    (dict(x=torch.zeros(1, 256, dtype=torch.float32)), TypeError, "bfloat16 or float16"),
    (dict(x=torch.zeros(256, 2, dtype=torch.bfloat16).t()), ValueError, "hidden needs a unit stride"),
    (dict(router=torch.zeros(48, 256, dtype=torch.float16)), TypeError, "router must have hidden's dtype"),
    (dict(router=torch.zeros(256, 48, dtype=torch.bfloat16).t()), ValueError, "router must be contiguous"),
    (dict(router="w"), TypeError, "router must be a torch.Tensor"),
    (dict(top_k=0), ValueError, "top_k must be an int"),
    (dict(top_k=True), TypeError, "top_k must be an int"),
    (dict(top_k=65), ValueError, "top_k must be at most 64"),
    (dict(n_group=5), ValueError, "n_group must be a positive int dividing"),
    (dict(n_group=16, topk_group=1), ValueError, "exceeds the experts of the kept groups"),
    (dict(renormalize="no"), TypeError, "renormalize must be a bool"),
    (dict(scoring="relu"), ValueError, "scoring must be"),
    (dict(correction_bias=torch.zeros(3)), ValueError, "correction_bias must have shape"),
    (dict(shared_expert_id=-1), ValueError, "shared_expert_id must be an int"),
    (dict(shared_expert_id=True), TypeError, "shared_expert_id must be a Python int"),
])
def test_router_route_rejects_bad_input(bad, err, match):
    x, router, kw = _inputs("kimi", 1, seed=0, device="cpu")
    x = bad.pop("x", x)
    router = bad.pop("router", router)
    kw.update(bad)
    with pytest.raises(err, match=match):
        router_route(x, router, **kw)


def test_router_route_needs_cuda_or_the_interpreter(monkeypatch):
    x, router, kw = _inputs("kimi", 1, seed=0, device="cpu")
    monkeypatch.setattr(layer_mod.envvars, "triton_interpret", lambda: False)
    with pytest.raises(ValueError, match="needs CUDA tensors.*TRITON_INTERPRET=1"):
        router_route(x, router, **kw)


# ---- GPU: the rank shapes of the verify pass ---------------------------------------------------------------------
_RANK = {"kimi-k2": (7168, 384, 8, "sigmoid", True, 1, 1, True, 2.827),
         "deepseek-v3": (7168, 256, 8, "sigmoid", True, 8, 4, True, 2.5)}


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(_RANK))
@pytest.mark.parametrize("m", [1, 4, 16])
def test_router_route_rank_shapes_gpu(model, m, monkeypatch):
    from conftest import check_graph_replay, warm_up_for_capture

    monkeypatch.setitem(CASES, model, _RANK[model])
    x, router, kw = _inputs(model, m, seed=m, device="cuda")
    e = _RANK[model][1]
    res = warm_up_for_capture(lambda: router_route(x, router, shared_expert_id=e, **kw))
    check_route(res, x, router, kw, e)
    again = router_route(x, router, shared_expert_id=e, **kw)  # deterministic: a fixed order everywhere
    assert torch.equal(again.router_logits, res.router_logits) and torch.equal(again.topk_ids, res.topk_ids)

    def step():
        return router_route(x, router, shared_expert_id=e, **kw).topk_weights

    check_graph_replay(step, [x])
