"""Malformed draft trees raise ValueError naming the node, whether given as a parent array (DraftTree) or as
tensors (parents, depth, bit-packed ancestor mask: the checks of specverify.validation the public ops run)."""
import pytest
import torch

from specverify.tree import BatchedDraftTree, DraftTree, pack_mask
from specverify.validation import check_depth, check_parents, check_tree_mask

MALFORMED = [
    ([], "empty"),
    ([0, 0], "node 0 must be the root"),
    ([-1, 0, -1], "node 2 has parent -1"),
    ([-1, 5], "node 1 has parent 5, out of range"),
    ([-1, 2, 1], "node 1 has parent 2, which comes after it"),  # a cycle 1 -> 2 -> 1
    ([-1, 1], "node 1 is its own parent"),
]


@pytest.mark.parametrize("parents, words", MALFORMED)
def test_malformed_trees(parents, words):
    with pytest.raises(ValueError, match=words):
        DraftTree(parents)


@pytest.mark.parametrize("parents, words", [m for m in MALFORMED if m[0]])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_malformed_parents_tensor_same_check(parents, words, dtype):
    """A parents tensor gets DraftTree's check and words, naming the request (here the second of two)."""
    good = [-1] + [0] * (len(parents) - 1)
    with pytest.raises(ValueError, match=r"^op: parents\[1\]: " + words):
        check_parents("op", torch.tensor([good, parents], dtype=dtype))


TREES = BatchedDraftTree([DraftTree([-1, 0, 0, 1, 2, 2, 3, 0, 7]), DraftTree.chain(9), DraftTree.topk_of_size(2, 9)])


def test_valid_tree_tensors_pass():
    # 9 nodes: the mask takes two bytes per row; a ragged tree, a chain and a top-k tree in one batch; one node
    check_parents("op", TREES.parents)
    check_depth("op", TREES.depth, TREES.parents)
    check_tree_mask("op", TREES.packed_mask, 9)
    for t in TREES.trees:
        check_tree_mask("op", t.packed_mask(), 9)  # shared [k, ceil(k/8)] form
    one = BatchedDraftTree.repeat(DraftTree([-1]), 2)
    check_depth("op", one.depth, one.parents)
    check_tree_mask("op", one.packed_mask, 1)
    padded = TREES.packed_mask.clone()
    padded[..., 1] |= 0xFE  # bits of nodes 9..15, past the last node: ignored
    check_tree_mask("op", padded, 9)


@pytest.mark.parametrize("node, value, words", [
    (0, 1, r"depth\[2, 0\] = 1 but node 0 is the root, at depth 0"),
    (5, 3, r"depth\[2, 5\] = 3 but node 5 sits at depth 2 \(its parent 2 is at depth 1\)"),
    (8, 0, r"depth\[2, 8\] = 0 but node 8 sits at depth 3"),
])
def test_depth_inconsistent_with_parents(node, value, words):
    depth = TREES.depth.clone()
    depth[2, node] = value
    with pytest.raises(ValueError, match=r"^op: " + words + ".*pass BatchedDraftTree.depth"):
        check_depth("op", depth, TREES.parents)


def test_depth_check_checks_the_parents_first():
    parents = TREES.parents.clone()
    parents[1, 4] = 6
    with pytest.raises(ValueError, match=r"parents\[1\]: node 4 has parent 6, which comes after it"):
        check_depth("op", TREES.depth, parents)


def _edit(b, i, j, value):
    def edit(m):
        m[b, i, j] = value
    return edit


def _only_self(b, i):
    def edit(m):
        m[b, i] = False
        m[b, i, i] = True
    return edit


BAD_MASKS = [
    # id, edit of the bool ancestor mask [3, 9, 9], words
    ("no-diagonal", _edit(1, 3, 3, False), r"tree_mask\[1\] row 3 does not see its own node \(bit 3 of row 3 is 0\);"
     " every node must attend to itself: set the diagonal"),
    ("root-no-diagonal", _edit(0, 0, 0, False), r"tree_mask\[0\] row 0 does not see its own node"),
    ("later-node", _edit(0, 2, 5, True), r"tree_mask\[0\] row 2 sees node 5, which comes after it"),
    ("second-root", _only_self(2, 4), r"tree_mask\[2\] row 4 sees no earlier node \(only itself\), so node 4 would be "
     "a second root"),
    # row 6 (parent 3, ancestors 0 1 3) loses node 1: no longer its parent's row plus itself
    ("not-parent-row", _edit(0, 6, 1, False), r"tree_mask\[0\] row 6 sees nodes \[0, 3, 6\].*its parent \(the last "
     r"earlier node it sees\) is node 3, whose row sees \[0, 1, 3\], so row 6 must see \[0, 1, 3, 6\]"),
]


@pytest.mark.parametrize("case", BAD_MASKS, ids=[c[0] for c in BAD_MASKS])
def test_mask_that_is_not_an_ancestor_mask(case):
    _, edit, words = case
    m = TREES.ancestor_mask()
    edit(m)
    with pytest.raises(ValueError, match=r"^op: " + words):
        check_tree_mask("op", pack_mask(m), 9)


def test_shared_mask_error_names_the_row():
    m = TREES.trees[0].ancestor_mask()
    m[8, 8] = False  # node 8: the second byte of its row
    with pytest.raises(ValueError, match=r"^op: tree_mask row 8 does not see its own node \(bit 8 of row 8 is 0\)"):
        check_tree_mask("op", pack_mask(m), 9)


def test_tree_tensor_checks_skipped_while_capturing(monkeypatch):
    """Value checks synchronise with the device: under CUDA-graph capture they return without looking."""
    import specverify.validation as validation

    monkeypatch.setattr(validation, "capturing", lambda: True)
    bad = TREES.parents.clone()
    bad[0, 0] = 3
    check_parents("op", bad)
    check_depth("op", TREES.depth + 1, bad)
    check_tree_mask("op", torch.zeros_like(TREES.packed_mask), 9)


def test_batch_needs_equal_sizes():
    with pytest.raises(ValueError, match="same num_nodes"):
        BatchedDraftTree([DraftTree.chain(3), DraftTree.chain(4)])
    with pytest.raises(TypeError, match="DraftTree"):
        BatchedDraftTree([[-1, 0]])
    with pytest.raises(ValueError, match="num_nodes >= 1"):
        DraftTree.chain(0)
