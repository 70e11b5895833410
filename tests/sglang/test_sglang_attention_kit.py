"""(b) SGLang's own target-verify test kit passes with ``backend="specverify"``.

On CPU the kernels run in the Triton interpreter; on a machine with CUDA (and no ``TRITON_INTERPRET=1``) the kit
runs on CUDA tensors with the compiled kernels.

The kit builds a mock model runner, writes the prefix KV through SGLang's KV pool, hands the backend an EAGLE
verify batch (chain, or the kit's tree: root + two children) and compares with its own torch reference. We also
check that our kernel really ran (``STATS["verify_ours"]``), since the backend would pass by declining.

Sizes: head_dim 64 / MLA 512+64 because those are what our kernels serve (the kit defaults, 16 and 32+0, would be
declined); two requests with different prefix lengths; one prefix crosses a 16-token page boundary.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed: run in the venv made by .ci/sglang_env.sh")

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@pytest.fixture
def kit(sglang_loaded):
    try:
        import specverify.attention  # noqa: F401
    except Exception as exc:  # the kernel lands in parallel with the plugin
        pytest.skip(f"specverify.attention is not importable yet ({exc})")
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods.dense_attention import DenseAttentionCase
    from sglang.test.kits.attention_unittest.attention_methods.mla_attention import MLAAttentionCase
    from sglang.test.kits.attention_unittest.runner_modes import speculative_target_verify_runner as runner

    return runner, DenseAttentionCase, MLAAttentionCase, ForwardMode.TARGET_VERIFY, sglang_loaded


def _ran_ours(plugin, before):
    assert plugin.STATS["verify_ours"] > before, "the kit passed without our kernel running (backend declined)"


@pytest.mark.parametrize("page_size", [1, 16])  # 16: SGLang's paged pool, seen as pages by our kernel
@pytest.mark.parametrize("topk, draft", [(2, 3), (1, 4)])  # the kit's tree (root + 2 children); a chain
def test_gqa_target_verify(kit, testcase, page_size, topk, draft):
    runner, Dense, _, mode, plugin = kit
    case = Dense(name=f"specverify_gqa_p{page_size}_k{topk}", backend="specverify", forward_mode=mode, num_heads=4,
                 num_kv_heads=2, page_size=page_size, prefix_lens=(5, 17), extend_lens=(draft, draft))
    before = plugin.STATS["verify_ours"]
    # no_grad: the kit writes projected K/V into the pool in place, which autograd refuses on CPU tensors.
    with torch.no_grad():
        runner.run_dense_eagle_verify_case(testcase, case, topk=topk, device=DEVICE, dtype=torch.float16,
                                           head_dim=64, hidden_size=256)
    _ran_ours(plugin, before)


@pytest.mark.parametrize("topk, draft", [(2, 3), (1, 3)])
def test_mla_target_verify(kit, testcase, topk, draft):
    runner, _, MLA, mode, plugin = kit
    case = MLA(name=f"specverify_mla_k{topk}", backend="specverify", forward_mode=mode, num_heads=2, page_size=1,
               prefix_lens=(5, 0), extend_lens=(draft, draft))  # prefix 0: the draft tokens see only the tree
    before = plugin.STATS["verify_ours"]
    with torch.no_grad():
        runner.run_mla_eagle_verify_case(testcase, case, topk=topk, device=DEVICE, dtype=torch.float16,
                                         kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=256)
    _ran_ours(plugin, before)


def test_other_modes_stay_on_triton(kit, testcase):
    # EXTEND (prefill) goes to SGLang's Triton kernel untouched: the kit's extend case passes, ours does not run.
    runner, Dense, _, _, plugin = kit
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention

    case = Dense(name="specverify_extend", backend="specverify", forward_mode=ForwardMode.EXTEND, num_heads=4,
                 num_kv_heads=2, page_size=1, prefix_lens=(2, 4), extend_lens=(3, 1))
    before = plugin.STATS["verify_ours"]
    with torch.no_grad():
        dense_attention.run_dense_attention_case(testcase, case, device=DEVICE, dtype=torch.float16, head_dim=64,
                                                 hidden_size=256)
    assert plugin.STATS["verify_ours"] == before


def test_mask_layouts_agree(sglang_loaded):
    # The FULL layout's tree block and the compact layout give the same packed mask.
    from specverify.integrations.sglang_backend import _tree_block_of_full_mask, pack_bool_rows
    from specverify.tree import DraftTree

    g = torch.Generator().manual_seed(0)
    d, seq = 5, torch.tensor([3, 0, 7])  # a zero prefix between two others
    trees = [DraftTree([-1, 0, 0, 1, 2]), DraftTree.chain(5), DraftTree([-1, 0, 1, 1, 0])]
    blocks, full = [], []
    for t, s in zip(trees, seq.tolist()):
        a = t.ancestor_mask()
        blocks.append(a)
        rows = torch.ones(d, s + d, dtype=torch.bool)
        rows[:, :s] = torch.rand(d, s, generator=g) > 2  # prefix columns are never read: make them all False
        rows[:, s:] = a
        full.append(rows.reshape(-1))
    full = torch.cat(full).to(torch.uint8)
    got = pack_bool_rows(_tree_block_of_full_mask(full, seq, d))
    want = torch.stack([t.packed_mask() for t in trees])
    assert torch.equal(got, want)
