"""Draft trees: the shape of what a drafter proposes and the masks and links the verify pass needs.

Conventions (SGLang's, which EAGLE-style drafters use):

* A tree has ``num_nodes`` = ``num_draft_tokens`` = k nodes. Node 0 is the root: the last verified token, whose
  KV is not yet in the cache. Nodes 1..k-1 are the proposed tokens. A chain of k nodes proposes k - 1 tokens;
  k = 1 is a plain decode step.
* Parents come before children (``parents[i] < i`` for i > 0, ``parents[0] == -1``). Among siblings the order of
  the node indices is the order in which acceptance tries them.
* Node i sits at depth ``depth[i]`` (root 0) and its token takes position ``prefix_len + depth[i]`` for RoPE,
  while its KV lives at cache position ``prefix_len + i`` during the verify pass.
* Ancestor mask: ``mask[i, j]`` is True when node j is node i or one of its ancestors — the tokens node i attends
  to among the draft tokens. The bit-packed mask stores row i in ``ceil(k / 8)`` bytes, bit ``j % 8`` of byte
  ``j // 8`` (little-endian bit order).
* Retrieve links (SGLang's ``retrieve_index``, ``retrieve_next_token``, ``retrieve_next_sibling``): for node i,
  ``retrieve_index[i] = i``, ``retrieve_next_token[i]`` = its first child or -1, ``retrieve_next_sibling[i]`` =
  its next sibling or -1. Batched, ``retrieve_index`` holds the flattened index ``b * k + i``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def parent_error(node: int, parent: int, num_nodes: int) -> str | None:
    """Why ``parent`` cannot be the parent of ``node`` in a tree of ``num_nodes`` nodes, or None when it can.

    The rule of :class:`DraftTree`, shared by the checks of trees given as tensors
    (:func:`specverify.validation.check_parents`): node 0 is the root with parent -1, every other node's parent is a
    node index before it (which also rules out cycles).
    """
    if node == 0:
        if parent != -1:
            return (f"node 0 must be the root with parent -1, got parent {parent}; reorder the nodes so the last "
                    "verified token comes first")
        return None
    if parent == -1:
        return f"node {node} has parent -1 but only node 0 may be a root; a tree has exactly one root"
    if not 0 <= parent < num_nodes:
        return (f"node {node} has parent {parent}, out of range [0, {num_nodes}); every parent must be a node "
                "index")
    if parent == node:
        return f"node {node} is its own parent (a cycle); parents must come before children"
    if parent > node:
        return (f"node {node} has parent {parent}, which comes after it; order the nodes so parents come before "
                "children (a cycle also fails this check)")
    return None


def _check_parents(parents: Sequence[int]) -> list[int]:
    if isinstance(parents, (str, bytes)) or not hasattr(parents, "__iter__"):
        raise TypeError(f"parents must be a sequence of ints (parents[i] = parent of node i, -1 for the root), "
                        f"got {type(parents).__name__}")
    values = list(parents.tolist() if hasattr(parents, "tolist") else parents)
    for i, p in enumerate(values):
        if isinstance(p, bool) or not float(p).is_integer():
            raise TypeError(f"parents[{i}] must be an int, got {p!r}")
    parents = [int(p) for p in values]
    n = len(parents)
    if n == 0:
        raise ValueError("a draft tree needs at least the root node: got an empty parent array; pass [-1] for a "
                         "plain decode step")
    if parents[0] != -1:
        raise ValueError(f"node 0 must be the root with parent -1, got parents[0] = {parents[0]}; reorder the "
                         "nodes so the last verified token comes first")
    for i in range(1, n):
        why = parent_error(i, parents[i], n)
        if why is not None:
            raise ValueError(why)
    return parents


@dataclass(frozen=True)
class DraftTree:
    """One draft tree of ``num_nodes`` nodes, node 0 the last verified token.

    Built from a parent array (``DraftTree([-1, 0, 0, 1])``), as a chain (:meth:`chain`) or as a full top-k tree
    (:meth:`topk`). All derived tensors are CPU tensors; move them with ``.to(device)``.

    Parameters
    ----------
    parents : sequence of int
        ``parents[i]`` is the parent of node i; ``parents[0] == -1``; ``parents[i] < i``.

    Raises
    ------
    ValueError
        Empty array, no root, a second root, a parent out of range, a parent after its child, or a cycle; the
        message names the node.

    Examples
    --------
    >>> t = DraftTree.chain(3)
    >>> t.parents
    (-1, 0, 1)
    >>> t.packed_mask().tolist()
    [[1], [3], [7]]
    """

    parents: tuple[int, ...]
    depth: tuple[int, ...] = field(init=False)

    def __init__(self, parents: Sequence[int]):
        checked = _check_parents(parents)
        object.__setattr__(self, "parents", tuple(checked))
        depth = [0] * len(checked)
        for i in range(1, len(checked)):
            depth[i] = depth[checked[i]] + 1
        object.__setattr__(self, "depth", tuple(depth))

    # construction -------------------------------------------------------------------------------------------
    @classmethod
    def chain(cls, num_nodes: int) -> "DraftTree":
        """A chain of ``num_nodes`` nodes (``num_nodes - 1`` proposed tokens)."""
        if num_nodes < 1:
            raise ValueError(f"a chain needs num_nodes >= 1 (1 = plain decode), got {num_nodes}")
        return cls([-1] + list(range(num_nodes - 1)))

    @classmethod
    def topk(cls, branching: int, depth: int, max_nodes: int | None = None) -> "DraftTree":
        """A full tree where every node has ``branching`` children down to ``depth`` levels below the root.

        Nodes are numbered breadth first. ``max_nodes`` truncates the breadth-first order (the result is still a
        valid tree), which gives top-k trees of any requested size.
        """
        if branching < 1 or depth < 0:
            raise ValueError(f"topk tree needs branching >= 1 and depth >= 0, got branching={branching}, depth={depth}")
        parents = [-1]
        frontier = [0]
        for _ in range(depth):
            nxt = []
            for node in frontier:
                for _ in range(branching):
                    parents.append(node)
                    nxt.append(len(parents) - 1)
            frontier = nxt
        if max_nodes is not None:
            if max_nodes < 1:
                raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
            parents = parents[:max_nodes]
        return cls(parents)

    @classmethod
    def topk_of_size(cls, branching: int, num_nodes: int) -> "DraftTree":
        """The first ``num_nodes`` nodes (breadth first) of an unbounded ``branching``-ary tree."""
        if branching < 1 or num_nodes < 1:
            raise ValueError(f"a top-k tree needs branching >= 1 and num_nodes >= 1, got branching={branching}, "
                             f"num_nodes={num_nodes}")
        depth = 0
        size = 1
        while size < num_nodes:
            depth += 1
            size += branching ** depth
        return cls.topk(branching, depth, max_nodes=num_nodes)

    # derived ------------------------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node``, both included."""
        path = [node]
        while self.parents[path[-1]] != -1:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def parents_tensor(self) -> torch.Tensor:
        """int64 [num_nodes], -1 for the root."""
        return torch.tensor(self.parents, dtype=torch.int64)

    def depth_tensor(self) -> torch.Tensor:
        """int64 [num_nodes]: depth of each node (root 0). Position ids are ``prefix_len + depth``."""
        return torch.tensor(self.depth, dtype=torch.int64)

    def ancestor_mask(self) -> torch.Tensor:
        """bool [num_nodes, num_nodes]: ``[i, j]`` is True when node j is node i or an ancestor of i."""
        n = self.num_nodes
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, i] = True
            if i > 0:
                mask[i] |= mask[self.parents[i]]
        return mask

    def packed_mask(self) -> torch.Tensor:
        """uint8 [num_nodes, ceil(num_nodes / 8)]: the ancestor mask, bit ``j % 8`` of byte ``j // 8`` of row i."""
        return pack_mask(self.ancestor_mask())

    def retrieve_links(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(retrieve_index, retrieve_next_token, retrieve_next_sibling), each int64 [num_nodes], -1 for none."""
        n = self.num_nodes
        index = torch.arange(n, dtype=torch.int64)
        next_token = torch.full((n,), -1, dtype=torch.int64)
        next_sibling = torch.full((n,), -1, dtype=torch.int64)
        last_child: dict[int, int] = {}
        for i in range(1, n):
            p = self.parents[i]
            if p in last_child:
                next_sibling[last_child[p]] = i
            else:
                next_token[p] = i
            last_child[p] = i
        return index, next_token, next_sibling


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Bit-pack a bool mask ``[..., n, n]`` into uint8 ``[..., n, ceil(n / 8)]`` (little-endian bits)."""
    if mask.dtype != torch.bool:
        raise TypeError(f"pack_mask expects a bool mask, got {mask.dtype}")
    n = mask.shape[-1]
    nbytes = (n + 7) // 8
    padded = torch.zeros(*mask.shape[:-1], nbytes * 8, dtype=torch.uint8, device=mask.device)
    padded[..., :n] = mask.to(torch.uint8)
    weights = (1 << torch.arange(8, device=mask.device, dtype=torch.int32)).to(torch.uint8)
    return (padded.view(*mask.shape[:-1], nbytes, 8) * weights).sum(-1).to(torch.uint8)


def unpack_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: uint8 ``[..., n, ceil(n/8)]`` → bool ``[..., n, n]``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_mask expects uint8, got {packed.dtype}")
    bits = torch.arange(8, device=packed.device, dtype=torch.int32)
    expanded = (packed.to(torch.int32).unsqueeze(-1) >> bits) & 1
    return expanded.reshape(*packed.shape[:-1], -1)[..., :n].bool()


class BatchedDraftTree:
    """Trees for several requests, all with the same ``num_nodes`` (pad a short tree with extra leaves).

    Parameters
    ----------
    trees : sequence of DraftTree
        One per request; equal ``num_nodes``.

    Attributes (CPU tensors; ``.to(device)`` moves them)
    -----------------------------------------------------
    parents : int64 [batch, k]
    depth : int64 [batch, k]
    packed_mask : uint8 [batch, k, ceil(k/8)]
    retrieve_index, retrieve_next_token, retrieve_next_sibling : int64 [batch, k]; retrieve_index is flattened
        (``b * k + i``) as SGLang stores it; the links are node indices within the request.
    """

    def __init__(self, trees: Sequence[DraftTree]):
        if not trees:
            raise ValueError("BatchedDraftTree needs at least one tree, got none")
        for b, t in enumerate(trees):
            if not isinstance(t, DraftTree):
                raise TypeError(f"trees[{b}] must be a DraftTree, got {type(t).__name__}; build it with "
                                "DraftTree(parents)")
        k = trees[0].num_nodes
        for b, t in enumerate(trees):
            if t.num_nodes != k:
                raise ValueError(f"every tree in a batch needs the same num_nodes: tree 0 has {k}, tree {b} has "
                                 f"{t.num_nodes}; pad the smaller tree with extra leaves")
        self.trees = tuple(trees)
        self.num_nodes = k
        self.batch = len(trees)
        self.parents = torch.stack([t.parents_tensor() for t in trees])
        self.depth = torch.stack([t.depth_tensor() for t in trees])
        self.packed_mask = torch.stack([t.packed_mask() for t in trees])
        links = [t.retrieve_links() for t in trees]
        self.retrieve_index = torch.stack([li[0] + b * k for b, li in enumerate(links)])
        self.retrieve_next_token = torch.stack([li[1] for li in links])
        self.retrieve_next_sibling = torch.stack([li[2] for li in links])

    @classmethod
    def repeat(cls, tree: DraftTree, batch: int) -> "BatchedDraftTree":
        return cls([tree] * batch)

    def ancestor_mask(self) -> torch.Tensor:
        """bool [batch, k, k]."""
        return torch.stack([t.ancestor_mask() for t in self.trees])

    @property
    def max_depth(self) -> int:
        return max(t.max_depth for t in self.trees)
