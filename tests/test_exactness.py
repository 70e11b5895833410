"""Speculative decoding through the verify path equals plain greedy decoding, token for token.

Runs in fp64 on the CPU with tiny configs (MLA+MoE, grouped MLA+MoE, GQA+MoE, dense GQA) so that the only way the
two loops can differ is a bug in the verify path (masks, positions, KV writes, acceptance or compaction).
"""
import pytest
import torch

from specverify.forward.model import VerifyModel
from specverify.reference.generate import NoisyCopyDrafter, greedy_generate, speculative_generate
from specverify.tree import DraftTree

PROMPTS = [[1, 5, 7, 2, 9], [3, 8], [11, 4, 6, 6, 2, 8, 1, 3]]  # different lengths: different prefix_lens
NUM_TOKENS = 8

_cache = {}


def _setup(name):
    if name not in _cache:
        model = VerifyModel(name, dtype=torch.float64, seed=3)
        _cache[name] = (model, greedy_generate(model, PROMPTS, NUM_TOKENS), NoisyCopyDrafter(model, noise=0.05))
    return _cache[name]


@pytest.mark.parametrize("name", ["tiny-mla-moe", "tiny-gqa"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_chains_are_exact(name, k):
    model, expected, drafter = _setup(name)
    out, accept = speculative_generate(model, drafter, PROMPTS, NUM_TOKENS, DraftTree.chain(k))
    assert out == expected
    assert max(accept) <= k - 1


TREES = {
    "binary-depth2": DraftTree.topk(2, 2),  # 7 nodes, two candidates at every level
    "ragged": DraftTree([-1, 0, 0, 0, 1, 1, 4, 2]),  # 3 root children, uneven depths
}


@pytest.mark.parametrize("name", ["tiny-mla-moe", "tiny-mla-grouped", "tiny-gqa-moe", "tiny-gqa"])
@pytest.mark.parametrize("tree", list(TREES))
def test_trees_are_exact(name, tree):
    model, expected, drafter = _setup(name)
    out, accept = speculative_generate(model, drafter, PROMPTS, NUM_TOKENS, TREES[tree])
    assert out == expected


def test_drafter_gets_both_accepts_and_rejects():
    # guards the exactness tests against a drafter that always agrees (or never does), which would test less
    accept = []
    for name in ("tiny-gqa", "tiny-mla-moe"):
        model, _, drafter = _setup(name)
        accept += speculative_generate(model, drafter, PROMPTS, NUM_TOKENS, DraftTree.chain(4))[1]
    assert min(accept) == 0 and max(accept) == 3


@pytest.mark.parametrize("name", ["tiny-mla-moe", "tiny-gqa"])
def test_specverify_acceptance_and_compaction_are_exact(name):
    # the specverify provider's acceptance and KV compaction slots (Triton; integer and copy work, so still exact
    # with the fp64 forward on the reference ops): a slot that returned its tuple in another order, or a compaction
    # that moved the wrong rows, would change the tokens
    from specverify.forward.ops import specverify_ops

    sv, _ = specverify_ops(None)
    assert (sv.pieces["acceptance"], sv.pieces["kv_compaction"]) == ("triton", "triton")
    model, expected, drafter = _setup(name)
    saved = model.ops.accept_greedy, model.ops.compact_kv
    model.ops.accept_greedy, model.ops.compact_kv = sv.accept_greedy, sv.compact_kv
    try:
        out, accept = speculative_generate(model, drafter, PROMPTS, NUM_TOKENS, TREES["ragged"])
    finally:
        model.ops.accept_greedy, model.ops.compact_kv = saved
    assert out == expected
    assert max(accept) >= 1  # something was accepted, so something was compacted
