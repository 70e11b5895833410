"""(c) Our trees, masks, greedy acceptance, routing and alignment against SGLang's own Triton kernels.

SGLang's kernels run under the Triton interpreter on the same inputs. Integer outputs must match exactly (as sets
inside an expert's run, whose order neither side specifies); routing weights within a few fp32 ulps, since the two
kernels sum and divide in different orders. Each comparison skips, naming the function, while the specverify
function it needs has not landed yet.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed: run in the venv made by .ci/sglang_env.sh")
# CPU tensors through the interpreter on both sides; on a GPU machine run this file with TRITON_INTERPRET=1.
pytestmark = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="compares under the Triton interpreter on CPU tensors")

from specverify.integrations import sglang as plugin  # noqa: E402


def _need(module: str, name: str):
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except Exception as exc:
        pytest.skip(f"{module}.{name} is not available yet ({exc.__class__.__name__}: {exc})")


# ------------------------------------------------------------------------------------------------ trees, masks

def _eagle_tree_inputs(bs, topk, steps, num_verify, gen):
    """EAGLE draft outputs the way SGLang's draft loop and organize_draft_results shape them (random scores)."""
    parents_list, score_list = [], []
    scores = torch.rand(bs, 1, topk, generator=gen)
    parents_list.append(torch.arange(-1, topk).unsqueeze(0).repeat(bs, 1))
    score_list.append(scores)
    for i in range(1, steps):
        expand = scores.reshape(bs, topk, 1) * torch.rand(bs, topk, topk, generator=gen)
        top = torch.topk(expand.flatten(1), topk, dim=-1)
        parents_list.append(top.indices + topk * topk * (i - 1) + topk)
        score_list.append(expand)
        scores = top.values
    flat = torch.cat([s.flatten(1) for s in score_list], dim=1)
    top_scores_index = torch.sort(torch.topk(flat, num_verify - 1, dim=-1).indices).values
    parent_list = torch.cat(parents_list[:-1], dim=1)
    return parent_list, top_scores_index


@pytest.mark.parametrize("topk, steps, num_verify", [(1, 3, 4), (2, 3, 6), (3, 2, 4), (4, 3, 8)])
def test_draft_tree_matches_sglang_tree_builder(sglang_loaded, topk, steps, num_verify):
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode, sgl_build_tree_kernel_triton

    from specverify.tree import DraftTree

    gen = torch.Generator().manual_seed(100 + topk * 10 + num_verify)
    bs = 3
    parent_list, sel = _eagle_tree_inputs(bs, topk, steps, num_verify, gen)
    seq_lens = torch.tensor([7, 1, 12])
    mask = torch.full((bs * num_verify * num_verify,), True)
    positions = torch.empty(bs * num_verify, dtype=torch.long)
    links = torch.full((3, bs, num_verify), -1, dtype=torch.long)
    sgl_build_tree_kernel_triton(parent_list, sel, seq_lens, mask, positions, links[0], links[1], links[2],
                                 topk, steps, num_verify, TreeMaskMode.QLEN_ONLY)
    mask = mask.view(bs, num_verify, num_verify)
    depth = positions.view(bs, num_verify) - seq_lens[:, None]
    for b in range(bs):
        # parent of node i: its deepest proper ancestor in SGLang's mask
        parents = [-1] + [max((j for j in range(i) if mask[b, i, j]), key=lambda j: int(depth[b, j]))
                          for i in range(1, num_verify)]
        tree = DraftTree(parents)
        assert torch.equal(tree.ancestor_mask(), mask[b]), f"request {b}: ancestor masks differ"
        assert torch.equal(tree.depth_tensor().to(torch.long), depth[b])
        index, nxt, sib = tree.retrieve_links()
        assert torch.equal(index + b * num_verify, links[0, b])
        assert torch.equal(nxt, links[1, b]) and torch.equal(sib, links[2, b])


def test_greedy_acceptance_matches_sglang(sglang_loaded):
    verify_greedy = _need("specverify.accept", "verify_greedy")
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton

    from specverify.tree import BatchedDraftTree, DraftTree

    gen = torch.Generator().manual_seed(7)
    trees = [DraftTree([-1, 0, 0, 1, 1, 2]), DraftTree.chain(6), DraftTree([-1, 0, 0, 0, 3, 4])]
    bs, d, vocab = len(trees), 6, 4  # a 4-token vocabulary makes matches (and duplicate siblings) likely
    draft = torch.randint(0, vocab, (bs, d), generator=gen)
    target = torch.randint(0, vocab, (bs, d), generator=gen)
    links = torch.stack([torch.stack(t.retrieve_links()) for t in trees], dim=1)  # [3, bs, d]
    links[0] += torch.arange(bs)[:, None] * d
    num_spec = max(t.max_depth for t in trees) + 1
    predicts = torch.full((bs * d,), -1, dtype=torch.long)
    accept_index = torch.full((bs, num_spec), -1, dtype=torch.long)
    accept_num = torch.zeros(bs, dtype=torch.long)
    verify_tree_greedy_triton(predicts, accept_index, accept_num, draft, links[0], links[1], links[2], target)

    tokens, length, nodes = verify_greedy(draft, BatchedDraftTree(trees), target_ids=target)
    assert torch.equal(length.cpu(), accept_num)
    for b in range(bs):
        n = int(accept_num[b]) + 1
        assert torch.equal(nodes[b, :n].cpu(), accept_index[b, :n] - b * d)
        assert torch.equal(tokens[b, :n].cpu(), predicts[accept_index[b, :n]])


