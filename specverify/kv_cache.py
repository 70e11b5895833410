"""Paged KV compaction after acceptance: move the accepted path into the request's next contiguous positions."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specverify.accept import _choose_impl
from specverify.validation import capturing


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def compact_kv(caches: Sequence[torch.Tensor] | torch.Tensor, page_table: torch.Tensor, prefix_lens: torch.Tensor,
               accepted_nodes: torch.Tensor, accept_len: torch.Tensor, *, impl: str = "auto",
               validate: bool = True) -> None:
    """Move each request's accepted KV to positions ``prefix_len + d`` in place, for every cache given.

    During verify node i of request b sits at position ``prefix_lens[b] + i``; after acceptance node
    ``accepted_nodes[b, d]`` must sit at ``prefix_lens[b] + d`` for ``d <= accept_len[b]``. Nothing else in the
    pool is written (the slots of rejected nodes keep stale values; they are overwritten by the next step).
    Source and destination ranges may overlap. The layout convention is SGLang's paged KV pool
    (``token_to_kv_pool``), one page table per request.

    Parameters
    ----------
    caches : torch.Tensor or sequence of torch.Tensor
        Each ``[num_pages, page_size, *row]`` (MLA latent ``[P, page, 576]``, GQA ``[P, page, Hkv, D]``), any dtype,
        the ``row`` dims contiguous; all on one device with the same ``page_size``. Mutated.
    page_table : torch.Tensor
        Shape: (batch, max_pages); int32 or int64. Position t of request b lives at page
        ``page_table[b, t // page_size]``, slot ``t % page_size``.
    prefix_lens : torch.Tensor
        Shape: (batch,); int32 or int64.
    accepted_nodes : torch.Tensor
        Shape: (batch, L); int64 (or int32). From :func:`specverify.verify_greedy` / ``verify_sampling``.
    accept_len : torch.Tensor
        Shape: (batch,); int64 (or int32).
    impl : {"auto", "triton", "reference"}
    validate : bool
        Check the values (one host sync, skipped under CUDA-graph capture): ``0 <= accept_len[b] < L``, prefix
        lengths >= 0, the used accepted nodes strictly increasing and never below their depth, and every position
        read or written inside the page table with its page id inside every cache. The kernel trusts these; a bad
        value would read or write outside the request's pages.

    Raises
    ------
    ValueError, TypeError
        Shapes, devices or dtypes that disagree; a cache whose row dims are not contiguous; with ``validate``, a
        value outside the ranges above (the message names the request).

    Notes
    -----
    One launch per run of equally spaced caches (grid: request x column block x cache of the run): consecutive
    caches of one shape, dtype and strides, views of one storage at a constant, nonzero address step no smaller than
    the span of one cache (so they do not overlap), such as the per-layer views of
    :meth:`specverify.forward.model.VerifyModel.allocate_kv`'s one buffer, flattened ``[c for layer in caches for
    c in layer]``: a 61-layer model pays one launch, not 61. Any other cache (a separate allocation, a repeated or
    overlapping view) is a run of one, launched on its own in list order, as before. A run longer than CUDA's
    grid limit (65535) is split. With ``validate=False`` or under capture no host sync: CUDA-graph capturable.
    Copies run in increasing depth inside one program, which is safe for overlapping ranges because accepted node
    indices strictly increase and are never below their depth.

    Examples
    --------
    >>> import torch
    >>> cache = torch.arange(8.0).view(8, 1, 1)  # 8 pages of one slot
    >>> compact_kv([cache], torch.arange(8).view(1, 8), torch.tensor([2]), torch.tensor([[0, 3, -1]]),
    ...            torch.tensor([1]), impl="reference")
    >>> cache.view(-1).tolist()
    [0.0, 1.0, 2.0, 5.0, 4.0, 5.0, 6.0, 7.0]
    """
    if isinstance(caches, torch.Tensor):
        caches = [caches]
    caches = list(caches)
    if not caches:
        return
    for name, t in (("page_table", page_table), ("prefix_lens", prefix_lens), ("accepted_nodes", accepted_nodes),
                    ("accept_len", accept_len)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if accepted_nodes.dim() != 2:
        raise ValueError(f"accepted_nodes must have shape [batch, L], got {list(accepted_nodes.shape)}")
    batch, length = accepted_nodes.shape
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table must have shape [batch, max_pages] with batch = {batch}, got "
                         f"{list(page_table.shape)}")
    for name, t in (("prefix_lens", prefix_lens), ("accept_len", accept_len)):
        if tuple(t.shape) != (batch,):
            raise ValueError(f"{name} must have shape [batch] = [{batch}], got {list(t.shape)}")
    device = accepted_nodes.device
    page_size = caches[0].shape[1] if caches[0].dim() >= 2 else 0
    for i, c in enumerate(caches):
        if not isinstance(c, torch.Tensor):
            raise TypeError(f"caches[{i}] must be a torch.Tensor, got {type(c).__name__}")
        if c.dim() < 3:
            raise ValueError(f"caches[{i}] must be [num_pages, page_size, ...] with at least 3 dims, got "
                             f"{list(c.shape)}")
        if c.shape[1] != page_size:
            raise ValueError(f"every cache needs the same page_size: caches[0] has {page_size}, caches[{i}] has "
                             f"{c.shape[1]}")
        if c.device != device:
            raise ValueError(f"caches[{i}] is on {c.device}, expected {device} with accepted_nodes")
        if not c[0, 0].is_contiguous() or c.stride(-1) != 1:
            raise ValueError(f"caches[{i}] must have contiguous row dims [{', '.join(map(str, c.shape[2:]))}], got "
                             f"strides {c.stride()}; use a contiguous pool")
    for name, t in (("page_table", page_table), ("prefix_lens", prefix_lens), ("accept_len", accept_len)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")
    if validate and not capturing():
        _check_values(min(c.shape[0] for c in caches), page_size, page_table, prefix_lens, accepted_nodes,
                      accept_len)
    which = _choose_impl(impl, device, "compact_kv")
    if which == "reference":
        from specverify.reference.kv import compact_kv_reference

        compact_kv_reference(caches, page_table, prefix_lens, accepted_nodes, accept_len)
        return
    from specverify.kernels.kv_compact import _kv_compact_kernel

    nodes = accepted_nodes.contiguous()
    pt = page_table if page_table.stride(1) == 1 else page_table.contiguous()
    for c, count, stride_cache in _compaction_runs(caches):
        row = c[0, 0].numel()
        block = min(4096, max(16, _pow2(row)))
        grid = (batch, -(-row // block), count)
        _kv_compact_kernel[grid](c, pt, prefix_lens, nodes, accept_len, length, row, stride_cache, c.stride(0),
                                 c.stride(1), pt.stride(0), PAGE_SIZE=page_size, BLOCK=block,
                                 num_warps=4 if block >= 512 else 1)


#: CUDA's limit on grid axis 2 (the caches of one launch): a longer run is served by several launches
_GRID_Z_MAX = 65535


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from the lowest to one past the highest address a non-empty tensor covers."""
    return (sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _compaction_runs(caches: list[torch.Tensor], max_run: int | None = None) -> list[tuple[torch.Tensor, int, int]]:
    """Group ``caches`` into the runs one compaction launch serves: ``(base, count, stride_cache)``, cache z of the
    run at ``base`` + ``z * stride_cache`` elements, in list order.

    A run is consecutive caches of one shape, dtype and strides, views of one storage whose addresses step by a
    constant ``delta`` bytes, a nonzero multiple of the element size with ``|delta|`` at least one cache's span: so
    a run's caches are disjoint and compacting them in one grid equals compacting them one after another. A run
    whose addresses decrease is launched from its lowest cache (``base`` is its last one, ``stride_cache`` > 0).
    Everything else (a separate allocation, the same tensor twice, overlapping views) is a run of one,
    ``(cache, 1, 0)``. Runs hold at most ``max_run`` caches (default: CUDA's grid limit, :data:`_GRID_Z_MAX`).
    """
    max_run = _GRID_Z_MAX if max_run is None else max_run
    runs = []
    i = 0
    while i < len(caches):
        first = caches[i]
        j, delta = i + 1, 0
        if first.numel() > 0:
            storage, span = first.untyped_storage().data_ptr(), _span_bytes(first)
            while j < len(caches) and j - i < max_run:
                c = caches[j]
                if (c.shape != first.shape or c.dtype != first.dtype or c.stride() != first.stride()
                        or c.untyped_storage().data_ptr() != storage):
                    break
                step = c.data_ptr() - caches[j - 1].data_ptr()
                if delta == 0:  # the run's second cache sets its step
                    if step == 0 or step % first.element_size() or abs(step) < span:
                        break
                    delta = step
                elif step != delta:
                    break
                j += 1
        if j - i == 1:
            runs.append((first, 1, 0))
        else:
            runs.append((first if delta > 0 else caches[j - 1], j - i, abs(delta) // first.element_size()))
        i = j
    return runs


def _check_values(num_pages: int, page_size: int, page_table: torch.Tensor, prefix_lens: torch.Tensor,
                  accepted_nodes: torch.Tensor, accept_len: torch.Tensor) -> None:
    """compact_kv's value checks on host copies (one sync); the first bad request is named."""
    nodes, acc, prefix, pt = (t.detach().to("cpu", torch.int64) for t in (accepted_nodes, accept_len, prefix_lens,
                                                                         page_table))
    batch, length = nodes.shape
    for b in range(batch):
        a, p = int(acc[b]), int(prefix[b])
        if not 0 <= a < length:
            raise ValueError(f"compact_kv: accept_len[{b}] = {a} is outside [0, {length - 1}]: accepted_nodes has "
                             f"{length} columns (the root and up to {length - 1} accepted draft tokens); pass the "
                             "accept_len returned with these accepted_nodes")
        if p < 0:
            raise ValueError(f"compact_kv: prefix_lens[{b}] = {p} is negative; expected the request's prefix length")
        used = nodes[b, : a + 1]
        depth = torch.arange(a + 1)
        if bool((used < depth).any()) or bool((used[1:] <= used[:-1]).any()):
            raise ValueError(f"compact_kv: accepted_nodes[{b}, :{a + 1}] = {used.tolist()} must strictly increase "
                             "with the node at depth d >= d (a root-to-leaf path in topological order); pass the "
                             "accepted_nodes returned by verify_greedy / verify_sampling")
        last = p + int(used[-1])  # the highest position read; positions written are lower
        if last // page_size >= pt.shape[1]:
            raise ValueError(f"compact_kv: request {b} reads position {last} (prefix {p} + node {int(used[-1])}), "
                             f"past its page table of {pt.shape[1]} pages x {page_size}; give each request pages "
                             "for its prefix and every draft token")
        pages = pt[b, p // page_size: last // page_size + 1]
        if bool(((pages < 0) | (pages >= num_pages)).any()):
            bad = int(pages[(pages < 0) | (pages >= num_pages)][0])
            raise ValueError(f"compact_kv: request {b} touches page id {bad}, outside the caches' [0, {num_pages}); "
                             "every page a request's draft tokens use must be a page of the cache")
