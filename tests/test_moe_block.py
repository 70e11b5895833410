"""moe_block: router GEMV, routing and the routed + shared experts in one persistent launch (issue 22).

Against the definition: logits = x @ router^T (fp32; tolerance from the dot's length), the routing of
route_reference on the kernel's own logits (ids exact, weights to fp32 rounding: the same formula), the shared
expert as the last slot (id E, weight 1 exactly), and fused_moe_reference over the stacked weights for the output.
The output's tolerance is derived: the kernel rounds each slot's SwiGLU output to bf16 and the result to bf16, so
|error| <= 2^-8 |out| + 2^-8 sum_s |w_s| (|act_s| @ |w2[e_s]|^T) (times 2 for the fp32 sums' order). Every
torch.empty of the launcher is NaN / -7 poisoned and its workspace is rebuilt, so an unwritten output or partial
cannot pass. CPU runs use the Triton interpreter (the three phases as three launches); the GPU tests run the
persistent grid with its barriers at Kimi-K2 and DeepSeek-V3 rank shapes, twice in a row and in a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

from test_moe import _poison_torch_empty

import specverify.moe_layer as block_mod
from specverify.moe_layer import moe_block
from specverify.reference.moe import fused_moe_reference, route_reference

# (H, I, E, top_k, scoring, bias, n_group, topk_group, renormalize, scale); each row says why it is there
CASES = {
    "kimi": (256, 64, 48, 6, "sigmoid", True, 1, 1, True, 2.827),  # Kimi-K2's recipe: sigmoid, bias, one group
    "grouped": (192, 32, 32, 4, "sigmoid", True, 4, 2, True, 2.5),  # DeepSeek-V3's: groups, H not a tile multiple
    "softmax": (128, 48, 20, 3, "softmax", False, 1, 1, False, 1.0),  # Qwen-style: no bias, no renorm, odd top_k,
}  # I not a multiple of the 32-row tile


def _weights(case, m, seed, device, dtype=torch.bfloat16):
    h, inter, e, top_k, scoring, has_bias, n_group, topk_group, renorm, scale = CASES[case]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(dtype).to(device)

    x = rnd(m, h, std=1.0)
    router = rnd(e, h, std=h ** -0.5)
    w13 = rnd(e + 1, 2 * inter, h, std=h ** -0.5)
    w2 = rnd(e + 1, h, inter, std=inter ** -0.5)
    bias = (torch.randn(e, generator=g) * 0.05).to(device) if has_bias else None
    kw = dict(top_k=top_k, scoring=scoring, correction_bias=bias, n_group=n_group, topk_group=topk_group,
              renormalize=renorm, routed_scaling_factor=scale)
    return x, router, w13, w2, kw


def check_block(res, x, router, w13, w2, kw):
    m, h = x.shape
    e = router.shape[0]
    top_k = kw["top_k"]
    assert res.out.shape == (m, h) and res.out.dtype == x.dtype
    assert res.topk_ids.shape == (m, top_k + 1) and res.topk_ids.dtype == torch.int32
    assert res.topk_weights.shape == (m, top_k + 1) and res.topk_weights.dtype == torch.float32
    # logits: fp32 sums of h bf16 products, in the kernel's order
    want = x.double() @ router.double().T
    mag = x.double().abs() @ router.double().abs().T
    tol = 4 * h * 2.0 ** -24 * mag + 1e-30
    assert ((res.router_logits.double() - want).abs() <= tol).all(), "router logits"
    # routing of the kernel's logits by the definition: ids exact, weights to fp32 rounding
    ids, w = route_reference(res.router_logits, top_k, scoring=kw["scoring"], correction_bias=kw["correction_bias"],
                             n_group=kw["n_group"], topk_group=kw["topk_group"], renormalize=kw["renormalize"],
                             routed_scaling_factor=kw["routed_scaling_factor"])
    assert torch.equal(res.topk_ids[:, :top_k], ids), "routed ids"
    torch.testing.assert_close(res.topk_weights[:, :top_k], w, rtol=4 * 2.0 ** -23, atol=1e-12)
    assert torch.equal(res.topk_ids[:, top_k].cpu(), torch.full((m,), e, dtype=torch.int32)), "shared slot id"
    assert torch.equal(res.topk_weights[:, top_k].cpu(), torch.ones(m)), "shared slot weight: exactly 1"
    # the output against the definition over the stacked weights, with the tolerance of the kernel's roundings
    ref = fused_moe_reference(x, w13, w2, res.topk_ids, res.topk_weights).double()
    got = res.out.double()
    assert not torch.isnan(got).any(), "an unwritten output (NaN poison)"
    ids_l = res.topk_ids.long()
    act = torch.nn.functional.silu(torch.einsum("mh,mkih->mki", x.double(), w13[ids_l].double()[..., :w2.shape[2], :]))
    act = act * torch.einsum("mh,mkih->mki", x.double(), w13[ids_l].double()[..., w2.shape[2]:, :])
    spread = torch.einsum("mk,mki,mkhi->mh", res.topk_weights.double().abs(), act.abs(), w2[ids_l].double().abs())
    tol = 2 * (2.0 ** -8 * ref.abs() + 2.0 ** -8 * spread) + 1e-6
    bad = (got - ref).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} outputs off; max error {(got - ref).abs().max():.3g}"


@pytest.fixture
def fresh_workspace(monkeypatch):
    """A NaN-poisoned launcher (torch.empty) and a workspace built for this test."""
    _poison_torch_empty(monkeypatch, block_mod)
    monkeypatch.setattr(block_mod, "_WS", {})


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("m", [1, 2, 3])
def test_moe_block_matches_reference(case, m, device, fresh_workspace):
    x, router, w13, w2, kw = _weights(case, m, seed=100 * m + len(case), device=device)
    check_block(moe_block(x, router, w13, w2, **kw), x, router, w13, w2, kw)


@pytest.mark.parametrize("programs", [12, 24])
@pytest.mark.parametrize("tiles", ["default", "32x128"])
def test_moe_block_split_k_and_row_ranges(programs, tiles, device, monkeypatch, fresh_workspace):
    """More programs than the tiny shapes' tiles: K split into whole-chunk parts (tickets, partial sums) in phases 1
    and 2, some of unequal length (H = 640: 5 chunks of 128, or at one token by default 3 of 256 with a partial
    last one, over 3 or 2 parts), and down rows in ranges that are not a power of two (54 / 27 rows)."""
    monkeypatch.setitem(CASES, "wide", (640, 64, 48, 6, "sigmoid", True, 1, 1, True, 2.827))
    monkeypatch.setattr(block_mod, "sm_count", lambda *a: programs)
    if tiles != "default":
        monkeypatch.setattr(block_mod, "_TILES", {})  # 32 x 128 tiles at every token count
    plan = block_mod._plan(1, 640, 64, 48, 6, programs)
    chunks = -(-640 // plan["BK"])
    assert plan["SPLIT1"] > 1 and plan["RH"] % 16  # the paths this test is for: splits, rows not a tile multiple,
    if plan["SPLIT1"] != chunks:  # and splits of unequal length (3 chunks over 3 parts: one each)
        assert chunks % plan["SPLIT1"] or chunks % plan["SPLIT2"]
    for m in (1, 2):
        x, router, w13, w2, kw = _weights("wide", m, seed=programs + m, device=device)
        check_block(moe_block(x, router, w13, w2, **kw), x, router, w13, w2, kw)


@pytest.mark.parametrize("bn,bk", [(16, 256), (8, 512)])
def test_moe_block_other_tiles(bn, bk, device, monkeypatch, fresh_workspace):
    """The tiles ``bench/bench_moe_block.py --configs`` sweeps at every token count (one token's default is 16 x
    256): 32 / 16 weight rows a tile over 256 / 512-column chunks (H = 640 leaves a partial last chunk)."""
    monkeypatch.setitem(CASES, "wide", (640, 64, 48, 6, "sigmoid", True, 1, 1, True, 2.827))
    monkeypatch.setattr(block_mod, "_TILES", {})
    monkeypatch.setattr(block_mod, "_BN", bn)
    monkeypatch.setattr(block_mod, "_BK", bk)
    for m in (1, 2):
        x, router, w13, w2, kw = _weights("wide", m, seed=bn + bk + m, device=device)
        check_block(moe_block(x, router, w13, w2, **kw), x, router, w13, w2, kw)


def test_moe_block_workspace_sized_for_every_token_count(device, fresh_workspace):
    """The first call (one token) sizes the workspace for every count the forward runs through the block, so a
    graph captured later at two tokens allocates nothing."""
    x, router, w13, w2, kw = _weights("kimi", 1, seed=3, device=device)
    moe_block(x, router, w13, w2, **kw)
    (part, ticket, _), = block_mod._WS.values()
    before = (part.data_ptr(), ticket.data_ptr())
    x2, *_ = _weights("kimi", block_mod.MOE_BLOCK_MAX_M, seed=4, device=device)
    check_block(moe_block(x2, router, w13, w2, **kw), x2, router, w13, w2, kw)
    (part, ticket, _), = block_mod._WS.values()
    assert (part.data_ptr(), ticket.data_ptr()) == before


def test_moe_block_workspace_left_at_zero(device, fresh_workspace):
    """Tickets and barrier counters are back at zero after a call, so the next call (or graph replay) starts clean;
    a second call with new inputs is right too."""
    for seed in (1, 2):
        x, router, w13, w2, kw = _weights("kimi", 2, seed=seed, device=device)
        res = moe_block(x, router, w13, w2, **kw)
        check_block(res, x, router, w13, w2, kw)
        (_, ticket, bar), = block_mod._WS.values()
        assert int(ticket.abs().sum()) == 0 and int(bar.abs().sum()) == 0


def test_moe_block_fp16(device, fresh_workspace):
    x, router, w13, w2, kw = _weights("kimi", 1, seed=7, device=device, dtype=torch.float16)
    check_block(moe_block(x, router, w13, w2, **kw), x, router, w13, w2, kw)


@pytest.mark.parametrize("bad, err, match", [
    (dict(x=torch.zeros(0, 256, dtype=torch.bfloat16)), ValueError, "M must be in 1..16"),
    (dict(x=torch.zeros(17, 256, dtype=torch.bfloat16)), ValueError, "M must be in 1..16"),
    (dict(x=torch.zeros(1, 128, dtype=torch.bfloat16)), ValueError, "shapes disagree"),
    (dict(x=torch.zeros(1, 256, dtype=torch.float32)), TypeError, "bfloat16 or float16"),
    (dict(top_k=0), ValueError, "top_k must be an int"),
    (dict(top_k=True), TypeError, "top_k must be an int"),
    (dict(top_k=65), ValueError, "top_k must be at most 64"),
    (dict(n_group=5), ValueError, "n_group must be a positive int dividing"),
    (dict(n_group=16, topk_group=1), ValueError, "exceeds the experts of the kept groups"),
    (dict(renormalize="no"), TypeError, "renormalize must be a bool"),
    (dict(routed_scaling_factor="2"), TypeError, "routed_scaling_factor must be a Python float"),
    (dict(router=torch.zeros(256, 48, dtype=torch.bfloat16).t()), ValueError, "router must be contiguous"),
    (dict(w13=torch.zeros(49, 256, 128, dtype=torch.bfloat16).transpose(1, 2)), ValueError,
     "w13_all needs a unit stride"),
    (dict(scoring="relu"), ValueError, "scoring must be"),
    (dict(correction_bias=torch.zeros(3)), ValueError, "correction_bias must have shape"),
    (dict(correction_bias=torch.zeros(48, dtype=torch.int32)), TypeError, "floating-point"),
    (dict(router="w"), TypeError, "router must be a torch.Tensor"),
])
def test_moe_block_rejects_bad_input(bad, err, match, device):
    # every tensor on the test's device, so a GPU machine reaches the check each case is for
    bad = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in bad.items()}
    x, router, w13, w2, kw = _weights("kimi", 1, seed=0, device=device)
    x = bad.pop("x", x)
    router = bad.pop("router", router)
    w13 = bad.pop("w13", w13)
    kw.update(bad)
    with pytest.raises(err, match=match):
        moe_block(x, router, w13, w2, **kw)


def test_moe_block_needs_cuda_or_the_interpreter(monkeypatch):
    x, router, w13, w2, kw = _weights("kimi", 1, seed=0, device="cpu")
    monkeypatch.setattr(block_mod.envvars, "triton_interpret", lambda: False)
    with pytest.raises(ValueError, match="needs CUDA tensors.*TRITON_INTERPRET=1"):
        moe_block(x, router, w13, w2, **kw)


def test_moe_block_one_expert(device, monkeypatch, fresh_workspace):
    """E = 1 (the top-k's padded width is above the expert count): softmax gives the one expert weight 1."""
    monkeypatch.setitem(CASES, "one", (128, 32, 1, 1, "softmax", False, 1, 1, True, 1.0))
    x, router, w13, w2, kw = _weights("one", 2, seed=9, device=device)
    check_block(moe_block(x, router, w13, w2, **kw), x, router, w13, w2, kw)


# ---- GPU: the persistent grid with its barriers, at the verify pass's rank shapes -------------------------------
_RANK = {"kimi-k2": (7168, 256, 384, 8, "sigmoid", True, 1, 1, True, 2.827),
         "deepseek-v3": (7168, 256, 256, 8, "sigmoid", True, 8, 4, True, 2.5)}


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(_RANK))
@pytest.mark.parametrize("m", [1, 2, 4])
def test_moe_block_rank_shapes_gpu(model, m, monkeypatch):
    from conftest import check_graph_replay, warm_up_for_capture

    monkeypatch.setitem(CASES, model, _RANK[model])
    x, router, w13, w2, kw = _weights(model, m, seed=m, device="cuda")
    res = warm_up_for_capture(lambda: moe_block(x, router, w13, w2, **kw))
    check_block(res, x, router, w13, w2, kw)
    again = moe_block(x, router, w13, w2, **kw)  # deterministic: a fixed order everywhere
    assert torch.equal(again.out, res.out) and torch.equal(again.topk_ids, res.topk_ids)

    def step():
        return moe_block(x, router, w13, w2, **kw).out

    check_graph_replay(step, [x])
