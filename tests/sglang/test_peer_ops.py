"""The ``sglang`` verify-wall peer (``specverify.peers.sglang``, and its op table
``specverify.forward.ops.sglang_ops``) against specverify's references.

SGLang's kernels run under the Triton interpreter on CPU (fp32/fp16 inputs: the interpreter's bf16 ``tl.dot`` is
broken here). Attention and expert outputs are held to twice torch's own error against an fp64 reference plus a
floor; routing ids and the alignment must match exactly, routing weights within a few fp32 ulps.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed: run in the venv made by .ci/sglang_env.sh")

pytestmark = pytest.mark.sglang

# These checks run SGLang's kernels on CPU tensors under the interpreter; on a GPU machine run them with
# TRITON_INTERPRET=1 (the GPU check is test_peer_decode.py::test_sglang_ops_capture_and_replay_each_mode).
interpreter = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU-tensor interpreter check: set TRITON_INTERPRET=1 to run it here")


import standins  # noqa: E402  (tests/sglang is on sys.path: conftest.py)

standins.transformers_sees_no_torchvision()

from specverify.peers import sglang as peer  # noqa: E402
from specverify.reference.attention import tree_attention_mla_reference, tree_attention_reference  # noqa: E402
from specverify.reference.moe import align_reference, fused_moe_reference, route_reference  # noqa: E402


def _piece(name):
    st = peer._load()
    if st["mods"].get(name) is None:
        pytest.skip(f"SGLang piece {name} does not import here: {st['why'].get(name) or st['why'].get('sglang')}")


def test_available_reports_a_reason():
    ok, why = peer.available()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    assert ok, why  # sglang imports in this environment (importorskip above), so its attention kernel must too


# ------------------------------------------------------------------------------------------------ attention

PAGE = 4


def _paged_case(gen, batch, k, prefix, width, pages_per_row=4, num_pages=12):
    """A NaN-poisoned paged cache of ``width`` trailing dims where only the slots requests use hold values."""
    perm = torch.randperm(num_pages, generator=gen)[: batch * pages_per_row]
    page_table = perm.view(batch, pages_per_row).to(torch.int32)
    prefix_lens = torch.tensor(prefix, dtype=torch.int32)
    cache = torch.full((num_pages, PAGE) + width, float("nan"), dtype=torch.float32)
    flat = cache.view(num_pages * PAGE, *width)
    for b in range(batch):
        for t in range(int(prefix_lens[b]) + k):
            slot = int(page_table[b, t // PAGE]) * PAGE + t % PAGE
            flat[slot] = torch.randn(width, generator=gen, dtype=torch.float32)
    return cache, page_table, prefix_lens


# node 0 root; 1, 2 children of 0; 3 child of 1; 4 child of 2 (a top-2 tree of depth 2)
_TREE5 = torch.tensor([[0b00001], [0b00011], [0b00101], [0b01011], [0b10101]], dtype=torch.uint8)


def _masks(batch, k):
    out = {"chain": None}
    if k == 5:
        out["tree"] = _TREE5
        per = torch.stack([_TREE5, torch.tensor([[1], [3], [7], [15], [31]], dtype=torch.uint8)])  # tree + chain
        out["per_request"] = per[:batch]
    return out


def _tol(out, ref64, torch_out):
    """2x torch's own fp32 error against fp64, plus a floor."""
    torch_err = (torch_out.double() - ref64).abs().max().item()
    return 2 * torch_err + 1e-5 * max(1.0, ref64.abs().max().item())


