"""Input checks shared by the public entry points. Each raises ValueError (shapes, values) or TypeError (dtypes)
naming what was expected, what came, and how to fix it. Checks that read tensor values synchronise with the device,
so callers skip them while a CUDA graph is being captured (:func:`capturing`)."""
from __future__ import annotations

import torch

from specverify.tree import parent_error, unpack_mask

_INT_DTYPES = (torch.int32, torch.int64)


def capturing() -> bool:
    """True while the current CUDA stream is capturing a graph (value checks must be skipped then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _desc(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


def check_int_tensor(op: str, name: str, t, shape: tuple) -> None:
    """``t`` is an int32/int64 tensor of ``shape`` (None entries match any size)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in _INT_DTYPES:
        raise TypeError(f"{op}: {name} must be an int32 or int64 tensor of shape {list(shape)}, got {_desc(t)}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        raise ValueError(f"{op}: {name} must have shape {list(shape)}, got {list(t.shape)}")


def check_paged_kv(op: str, page_table, prefix_lens, num_nodes: int, num_pages: int, page_size: int) -> None:
    """Page ids in range and every request's ``prefix_len + num_nodes`` positions covered by its page-table row.

    Reads tensor values: host synchronisation, so not during graph capture.
    """
    batch = page_table.shape[0]
    check_int_tensor(op, "prefix_lens", prefix_lens, (batch,))
    if capturing():
        return
    if batch == 0:
        return
    if int(prefix_lens.min()) < 0:
        raise ValueError(f"{op}: prefix_lens must be >= 0, got min {int(prefix_lens.min())}")
    need_pages = (prefix_lens.long() + num_nodes + page_size - 1) // page_size
    too_long = need_pages > page_table.shape[1]
    if bool(too_long.any()):
        b = int(too_long.nonzero()[0, 0])
        raise ValueError(
            f"{op}: request {b} needs {int(prefix_lens[b]) + num_nodes} KV positions (prefix {int(prefix_lens[b])} + "
            f"{num_nodes} draft tokens) = {int(need_pages[b])} pages of {page_size}, but its page-table row holds "
            f"{page_table.shape[1]}; allocate more pages or shorten the request")
    cols = torch.arange(page_table.shape[1], device=page_table.device).unsqueeze(0)
    used = cols < need_pages.unsqueeze(1)
    ids = page_table.long()
    bad = used & ((ids < 0) | (ids >= num_pages))
    if bool(bad.any()):
        b, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{op}: page_table[{b}, {j}] = {int(ids[b, j])} is outside the cache's pages "
                         f"[0, {num_pages}); fix the page table or allocate a larger cache")


# ----------------------------------------------------------------------------------------------------------------
# draft trees given as tensors: the value checks DraftTree makes on a parent array (specverify.tree)
# ----------------------------------------------------------------------------------------------------------------
def check_parents(op: str, parents: torch.Tensor) -> None:
    """Every row of ``parents`` (int [batch, k]) is a tree in :class:`~specverify.tree.DraftTree`'s convention:
    ``parents[b, 0] == -1`` and ``0 <= parents[b, i] < i`` for i > 0 (parents before children, so no cycle).

    Shape and dtype are the caller's to check. Reads tensor values (one host sync, more only to word an error), so
    it returns at once while a CUDA graph is being captured.
    """
    if capturing() or parents.numel() == 0:
        return
    p = parents.long()
    k = p.shape[1]
    node = torch.arange(k, device=p.device)
    bad = (p < 0) | (p >= node)
    bad[:, 0] = p[:, 0] != -1
    if not bool(bad.any()):
        return
    b, i = (int(v) for v in bad.nonzero()[0])  # the first bad node of the first bad request
    raise ValueError(f"{op}: parents[{b}]: {parent_error(i, int(p[b, i]), k)}; build the trees with DraftTree / "
                     "BatchedDraftTree (BatchedDraftTree.parents)")