# ------------------------------------------------------------------------------------------------ MoE routing

_ROUTING_CASES = [
    # (M, E, n_group, topk_group, top_k): DeepSeek-V3's layout shrunk (groups, top groups); a Kimi-K2-like single
    # group with a non-power-of-two expert count; one token.
    (5, 32, 4, 2, 4),
    (4, 24, 1, 1, 3),
    (1, 16, 2, 1, 2),
]


def _routing_inputs(m, e, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, e, generator=gen)
    bias = torch.randn(e, generator=gen) * 0.1
    return logits, bias


@pytest.mark.parametrize("m, e, n_group, topk_group, top_k", _ROUTING_CASES)
@pytest.mark.parametrize("scale_on_output", [False, True])
def test_routing_hook_matches_sglang_router(sglang_loaded, m, e, n_group, topk_group, top_k, scale_on_output):
    _need("specverify.moe", "moe_route")
    from sglang.kernels.ops.moe.moe_fused_gate import moe_fused_gate
    from sglang.srt.layers.moe import topk as sgl_topk

    logits, bias = _routing_inputs(m, e, seed=m * 1000 + e)
    plugin.reset_stats()
    kwargs = dict(hidden_states=logits, gating_output=logits, correction_bias=bias, topk=top_k, renormalize=True,
                  num_expert_group=n_group, topk_group=topk_group, num_fused_shared_experts=0,
                  routed_scaling_factor=2.5, apply_routed_scaling_factor_on_output=scale_on_output)
    w, ids = sgl_topk.biased_grouped_topk(**kwargs)  # the patched name SGLang's select_experts calls
    assert plugin.STATS["routing_ours"] == 1, "the hook declined"
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (m, top_k)

    ref_w, ref_ids = sgl_topk.biased_grouped_topk_impl(**kwargs)  # SGLang's torch router
    gate_w, gate_ids = moe_fused_gate(logits, bias, top_k, "sigmoid", 0, True, 2.5, scale_on_output,
                                      num_expert_group=n_group, topk_group=topk_group)  # SGLang's Triton router
    for other_ids, other_w, who in ((ref_ids, ref_w, "torch impl"), (gate_ids, gate_w, "moe_fused_gate")):
        mine = torch.sort(ids, dim=1)
        theirs = torch.sort(other_ids.to(torch.int32), dim=1)
        assert torch.equal(mine.values, theirs.values), f"expert sets differ from SGLang's {who}"
        torch.testing.assert_close(torch.gather(w, 1, mine.indices),
                                   torch.gather(other_w.float(), 1, theirs.indices), rtol=4e-7, atol=1e-7)


@pytest.mark.parametrize("m, e, top_k, block_size", [(5, 32, 4, 16), (3, 24, 3, 4), (1, 16, 2, 16)])
def test_alignment_hook_matches_sglang_small_numel(sglang_loaded, m, e, top_k, block_size):
    _need("specverify.moe", "moe_route")
    import importlib

    from sglang.kernels.ops.moe.moe_align_small_numel import moe_align_small_numel

    fused_moe = importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe")
    logits, bias = _routing_inputs(m, e, seed=7 * m + e)
    kwargs = dict(hidden_states=logits, gating_output=logits, correction_bias=bias, topk=top_k, renormalize=True,
                  num_expert_group=1, topk_group=1)
    from sglang.srt.layers.moe import topk as sgl_topk

    # First pass: the alignment hook learns fused_moe's block size for this shape (SGLang's own alignment needs
    # CUDA, so a stand-in original answers the learning call).
    _, ids = sgl_topk.biased_grouped_topk(**kwargs)
    plugin.alignment_around(lambda *a, **k: None, ids, block_size, e)
    plugin.reset_stats()
    _, ids = sgl_topk.biased_grouped_topk(**kwargs)
    sorted_ids, expert_ids, npad = fused_moe.moe_align_block_size(ids, block_size, e)
    assert plugin.STATS["alignment_ours"] == 1, "the alignment was not the one fused with the routing"

    numel = ids.numel()
    bound = (numel + (e + 1) * (block_size - 1) + 3) // 4 * 4
    ref_sorted = torch.full((bound,), numel, dtype=torch.int32)
    ref_experts = torch.full((bound // block_size + 1,), -7, dtype=torch.int32)
    ref_npad = torch.zeros(1, dtype=torch.int32)
    moe_align_small_numel(ids, e + 1, block_size, ref_sorted, ref_experts, ref_npad)

    assert sorted_ids.dtype == expert_ids.dtype == npad.dtype == torch.int32
    total = int(ref_npad)
    assert int(npad) == total
    blocks = total // block_size
    assert torch.equal(expert_ids[:blocks], ref_experts[:blocks])
    for blk in range(blocks):  # same slots per block; order inside an expert's run is free
        mine = sorted(sorted_ids[blk * block_size:(blk + 1) * block_size].tolist())
        theirs = sorted(ref_sorted[blk * block_size:(blk + 1) * block_size].tolist())
        assert mine == theirs, f"block {blk} (expert {int(ref_experts[blk])}) differs"
