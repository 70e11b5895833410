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
from specverify.tree import DraftTree

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
    with pytest.raises(ValueError, match="PARTIAL_DTYPE must be one of"):
        plan_tree_attention_mla(max_batch=1, num_draft_tokens=1, num_heads=8, max_context=16, device="cpu",
                                config={"BLOCK_N": 16, "PARTIAL_DTYPE": "fp8"})
    with pytest.raises(ValueError, match="MERGE_BLOCK_DV must be a power of two"):
        plan_tree_attention(max_batch=1, num_draft_tokens=1, num_q_heads=4, num_kv_heads=4, head_dim=64,
                            max_context=16, device="cpu", config={"BLOCK_N": 16, "MERGE_BLOCK_DV": 48})


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
