"""Bad inputs to tree_attention / tree_attention_mla / the plan builders: each raises with expected, got and a fix.

No kernel runs here except where a valid call is the point; every check happens before a launch.
"""
from __future__ import annotations

import pytest
import torch

from specverify.attention import (
    plan_tree_attention,
    plan_tree_attention_mla,
    tree_attention,
    tree_attention_mla,
)
from specverify.tree import BatchedDraftTree, DraftTree, pack_mask

B, K, HQ, HKV, D, PS, PAGES = 2, 3, 4, 2, 64, 16, 6


def gqa_inputs(**over):
    args = dict(
        q=torch.zeros(B, K, HQ, D, dtype=torch.bfloat16),
        k_cache=torch.zeros(PAGES, PS, HKV, D, dtype=torch.bfloat16),
        v_cache=torch.zeros(PAGES, PS, HKV, D, dtype=torch.bfloat16),
        page_table=torch.tensor([[0, 1, 99], [2, 3, 4]], dtype=torch.int32),  # 99: never read (request 0 is short)
        prefix_lens=torch.tensor([10, 40], dtype=torch.int32),
        tree_mask=DraftTree([-1, 0, 0]).packed_mask(),
        sm_scale=0.125,
    )
    args.update(over)
    return args


def call_gqa(**over):
    a = gqa_inputs(**over)
    return tree_attention(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), impl="reference", **a)


def mla_inputs(**over):
    args = dict(
        q_latent=torch.zeros(B, K, 8, 64, dtype=torch.bfloat16),
        q_rope=torch.zeros(B, K, 8, 16, dtype=torch.bfloat16),
        kv_cache=torch.zeros(PAGES, PS, 80, dtype=torch.bfloat16),
        page_table=torch.tensor([[0, 1, 5], [2, 3, 4]], dtype=torch.int32),
        prefix_lens=torch.tensor([10, 40], dtype=torch.int32),
        sm_scale=0.1,
    )
    args.update(over)
    return args


def call_mla(**over):
    a = mla_inputs(**over)
    return tree_attention_mla(a.pop("q_latent"), a.pop("q_rope"), a.pop("kv_cache"), impl="reference", **a)


def test_valid_inputs_pass():
    """The fixtures themselves are valid (so each failure below is caused by the one change it makes)."""
    assert call_gqa().shape == (B, K, HQ, D)
    assert call_mla().shape == (B, K, 8, 64)


@pytest.mark.parametrize("over, exc, words", [
    ({"q": torch.zeros(B, K, HQ, D)}, TypeError, "bfloat16/float16"),
    ({"k_cache": torch.zeros(PAGES, PS, HKV, D, dtype=torch.float16)}, TypeError, "share a dtype"),
    ({"q": torch.zeros(B, K, HQ, 32, dtype=torch.bfloat16)}, ValueError, "head_dim"),
    ({"q": torch.zeros(B, K, 3, D, dtype=torch.bfloat16)}, ValueError, "multiple of num_kv_heads"),
    ({"q": torch.zeros(K, HQ, D, dtype=torch.bfloat16)}, ValueError, "4-D"),
    ({"v_cache": torch.zeros(PAGES, PS, HKV, 32, dtype=torch.bfloat16)}, ValueError, "k_cache's shape"),
    ({"page_table": torch.zeros(3, 3, dtype=torch.int32)}, ValueError, "one row per request"),
    ({"page_table": torch.zeros(B, 3)}, TypeError, "int32/int64"),
    ({"prefix_lens": torch.zeros(B + 1, dtype=torch.int32)}, ValueError, "prefix_lens must be [batch=2]"),
    ({"tree_mask": torch.ones(K, K, dtype=torch.int64)}, ValueError, "uint8 of shape"),
    ({"tree_mask": torch.ones(K, 2, dtype=torch.uint8)}, ValueError, "[3, 1]"),
    ({"tree_mask": torch.ones(B + 1, K, 1, dtype=torch.uint8)}, ValueError, "per request"),
    ({"out": torch.zeros(B, K, HQ, D, dtype=torch.float16)}, ValueError, "out must be bfloat16"),
    ({"out": torch.zeros(B, K, HQ, 2 * D, dtype=torch.bfloat16)[..., ::2]}, ValueError, "contiguous last dim"),
    ({"k_cache": torch.zeros(PAGES, PS, HKV, 2 * D, dtype=torch.bfloat16)[..., ::2]}, ValueError,
     "contiguous head_dim"),
    ({"impl": "cuda"}, ValueError, "impl must be one of"),
])
def test_gqa_static_errors(over, exc, words):
    a = gqa_inputs(**{k: v for k, v in over.items() if k != "impl"})
    impl = over.get("impl", "reference")
    with pytest.raises(exc) as info:
        tree_attention(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), impl=impl, **a)
    assert words in str(info.value)


