"""The specverify provider's op table keeps the reference's calling conventions (the verify wall relies on them)."""
from __future__ import annotations

import torch

from specverify.forward.ops import specverify_ops
from specverify.reference.accept import greedy_accept_reference


def test_accept_greedy_returns_nodes_length_tokens(device):
    # a 6-node tree over 2 requests with partly matching targets: the slot must return (accepted_nodes, accept_len,
    # accepted_tokens) exactly as the reference does; a swapped order once fed token ids to the KV compaction
    ops, _ = specverify_ops(None)
    assert ops.pieces["acceptance"] == "triton"
    g = torch.Generator().manual_seed(5)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4]])
    draft = torch.randint(100, 200, (2, 6), generator=g)
    target = torch.randint(100, 200, (2, 6), generator=g)
    target[0, 0], target[0, 2] = draft[0, 2], draft[0, 5]  # request 0 accepts nodes 2 then 5
    target[1, :3] = draft[1, 1:4]                           # request 1 accepts nodes 1, 2, 3
    got = ops.accept_greedy(target.to(device), draft.to(device), parents.to(device), 4)
    want = greedy_accept_reference(target, draft, parents, 4)
    length = want[0].shape[1]  # max_depth + 1; the Triton path may return wider rows, padded with -1 nodes
    assert torch.equal(got[1].cpu().long(), want[1].long()), "accept_len"
    for name, a, b in (("accepted_nodes", got[0], want[0]), ("accepted_tokens", got[2], want[2])):
        assert a.shape[1] >= length and torch.equal(a.cpu().long()[:, :length], b.long()), name
    assert (got[0].cpu()[:, length:] == -1).all()
    assert got[1].tolist() == [2, 3]
