"""Draft trees: masks, packing and retrieve links against brute-force definitions."""
import random

import pytest
import torch

from specverify.tree import BatchedDraftTree, DraftTree, pack_mask, unpack_mask


def random_tree(n, rng):
    return DraftTree([-1] + [rng.randrange(i) for i in range(1, n)])


def brute_ancestors(parents):
    n = len(parents)
    mask = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j != -1:
            mask[i][j] = True
            j = parents[j]
    return mask


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 17, 64])  # 8/9: byte boundary of the packed mask; 1: decode
def test_masks_match_definition(n):
    rng = random.Random(n)
    for _ in range(5):
        t = random_tree(n, rng)
        assert t.ancestor_mask().tolist() == brute_ancestors(t.parents)
        packed = t.packed_mask()
        assert packed.dtype == torch.uint8 and packed.shape == (n, (n + 7) // 8)
        for i in range(n):
            for j in range(n):
                bit = (int(packed[i, j // 8]) >> (j % 8)) & 1
                assert bit == int(t.ancestor_mask()[i, j])
        assert torch.equal(unpack_mask(packed, n), t.ancestor_mask())


def test_depth_and_paths():
    t = DraftTree([-1, 0, 0, 1, 1, 3])
    assert t.depth == (0, 1, 1, 2, 2, 3)
    assert t.path_to(5) == [0, 1, 3, 5]
    assert t.max_depth == 3 and not t.is_chain
    assert DraftTree.chain(5).is_chain and DraftTree.chain(5).max_depth == 4


def test_retrieve_links_follow_sglang_convention():
    t = DraftTree([-1, 0, 0, 1, 1, 2])
    index, nxt, sib = t.retrieve_links()
    assert index.tolist() == [0, 1, 2, 3, 4, 5]
    assert nxt.tolist() == [1, 3, 5, -1, -1, -1]  # first child
    assert sib.tolist() == [-1, 2, -1, 4, -1, -1]  # next sibling
    rng = random.Random(0)
    for _ in range(20):
        tr = random_tree(rng.randrange(1, 20), rng)
        _, nxt, sib = tr.retrieve_links()
        # walking first-child / next-sibling links visits every node exactly once
        seen, stack = [], [0]
        while stack:
            node = stack.pop()
            seen.append(node)
            c = int(nxt[node])
            while c != -1:
                stack.append(c)
                c = int(sib[c])
        assert sorted(seen) == list(range(tr.num_nodes))


def test_topk_trees():
    t = DraftTree.topk(2, 3)
    assert t.num_nodes == 1 + 2 + 4 + 8
    assert all(len(t.children(i)) in (0, 2) for i in range(t.num_nodes))
    for n in (1, 4, 6, 8, 10):
        s = DraftTree.topk_of_size(3, n)
        assert s.num_nodes == n


def test_batched_tree_flattens_retrieve_index():
    a, b = DraftTree.chain(4), DraftTree([-1, 0, 0, 1])
    bt = BatchedDraftTree([a, b])
    assert bt.retrieve_index.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert bt.packed_mask.shape == (2, 4, 1)
    assert torch.equal(bt.parents[1], torch.tensor([-1, 0, 0, 1]))


def test_pack_unpack_roundtrip_random():
    g = torch.Generator().manual_seed(0)
    m = torch.rand(3, 13, 13, generator=g) > 0.5
    assert torch.equal(unpack_mask(pack_mask(m), 13), m)