@pytest.mark.parametrize("over, words", [
    # request 1 reads pages 0..2 of its row: id 6 is past the pool of 6 pages
    ({"page_table": torch.tensor([[0, 1, 99], [2, 3, 6]], dtype=torch.int32)}, "page_table[1, 2] = 6"),
    ({"page_table": torch.tensor([[-1, 1, 99], [2, 3, 4]], dtype=torch.int32)}, "page_table[0, 0] = -1"),
    ({"prefix_lens": torch.tensor([10, -1], dtype=torch.int32)}, "prefix_lens[1] = -1"),
    # 46 + 3 draft tokens = 49 > 3 pages x 16
    ({"prefix_lens": torch.tensor([10, 46], dtype=torch.int32)}, "needs prefix_lens + num_draft_tokens = 49"),
])
def test_gqa_data_errors(over, words):
    with pytest.raises(ValueError) as info:
        call_gqa(**over)
    assert words in str(info.value)


def test_validate_false_skips_value_checks(monkeypatch):
    """validate=False (the graph-capture path) never runs the host-syncing value checks; validate=True does."""
    import specverify.attention as attention

    calls = []
    monkeypatch.setattr(attention, "_check_data", lambda *a, **kw: calls.append(1))
    call_gqa(validate=False)
    assert calls == []
    call_gqa()
    assert calls == [1]


def test_triton_impl_without_backend(monkeypatch):
    """impl='triton' never falls back: CPU tensors without the interpreter raise; 'auto' falls back instead."""
    from specverify.attention import _kernels

    _kernels()  # imported under the interpreter first: imported with it off, later launches would want a GPU driver
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    a = gqa_inputs()
    with pytest.raises(ValueError, match="impl='triton' cannot run"):
        tree_attention(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), impl="triton", **a)
    a = gqa_inputs()
    out = tree_attention(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), impl="auto", **a)
    assert out.shape == (B, K, HQ, D)


@pytest.mark.parametrize("over, exc, words", [
    ({"q_rope": torch.zeros(B, K, 8, 16, dtype=torch.float16)}, TypeError, "share a dtype"),
    ({"q_rope": torch.zeros(B, K, 4, 16, dtype=torch.bfloat16)}, ValueError, "q_rope must be"),
    ({"kv_cache": torch.zeros(PAGES, PS, 96, dtype=torch.bfloat16)}, ValueError, "64 + 16 = 80"),
    ({"kv_cache": torch.zeros(PAGES, PS, 2, 80, dtype=torch.bfloat16)}, ValueError, "3-D"),
    ({"q_latent": torch.zeros(B, K, 8, 64, dtype=torch.float32)}, TypeError, "bfloat16/float16"),
    ({"tree_mask": torch.ones(K, dtype=torch.uint8)}, ValueError, "uint8 of shape"),
    ({"page_table": torch.tensor([[0, 1, 5], [2, 3, 7]], dtype=torch.int32)}, ValueError, "out of range [0, 6)"),
])
def test_mla_errors(over, exc, words):
    with pytest.raises(exc) as info:
        call_mla(**over)
    assert words in str(info.value)


def test_mla_head_axis_accepted():
    """SGLang keeps the latent cache as [pages, page_size, 1, R + Dr]; that layout is accepted as is."""
    a = mla_inputs()
    a["kv_cache"] = a["kv_cache"].unsqueeze(2)
    assert call_mla(kv_cache=a["kv_cache"]).shape == (B, K, 8, 64)