# prefix 7 with page 4: the draft tokens start mid-page and cross a page boundary; prefix 0: no prefix at all
# (the kernel's prefix loop is empty); k = 1: a one-token (decode-shaped) pass.
@pytest.mark.parametrize("k, prefix", [(5, [7, 0]), (1, [9, 3])])
@interpreter
def test_tree_attention_gqa_matches_reference(k, prefix):
    _piece("attention")
    gen = torch.Generator().manual_seed(11 + k)
    batch, hq, hkv, d = 2, 4, 2, 16
    kc, pt, pl = _paged_case(gen, batch, k, prefix, (hkv, d))
    vc = kc.clone()
    vflat = vc.view(-1, hkv, d)
    finite = ~torch.isnan(vflat[:, 0, 0])
    vflat[finite] = torch.randn(int(finite.sum()), hkv, d, generator=gen)
    q = torch.randn(batch, k, hq, d, generator=gen)
    for name, mask in _masks(batch, k).items():
        out = peer.tree_attention(q, kc, vc, page_table=pt, prefix_lens=pl, tree_mask=mask, sm_scale=0.25)
        ref64 = tree_attention_reference(q.double(), kc.double(), vc.double(), pt, pl, mask, 0.25)
        ref32 = tree_attention_reference(q, kc, vc, pt, pl, mask, 0.25)
        assert out.shape == (batch, k, hq, d) and out.dtype == q.dtype
        assert torch.isfinite(out).all(), name
        err = (out.double() - ref64).abs().max().item()
        assert err <= _tol(out, ref64, ref32), (name, err)


@pytest.mark.parametrize("k, prefix", [(5, [6, 11])])
@interpreter
def test_tree_attention_mla_matches_reference(k, prefix):
    _piece("attention")
    gen = torch.Generator().manual_seed(23)
    batch, h, r, dr = 2, 3, 32, 16  # 3 heads: not a power of two
    kv, pt, pl = _paged_case(gen, batch, k, prefix, (r + dr,))
    ql = torch.randn(batch, k, h, r, generator=gen)
    qr = torch.randn(batch, k, h, dr, generator=gen)
    for name, mask in _masks(batch, k).items():
        out = peer.tree_attention_mla(ql, qr, kv, page_table=pt, prefix_lens=pl, tree_mask=mask, sm_scale=0.2)
        ref64 = tree_attention_mla_reference(ql.double(), qr.double(), kv.double(), pt, pl, mask, 0.2)
        ref32 = tree_attention_mla_reference(ql, qr, kv, pt, pl, mask, 0.2)
        assert out.shape == (batch, k, h, r)
        assert torch.isfinite(out).all(), name
        err = (out.double() - ref64).abs().max().item()
        assert err <= _tol(out, ref64, ref32), (name, err)


@interpreter
def test_tree_attention_rejects_a_wrong_mask():
    _piece("attention")
    q = torch.zeros(1, 3, 2, 16)
    kc = torch.zeros(4, PAGE, 1, 16)
    pt = torch.zeros(1, 2, dtype=torch.int32)
    pl = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(TypeError, match="uint8"):
        peer.tree_attention(q, kc, kc, page_table=pt, prefix_lens=pl, tree_mask=torch.ones(3, 3), sm_scale=1.0)
    with pytest.raises(ValueError, match=r"\[3, 1\]"):
        peer.tree_attention(q, kc, kc, page_table=pt, prefix_lens=pl,
                            tree_mask=torch.ones(3, 2, dtype=torch.uint8), sm_scale=1.0)


# ------------------------------------------------------------------------------------------------ MoE

# (M, E, top_k, n_group, topk_group, scoring): Kimi-like one group, DeepSeek-like grouped, Qwen-like softmax;
# 13 experts (prime) with top-1.
_ROUTES = [(3, 12, 3, 1, 1, "sigmoid"), (4, 16, 4, 4, 2, "sigmoid"), (5, 10, 2, 1, 1, "softmax"),
           (2, 13, 1, 1, 1, "sigmoid")]


