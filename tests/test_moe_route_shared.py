"""moe_route with the shared expert's slot (``shared_expert_id``): the router writes ids / weights [M, top_k + 1].

Columns 0 .. top_k - 1 must be bit-identical to the call without the shared slot (which test_moe.check_route holds
to route_reference), column top_k is exactly ``shared_expert_id`` with weight 1.0, and the whole table equals
route_reference's with that column appended (impl="reference"). With ``block_size`` the alignment covers all
top_k + 1 slots of every token over ``max(E, shared_expert_id + 1)`` experts (against align_reference). Every
torch.empty of the launchers is NaN / -7 poisoned, so an unwritten slot cannot pass. Sizes are tiny (interpreter);
the GPU test runs Kimi-K2's router. Bad values of ``shared_expert_id``: tests/test_moe_errors.py.
"""
from __future__ import annotations

import pytest
import torch

from test_moe import _poison_torch_empty, check_alignment, check_route

import specverify.moe as moe_mod
from specverify.moe import moe_route
from specverify.reference.moe import route_reference

# (E, top_k, scoring, bias, n_group, topk_group, scale); each row says why it is there
CASES = {
    "sigmoid_bias": (37, 4, "sigmoid", True, 1, 1, 2.5),  # Kimi-K2's recipe at a prime expert count
    "softmax": (10, 3, "softmax", False, 1, 1, 1.0),  # Qwen3's recipe (no bias), odd top_k (TOPK_P pads)
    "grouped": (16, 4, "sigmoid", True, 4, 2, 2.5),  # DeepSeek-V3's recipe: groups of 4, two kept
}


def _args(case, m, seed):
    e, top_k, scoring, has_bias, n_group, topk_group, scale = CASES[case]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, e, generator=g)
    bias = torch.randn(e, generator=g) * 0.05 if has_bias else None
    kw = dict(top_k=top_k, scoring=scoring, correction_bias=bias, n_group=n_group, topk_group=topk_group,
              routed_scaling_factor=scale)
    return x, kw


def _to(kw, device):
    out = dict(kw)
    if out["correction_bias"] is not None:
        out["correction_bias"] = out["correction_bias"].to(device)
    return out


def _check_shared(ids, w, routed_ids, routed_w, top_k, shared_id, e):
    """[M, top_k + 1] outputs: routed columns bit-identical to the plain call, the shared column exact."""
    m = routed_ids.shape[0]
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids.shape == (m, top_k + 1) and w.shape == (m, top_k + 1)
    assert ids.is_contiguous() and w.is_contiguous()
    assert not torch.isnan(w).any(), "an unwritten weight (NaN poison)"
    assert torch.equal(ids[:, :top_k], routed_ids) and torch.equal(w[:, :top_k], routed_w)
    assert int(ids[:, :top_k].min()) >= 0 and int(ids[:, :top_k].max()) < e
    assert torch.equal(ids[:, top_k].cpu(), torch.full((m,), shared_id, dtype=torch.int32))
    assert torch.equal(w[:, top_k].cpu(), torch.ones(m))  # 1.0: not scaled, not renormalised


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("m", [1, 3, 17])  # one token; a few; 17 programs (one per token: no alignment here)
@pytest.mark.parametrize("extra", [0, 5])  # the shared id right after the routed experts, and past them
def test_shared_slot_matches_reference(device, monkeypatch, case, m, extra):
    _poison_torch_empty(monkeypatch, moe_mod)
    x, kw = _args(case, m, seed=100 * m + extra + len(case))
    e, top_k = x.shape[1], kw["top_k"]
    sid = e + extra
    dkw = _to(kw, device)
    rid, rw = check_route(x.to(device), top_k, kw["scoring"], dkw["correction_bias"], kw["n_group"],
                          kw["topk_group"], True, kw["routed_scaling_factor"])
    ids, w = moe_route(x.to(device), shared_expert_id=sid, impl="triton", **dkw)
    _check_shared(ids, w, rid, rw, top_k, sid, e)
    # the whole table against route_reference with the column appended (what impl="reference" returns)
    ref_ids, ref_w = route_reference(x, top_k, kw["scoring"], kw["correction_bias"], kw["n_group"], kw["topk_group"],
                                     True, kw["routed_scaling_factor"])
    want_ids = torch.cat([ref_ids, torch.full((m, 1), sid, dtype=torch.int32)], 1)
    want_w = torch.cat([ref_w, torch.ones(m, 1)], 1)
    got_ids, got_w = moe_route(x, shared_expert_id=sid, impl="reference", **kw)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)
    assert torch.equal(ids.cpu(), want_ids), "expert ids differ from route_reference + the shared column"
    # weights: the routed columns are bit-identical to rw, which check_route held to the fp64 weights within twice
    # the reference's own error (plus a floor); the shared column is exactly 1.0 (_check_shared)