def test_plan_errors():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        plan_tree_attention(max_batch=1, num_draft_tokens=1, num_q_heads=6, num_kv_heads=4, head_dim=64,
                            max_context=16, device="cpu")
    with pytest.raises(ValueError, match="num_splits must be in"):
        plan_tree_attention_mla(max_batch=1, num_draft_tokens=1, num_heads=8, max_context=16, device="cpu",
                                num_splits=129)  # MAX_SPLITS is 128 (the merge reads all splits in one tile)
    with pytest.raises(ValueError, match="max_batch must be a positive int"):
        plan_tree_attention_mla(max_batch=0, num_draft_tokens=1, num_heads=8, max_context=16, device="cpu")
    with pytest.raises(ValueError, match="power of two"):
        plan_tree_attention(max_batch=1, num_draft_tokens=1, num_q_heads=4, num_kv_heads=4, head_dim=64,
                            max_context=16, device="cpu", config={"BLOCK_N": 24})
    with pytest.raises(ValueError, match="unknown keys"):
        plan_tree_attention(max_batch=1, num_draft_tokens=1, num_q_heads=4, num_kv_heads=4, head_dim=64,
                            max_context=16, device="cpu", config={"BLOCK_N": 16, "warps": 4})
    with pytest.raises(ValueError, match="PDL is a key of KERNEL='mla_wgmma'"):
        plan_tree_attention(max_batch=1, num_draft_tokens=1, num_q_heads=4, num_kv_heads=4, head_dim=64,
                            max_context=16, device="cpu", config={"BLOCK_N": 16, "PDL": True})


def test_plan_mismatch():
    small = plan_tree_attention(max_batch=1, num_draft_tokens=K, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                max_context=48, device="cpu")
    with pytest.raises(ValueError, match="exceeds the plan's max_batch 1"):
        call_gqa(plan=small)
    other_k = plan_tree_attention(max_batch=B, num_draft_tokens=K + 1, num_q_heads=HQ, num_kv_heads=HKV,
                                  head_dim=D, max_context=48, device="cpu")
    with pytest.raises(ValueError, match="plan was built for"):
        call_gqa(plan=other_k)
    with pytest.raises(TypeError, match="TreeAttentionPlan"):
        call_gqa(plan={"num_splits": 2})
    mla_plan = plan_tree_attention_mla(max_batch=B, num_draft_tokens=K, num_heads=8, max_context=48, device="cpu",
                                       kv_lora_rank=64, rope_dim=16)
    with pytest.raises(ValueError, match="plan was built for"):
        call_gqa(plan=mla_plan)


def test_wgmma_plan_refuses_unaligned_tensors():
    """A plan for the Gluon MLA kernel is refused before any launch when its 16-byte copies cannot be aligned (a KV
    row stride of 84 elements); the automatic plan takes the tl.dot kernels for such tensors instead."""
    import dataclasses

    from specverify.attention import _wgmma_copy_aligned

    a = mla_inputs()
    plan = plan_tree_attention_mla(max_batch=B, num_draft_tokens=K, num_heads=8, max_context=48, device="cpu",
                                   kv_lora_rank=64, rope_dim=16)
    wgmma_plan = dataclasses.replace(plan, config=dict(plan.config, KERNEL="mla_wgmma"))
    kv = torch.zeros(PAGES, PS, 84, dtype=torch.bfloat16)[..., :80]  # rows 84 elements apart
    assert _wgmma_copy_aligned(a["q_latent"], a["q_rope"], a["kv_cache"])
    assert not _wgmma_copy_aligned(a["q_latent"], a["q_rope"], kv)
    assert not _wgmma_copy_aligned(a["q_latent"][..., 1:], a["q_rope"], a["kv_cache"])  # base 2 bytes off
    a["kv_cache"] = kv
    with pytest.raises(ValueError, match="16-byte pieces.*SPECVERIFY_MLA_WGMMA=0"):
        tree_attention_mla(a.pop("q_latent"), a.pop("q_rope"), a.pop("kv_cache"), impl="triton", plan=wgmma_plan,
                           **a)


# ----------------------------------------------------------------------------------------------------------------
# tree_mask values: the ancestor mask of a tree (DraftTree's rule), checked with validate=True outside capture
# ----------------------------------------------------------------------------------------------------------------
def _run(op, impl="reference", **over):
    """One call of ``op`` on the valid fixture inputs with ``over`` replacing some of them."""
    if op == "tree_attention":
        a = gqa_inputs(**over)
        return tree_attention(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), impl=impl, **a)
    a = mla_inputs(**over)
    return tree_attention_mla(a.pop("q_latent"), a.pop("q_rope"), a.pop("kv_cache"), impl=impl, **a)