def check_depth(op: str, depth: torch.Tensor, parents: torch.Tensor) -> None:
    """``depth`` (int [batch, k]) is the depth of each node of the trees ``parents`` (checked first with
    :func:`check_parents`): 0 at the root, ``depth[parents[i]] + 1`` below it. Skipped under graph capture."""
    if capturing() or depth.numel() == 0:
        return
    check_parents(op, parents)
    p = parents.long()
    d = depth.long()
    want = d.gather(1, p.clamp(min=0)) + 1
    want[:, 0] = 0
    bad = d != want
    if not bool(bad.any()):
        return
    b, i = (int(v) for v in bad.nonzero()[0])  # nodes before i are right, so want[b, i] is node i's true depth
    where = ("node 0 is the root, at depth 0" if i == 0 else
             f"node {i} sits at depth {int(want[b, i])} (its parent {int(p[b, i])} is at depth {int(d[b, p[b, i]])})")
    raise ValueError(f"{op}: depth[{b}, {i}] = {int(d[b, i])} but {where}; depth must be 0 at the root and "
                     "depth[parents[i]] + 1 below it: pass BatchedDraftTree.depth")


def check_tree_mask(op: str, tree_mask: torch.Tensor, num_nodes: int) -> None:
    """The bit-packed ``tree_mask`` (uint8 [k, ceil(k/8)] shared or [batch, k, ceil(k/8)]) is the ancestor mask of
    a tree in :class:`~specverify.tree.DraftTree`'s convention: row i sees node i itself, no node after i, and
    exactly the nodes its parent's row sees plus i, where the parent is the last earlier node row i sees (so row 0
    sees only node 0 and every row sees the root). Bits past ``num_nodes`` in the last byte are ignored.

    Shape and dtype are the caller's to check. Reads tensor values (one host sync, more only to word an error), so
    it returns at once while a CUDA graph is being captured.
    """
    if capturing() or tree_mask.numel() == 0:
        return
    k = num_nodes
    m = unpack_mask(tree_mask, k)
    shared = m.dim() == 2
    m = m.unsqueeze(0) if shared else m  # [batch, k, k]
    node = torch.arange(k, device=m.device)
    eye = node.view(k, 1) == node.view(1, k)
    later = node.view(1, k) > node.view(k, 1)  # [i, j]: j after i
    earlier = node.view(1, k) < node.view(k, 1)
    sees_self = m.diagonal(dim1=-2, dim2=-1)
    sees_later = (m & later).any(-1)
    # the parent: the last earlier node a row sees (-1: none, which only node 0 may have)
    parent = torch.where(m & earlier, node.view(1, 1, k), -1).amax(-1)
    parent_row = m.gather(1, parent.clamp(min=0).unsqueeze(-1).expand_as(m))
    want = torch.where((parent >= 0).unsqueeze(-1), parent_row | eye, eye)
    no_parent = (parent < 0) & (node > 0)
    bad = ~sees_self | sees_later | no_parent | (m != want).any(-1)
    if not bool(bad.any()):
        return
    b, i = (int(v) for v in bad.nonzero()[0])  # rows before i are ancestor rows, so row i's parent row is too
    row = f"tree_mask row {i}" if shared else f"tree_mask[{b}] row {i}"
    fix = "build the mask with DraftTree.packed_mask() / BatchedDraftTree.packed_mask"
    seen = node[m[b, i]].tolist()
    if not bool(sees_self[b, i]):
        raise ValueError(f"{op}: {row} does not see its own node (bit {i} of row {i} is 0); every node must attend "
                         f"to itself: set the diagonal ({fix})")
    if bool(sees_later[b, i]):
        j = int(node[m[b, i] & later[i]][0])
        raise ValueError(f"{op}: {row} sees node {j}, which comes after it (row {i} sees nodes {seen}); a node sees "
                         f"only itself and its ancestors, and parents come before children: clear bit {j} ({fix})")
    if bool(no_parent[b, i]):
        raise ValueError(f"{op}: {row} sees no earlier node (only itself), so node {i} would be a second root; every "
                         f"node but the root must see its ancestors, the root (bit 0) among them ({fix})")
    p = int(parent[b, i])
    raise ValueError(f"{op}: {row} sees nodes {seen}, but a node sees exactly its parent's nodes plus itself: its "
                     f"parent (the last earlier node it sees) is node {p}, whose row sees {node[m[b, p]].tolist()}, "
                     f"so row {i} must see {node[want[b, i]].tolist()} ({fix})")
