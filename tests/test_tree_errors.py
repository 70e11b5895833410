"""Malformed draft trees raise ValueError naming the node."""
import pytest

from specverify.tree import BatchedDraftTree, DraftTree


@pytest.mark.parametrize("parents, words", [
    ([], "empty"),
    ([0, 0], "node 0 must be the root"),
    ([-1, 0, -1], "node 2 has parent -1"),
    ([-1, 5], "node 1 has parent 5, out of range"),
    ([-1, 2, 1], "node 1 has parent 2, which comes after it"),  # a cycle 1 -> 2 -> 1
    ([-1, 1], "node 1 is its own parent"),
])
def test_malformed_trees(parents, words):
    with pytest.raises(ValueError, match=words):
        DraftTree(parents)


def test_batch_needs_equal_sizes():
    with pytest.raises(ValueError, match="same num_nodes"):
        BatchedDraftTree([DraftTree.chain(3), DraftTree.chain(4)])
    with pytest.raises(TypeError, match="DraftTree"):
        BatchedDraftTree([[-1, 0]])
    with pytest.raises(ValueError, match="num_nodes >= 1"):
        DraftTree.chain(0)