@pytest.mark.parametrize("case", ["sigmoid_bias", "grouped"])
@pytest.mark.parametrize("m, block_size", [
    (1, 4),  # 5 slots: the one-program alignment in registers
    (3, 16),  # 15 slots, one block per expert
    (17, 4),  # 85 slots: the multi-slot alignment with the workspace; the shared expert fills whole blocks
])
def test_shared_slot_with_alignment(device, monkeypatch, case, m, block_size):
    _poison_torch_empty(monkeypatch, moe_mod)
    x, kw = _args(case, m, seed=7 * m + block_size)
    e, top_k = x.shape[1], kw["top_k"]
    sid = e + 2  # past the routed experts: the alignment must count max(E, sid + 1) experts
    dkw = _to(kw, device)
    plain = moe_route(x.to(device), impl="triton", **dkw)
    ids, w, al = moe_route(x.to(device), shared_expert_id=sid, block_size=block_size, impl="triton", **dkw)
    _check_shared(ids, w, plain[0], plain[1], top_k, sid, e)
    check_alignment(ids, sid + 1, block_size, al)  # every top_k + 1 slot, sentinel M * (top_k + 1)
    n = int(al.num_tokens_post_padded.item())
    used = al.sorted_token_ids[:n].cpu()
    assert int((used == m * (top_k + 1)).sum()) == n - m * (top_k + 1), "padding must be the sentinel M*(top_k+1)"
    assert sorted(used[used < m * (top_k + 1)].tolist()) == list(range(m * (top_k + 1))), "every slot once"
    # the reference path gives the same table and the same alignment
    rid, rw, ral = moe_route(x, shared_expert_id=sid, block_size=block_size, impl="reference", **kw)
    assert torch.equal(ids.cpu(), rid)
    assert int(ral.num_tokens_post_padded) == n
    assert torch.equal(al.expert_ids.cpu(), ral.expert_ids)
    assert al.sorted_token_ids.shape == ral.sorted_token_ids.shape


def test_shared_id_inside_the_routed_range(device):
    # a shared id below E is allowed (the caller's stacking); the alignment then counts E experts
    x, kw = _args("softmax", 3, seed=3)
    dkw = _to(kw, device)
    ids, w, al = moe_route(x.to(device), shared_expert_id=0, block_size=4, impl="triton", **dkw)
    assert torch.equal(ids[:, -1].cpu(), torch.zeros(3, dtype=torch.int32))
    check_alignment(ids, x.shape[1], 4, al)


@pytest.mark.parametrize("block_size", [None, 4])
def test_shared_slot_no_tokens(device, block_size):
    # an empty batch: [0, top_k + 1] outputs, no launch; the alignment is all padding
    res = moe_route(torch.zeros(0, 12, device=device), top_k=2, shared_expert_id=12, block_size=block_size,
                    impl="triton")
    assert res[0].shape == (0, 3) and res[1].shape == (0, 3)
    if block_size is not None:
        assert int(res[2].num_tokens_post_padded) == 0 and bool((res[2].expert_ids == -1).all())


def test_launcher_never_aligns_with_the_shared_slot(device):
    # one launch writes the shared slot or aligns, never both (the kernel's OUT_K = TOP_K + 1 has no DO_ALIGN)
    with pytest.raises(ValueError, match="routing alone"):
        moe_mod._launch_route_align(torch.zeros(2, 12, device=device), None, 2, False, 1, 1, True, 1.0, 16,
                                    shared_expert_id=12)
    with pytest.raises(ValueError, match="routing alone"):
        moe_mod._launch_route_align(None, None, 2, False, 1, 1, False, 1.0, None,
                                    topk_ids=torch.zeros(2, 2, dtype=torch.int32, device=device), num_experts=12,
                                    shared_expert_id=12)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("block_size", [None, 16])
def test_shared_slot_kimi_k2_gpu(m, block_size):
    # Kimi-K2's router: 384 experts, top-8, sigmoid + bias, scale 2.827; the shared expert stacked as expert 384
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 384, generator=g).bfloat16().cuda()
    bias = (torch.randn(384, generator=g) * 0.05).cuda()
    rid, rw = check_route(x, 8, bias=bias, scale=2.827)
    res = moe_route(x, top_k=8, correction_bias=bias, routed_scaling_factor=2.827, shared_expert_id=384,
                    block_size=block_size, impl="triton")
    _check_shared(res[0], res[1], rid, rw, 8, 384, 384)
    ref_ids, _ = moe_route(x.cpu(), top_k=8, correction_bias=bias.cpu(), routed_scaling_factor=2.827,
                           shared_expert_id=384, impl="reference")
    assert torch.equal(res[0].cpu(), ref_ids)
    if block_size is not None:
        check_alignment(res[0], 385, block_size, res[2])