def _mask_with(rows, batched):
    """Bit-packed mask of K = 3 nodes from bool rows; batched: request 0 a valid [-1, 0, 0] tree, request 1 these."""
    m = torch.tensor(rows, dtype=torch.bool)
    if batched:
        m = torch.stack([DraftTree([-1, 0, 0]).ancestor_mask(), m])
    return pack_mask(m)


BAD_TREE_MASKS = [
    # id, rows (chain [-1, 0, 1] with one defect), words after "tree_mask[1] " / "tree_mask "
    ("no-diagonal", [[1, 0, 0], [1, 0, 0], [1, 1, 1]],
     "row 1 does not see its own node (bit 1 of row 1 is 0); every node must attend to itself: set the diagonal"),
    ("later-node", [[1, 0, 0], [1, 1, 1], [1, 1, 1]], "row 1 sees node 2, which comes after it"),
    ("second-root", [[1, 0, 0], [1, 1, 0], [0, 0, 1]], "row 2 sees no earlier node (only itself), so node 2 would be "
     "a second root"),
    ("not-parent-row", [[1, 0, 0], [1, 1, 0], [0, 1, 1]], "row 2 sees nodes [1, 2], but a node sees exactly its "
     "parent's nodes plus itself: its parent (the last earlier node it sees) is node 1, whose row sees [0, 1], so "
     "row 2 must see [0, 1, 2]"),
]


@pytest.mark.parametrize("case", BAD_TREE_MASKS, ids=[c[0] for c in BAD_TREE_MASKS])
@pytest.mark.parametrize("batched", [False, True], ids=["shared", "per-request"])
@pytest.mark.parametrize("op", ["tree_attention", "tree_attention_mla"])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_tree_mask_that_is_not_an_ancestor_mask(case, batched, op, impl):
    _, rows, words = case
    with pytest.raises(ValueError) as info:
        _run(op, impl, tree_mask=_mask_with(rows, batched))
    row = "tree_mask[1] " if batched else "tree_mask "
    msg = str(info.value)
    assert msg.startswith(f"{op}: {row}") and words in msg and "DraftTree.packed_mask()" in msg, msg


@pytest.mark.parametrize("op", ["tree_attention", "tree_attention_mla"])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_valid_tree_masks_pass(op, impl):
    """Per-request masks of two different trees (a fork and a chain), a shared one and a chain's explicit mask pass,
    and the explicit chain mask gives what no mask (causal) gives."""
    gen = torch.Generator().manual_seed(5)
    if op == "tree_attention":
        kc = torch.randn(PAGES, PS, HKV, D, generator=gen).bfloat16()
        data = dict(q=torch.randn(B, K, HQ, D, generator=gen).bfloat16(), k_cache=kc, v_cache=kc)
    else:
        data = dict(q_latent=torch.randn(B, K, 8, 64, generator=gen).bfloat16(),
                    q_rope=torch.randn(B, K, 8, 16, generator=gen).bfloat16(),
                    kv_cache=torch.randn(PAGES, PS, 80, generator=gen).bfloat16())
    masks = {"per-request": BatchedDraftTree([DraftTree([-1, 0, 0]), DraftTree.chain(K)]).packed_mask,
             "shared": DraftTree([-1, 0, 0]).packed_mask(), "chain": DraftTree.chain(K).packed_mask(), "none": None}
    outs = {name: _run(op, impl, tree_mask=mask, **data) for name, mask in masks.items()}
    assert all(torch.isfinite(o.float()).all() for o in outs.values())
    assert torch.equal(outs["chain"], outs["none"])


def test_tree_mask_check_skipped_when_asked_or_capturing(monkeypatch):
    """validate=False and CUDA-graph capture skip the (host-syncing) mask check; validate=True runs it."""
    import specverify.attention as attention
    import specverify.validation as validation

    bad = _mask_with(BAD_TREE_MASKS[0][1], batched=True)
    call_gqa(tree_mask=bad, validate=False)
    call_mla(tree_mask=bad, validate=False)
    with monkeypatch.context() as mp:
        mp.setattr(validation, "capturing", lambda: True)
        mp.setattr(attention, "capturing", lambda: True)
        call_gqa(tree_mask=bad)
        call_mla(tree_mask=bad)
    with pytest.raises(ValueError, match="does not see its own node"):
        call_mla(tree_mask=bad)
