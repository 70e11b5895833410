"""Reference greedy tree acceptance in plain torch (batched; one vectorised step per tree level).

Walking down from the root (node 0), the children of the current node are tried in node order; the first child
whose draft token equals the target's argmax at the current node is accepted and becomes the current node. The walk
stops when no child matches; the target's argmax at the last accepted node is the bonus token.

Outputs, for ``batch`` requests of ``k`` nodes and ``L = max_depth + 1``:

* ``accepted_nodes`` int64 [batch, L]: node indices of the accepted path, starting with 0, then -1.
* ``accept_len`` int64 [batch]: accepted proposed tokens (0 .. max_depth). Tokens emitted = accept_len + 1.
* ``accepted_tokens`` int64 [batch, L]: the accepted draft tokens then the bonus token, then -1.
"""
from __future__ import annotations

import torch


def greedy_accept_reference(target_ids, draft_tokens, parents, max_depth=None):
    """target_ids, draft_tokens, parents: int [batch, k] (parents[:, 0] = -1). Capturable when max_depth is given."""
    batch, k = draft_tokens.shape
    device = draft_tokens.device
    target_ids = target_ids.long()
    draft_tokens = draft_tokens.long()
    parents = parents.long().to(device)
    if max_depth is None:
        max_depth = k - 1
    length = max_depth + 1
    rows = torch.arange(batch, device=device)
    node_index = torch.arange(k, device=device).expand(batch, k)
    cur = torch.zeros(batch, dtype=torch.long, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    accept_len = torch.zeros(batch, dtype=torch.long, device=device)
    nodes = torch.full((batch, length), -1, dtype=torch.long, device=device)
    nodes[:, 0] = 0
    for depth in range(1, length):
        want = target_ids[rows, cur]
        match = (parents == cur.unsqueeze(1)) & (draft_tokens == want.unsqueeze(1)) & alive.unsqueeze(1)
        first = torch.where(match, node_index, torch.full_like(node_index, k)).min(dim=1).values
        found = first < k
        cur = torch.where(found, first, cur)
        nodes[:, depth] = torch.where(found, first, torch.full_like(first, -1))
        accept_len += found.long()
        alive &= found
    tokens = torch.full((batch, length), -1, dtype=torch.long, device=device)
    valid = nodes >= 0
    tokens = torch.where(valid, torch.gather(draft_tokens, 1, nodes.clamp(min=0)), tokens)
    # shift: tokens[:, d] for d < accept_len are the accepted proposed tokens (nodes 1..), then the bonus
    shifted = torch.full_like(tokens, -1)
    shifted[:, : length - 1] = tokens[:, 1:]
    bonus = target_ids[rows, cur]
    shifted[rows, accept_len] = bonus
    return nodes, accept_len, shifted