@pytest.mark.parametrize("m, e, top_k, n_group, topk_group, scoring", _ROUTES)
@interpreter
def test_route_and_align_match_reference(m, e, top_k, n_group, topk_group, scoring):
    _piece("router")
    _piece("align")
    gen = torch.Generator().manual_seed(5 * m + e)
    logits = torch.randn(m, e, generator=gen)
    bias = torch.randn(e, generator=gen) * 0.05 if scoring == "sigmoid" else None
    block = 4
    ids, w, sorted_ids, expert_ids, ntpp = peer.route_and_align(
        logits, bias, block, top_k=top_k, scoring=scoring, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=2.5)
    rid, rw = route_reference(logits, top_k, scoring, bias, n_group, topk_group, True, 2.5)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, rid)
    torch.testing.assert_close(w, rw, rtol=4e-7, atol=1e-7)
    rs, re_, rn = align_reference(rid, e, block)
    n = int(ntpp)
    assert n == int(rn)
    assert torch.equal(sorted_ids[:n], rs)  # SGLang's one-launch alignment is stable inside an expert
    assert torch.equal(expert_ids[: n // block], re_)


# top-1 writes the expert output directly, top-2 adds two rows, top-3 goes through SGLang's sum-reduce kernel;
# 7 experts with 5 tokens x 3 leaves experts empty.
@pytest.mark.parametrize("m, e, top_k", [(2, 4, 1), (3, 8, 2), (5, 7, 3)])
@interpreter
def test_fused_experts_matches_reference(m, e, top_k):
    _piece("experts")
    _piece("align")
    gen = torch.Generator().manual_seed(100 + m)
    h, inter = 32, 16
    hidden = (torch.randn(m, h, generator=gen) * 0.5).half()
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) / h ** 0.5).half()
    w2 = (torch.randn(e, h, inter, generator=gen) / inter ** 0.5).half()
    ids, w = route_reference(torch.randn(m, e, generator=gen), top_k, "sigmoid", routed_scaling_factor=1.5)
    out = peer.fused_experts(hidden, w13, w2, w, ids)
    ref64 = fused_moe_reference(hidden.double(), w13.double(), w2.double(), ids, w.double())
    torch16 = fused_moe_reference(hidden, w13, w2, ids, w, compute_dtype=torch.float16)
    assert out.shape == (m, h) and out.dtype == torch.float16
    err = (out.double() - ref64).abs().max().item()
    torch_err = (torch16.double() - ref64).abs().max().item()
    assert err <= 2 * torch_err + 2e-3 * ref64.abs().max().item(), (err, torch_err)


# ------------------------------------------------------------------------------------------------ op table

def _forward_case(model, gen, prefix, k=4):
    from specverify.forward.model import VerifyModel  # noqa: F401 - documents the type

    caches = model.allocate_kv(16, PAGE)
    page_table = torch.randperm(16, generator=gen)[:16].view(2, 8).to(torch.int32)
    prefix_lens = torch.tensor(prefix, dtype=torch.int32)
    ids = torch.randint(0, model.config.vocab_size, (2, k), generator=gen)
    depth = torch.tensor([[0, 1, 1, 2]] * 2)
    mask = torch.tensor([[1], [3], [5], [11]], dtype=torch.uint8)
    return caches, page_table, prefix_lens, ids, depth, mask


@pytest.mark.parametrize("name", ["tiny-mla-moe", "tiny-gqa-moe"])
@interpreter
def test_sglang_ops_forward_matches_reference_and_refreshes(name):
    _piece("experts")
    from specverify.forward.model import VerifyModel
    from specverify.forward.ops import Ops, sglang_ops

    gen = torch.Generator().manual_seed(7)
    model = VerifyModel(name, dtype=torch.float16, num_layers=2)
    caches, pt, pl, ids, depth, mask = _forward_case(model, gen, [7, 13])
    ops, note = sglang_ops(model)
    assert ops.pieces["attention"] == ops.pieces["moe_route"] == ops.pieces["experts"] == "sglang"
    assert "incomplete" not in ops.pieces, ops.pieces  # every piece SGLang runs here is SGLang's
    assert "reference" in note and "acceptance" in note
    for prefix in ([7, 13], [10, 2]):  # the second pass changes prefix_lens in place: metadata must follow
        pl.copy_(torch.tensor(prefix, dtype=torch.int32))
        pos = pl.long().unsqueeze(1) + depth
        model.ops = Ops()
        ref = model.forward(ids, pos, caches, pt, pl, mask).double()
        model.ops = ops
        out = model.forward(ids, pos, caches, pt, pl, mask).double()
        # fp16 end to end through two layers: a few fp16 ulps of the logits' scale
        assert (out - ref).abs().max().item() <= 4e-3 * max(1.0, ref.abs().max().item()), prefix
