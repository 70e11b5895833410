"""Bad input to the verify forward, and trees given as a parents tensor to verify_greedy /
verify_sampling, raise a clear error before any kernel runs."""
import pytest
import torch

from specverify.accept import verify_greedy, verify_sampling
from specverify.forward.model import VerifyModel
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
    (dict(parents=torch.tensor([[-1, 0, 0, 1], [-1, 2, 0, 1]])), ValueError, "parents.*before"),
    # depth that does not follow the parents, a mask row that does not see its own node
    (dict(depth=torch.tensor([[0, 1, 1, 1], [0, 1, 1, 2]])), ValueError, "depth"),
    (dict(tree_mask=torch.tensor([[1], [1], [1], [11]], dtype=torch.uint8)), ValueError, "does not see its own node"),
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


# ----------------------------------------------------------------------------------------------------------------
# verify_greedy / verify_sampling with the trees given as a parents tensor: DraftTree's checks, per request
# ----------------------------------------------------------------------------------------------------------------
# three trees of 5 nodes: a ragged tree, a chain and a binary top-k tree (different parents in every request)
TREES = BatchedDraftTree([DraftTree([-1, 0, 0, 1, 2]), DraftTree.chain(5), DraftTree.topk_of_size(2, 5)])
DRAFT = torch.tensor([[0, 3, 4, 5, 6], [0, 3, 5, 7, 1], [0, 2, 3, 4, 5]])
TARGET = torch.tensor([[3, 5, 6, 1, 2], [3, 5, 7, 1, 0], [3, 4, 1, 0, 6]])
LOGITS = torch.nn.functional.one_hot(TARGET, 8).float() * 4.0


def _greedy(parents, **kw):
    return verify_greedy(DRAFT, parents, target_ids=TARGET, **kw)


def _sampling(parents, **kw):
    return verify_sampling(LOGITS, parents, DRAFT, uniform_samples=torch.full((3, 5), 0.5), **kw)


OPS = {"verify_greedy": _greedy, "verify_sampling": _sampling}

BAD_PARENTS = [
    # id, (request, node), new parent, words
    ("out-of-range", (1, 3), 7, "parents[1]: node 3 has parent 7, out of range [0, 5)"),
    ("negative", (2, 2), -3, "parents[2]: node 2 has parent -3, out of range [0, 5)"),
    # tree 0 has node 4 under node 2: node 2 under node 4 closes the cycle 2 -> 4 -> 2
    ("cycle", (0, 2), 4, "parents[0]: node 2 has parent 4, which comes after it"),
    ("own-parent", (2, 3), 3, "parents[2]: node 3 is its own parent (a cycle)"),
    ("wrong-root", (1, 0), 0, "parents[1]: node 0 must be the root with parent -1, got parent 0"),
    ("second-root", (2, 4), -1, "parents[2]: node 4 has parent -1 but only node 0 may be a root"),
]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("case", BAD_PARENTS, ids=[c[0] for c in BAD_PARENTS])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_parents_tensor_that_is_not_a_tree(op, case, impl):
    _, (b, i), value, words = case
    parents = TREES.parents.clone()
    parents[b, i] = value
    with pytest.raises(ValueError) as info:
        OPS[op](parents, impl=impl)
    msg = str(info.value)
    assert msg.startswith(f"specverify.{op}: ") and words in msg and "DraftTree" in msg, msg


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype, impl", [(torch.int64, "reference"), (torch.int32, "reference"),
                                         (torch.int64, "triton")])
def test_valid_batched_parents_tensor_passes(op, dtype, impl):
    """Valid trees as a parents tensor run and accept as the same trees given as a BatchedDraftTree (whose L is
    max_depth + 1 instead of k: the columns past it are -1)."""
    tokens, lens, nodes = OPS[op](TREES.parents.to(dtype), impl=impl)
    want_tokens, want_lens, want_nodes = OPS[op](TREES, impl="reference")
    length = want_nodes.shape[1]
    assert torch.equal(lens, want_lens) and int(lens.max()) >= 1  # something was accepted
    assert torch.equal(nodes[:, :length], want_nodes) and torch.equal(tokens[:, :length], want_tokens)
    assert (nodes[:, length:] == -1).all()


@pytest.mark.parametrize("op", list(OPS))
def test_parents_check_skipped_when_asked_or_capturing(op, monkeypatch):
    """validate=False and CUDA-graph capture (host syncs are not allowed then) skip the value check."""
    import specverify.validation as validation

    parents = TREES.parents.clone()
    parents[0, 2] = 4
    OPS[op](parents, impl="reference", validate=False)
    monkeypatch.setattr(validation, "capturing", lambda: True)
    OPS[op](parents, impl="reference")
