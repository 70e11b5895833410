"""Bad input to the reference verify forward raises a clear error before any kernel runs."""
import pytest
import torch

from specverify.reference.model import VerifyModel
from specverify.tree import BatchedDraftTree, DraftTree


@pytest.fixture(scope="module")
def setup():
    model = VerifyModel("tiny-gqa", dtype=torch.float32, seed=0)
    bt = BatchedDraftTree.repeat(DraftTree([-1, 0, 0, 1]), 2)
    caches = model.allocate_kv(8, 4)
    page_table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    prefix = torch.tensor([3, 5], dtype=torch.int32)
    draft = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    return model, bt, caches, page_table, prefix, draft


def _call(setup, **over):
    model, bt, caches, page_table, prefix, draft = setup
    args = dict(draft_tokens=draft, parents=bt.parents, depth=bt.depth, tree_mask=bt.packed_mask,
                kv_caches=caches, page_table=page_table, prefix_lens=prefix, max_depth=2)
    args.update(over)
    return model.verify(**args)


def test_valid_call_runs(setup):
    nodes, acc, toks, logits = _call(setup)
    assert logits.shape == (2, 4, setup[0].config.vocab_size) and not torch.isnan(logits).any()


@pytest.mark.parametrize("over, exc, words", [
    (dict(draft_tokens=torch.ones(2, 4)), TypeError, "draft_tokens must be an int32 or int64"),
    (dict(tree_mask=torch.ones(4, 1, dtype=torch.int64)), TypeError, "tree_mask must be uint8"),
    (dict(tree_mask=torch.ones(4, 4, dtype=torch.uint8)), ValueError, r"tree_mask must be uint8 of shape \[4, 1\]"),
    (dict(page_table=torch.tensor([[0, 1, 2], [3, 4, 99]], dtype=torch.int32)), ValueError,
     r"page_table\[1, 2\] = 99 is outside"),
    (dict(prefix_lens=torch.tensor([3, 9], dtype=torch.int32)), ValueError, "request 1 needs 13 KV positions"),
    (dict(parents=torch.tensor([[-1, 0, 0, 1], [-1, 2, 0, 1]])), ValueError, "parents before children"),
    (dict(draft_tokens=torch.tensor([[1, 2, 3, 4], [5, 6, 7, 1000]])), ValueError, "draft_tokens must lie in"),
    (dict(page_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.float32)), TypeError, "page_table"),
])
def test_bad_input(setup, over, exc, words):
    with pytest.raises(exc, match=words):
        _call(setup, **over)


def test_kv_cache_untouched_on_error(setup):
    model, bt, caches, page_table, prefix, draft = setup
    before = [c.clone() for layer in caches for c in layer]
    with pytest.raises(ValueError):
        _call(setup, prefix_lens=torch.tensor([3, 9], dtype=torch.int32))
    after = [c for layer in caches for c in layer]
    assert all(torch.equal(a.nan_to_num(7), b.nan_to_num(7)) for a, b in zip(after, before))
