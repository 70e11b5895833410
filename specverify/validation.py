"""Input checks shared by the public entry points. Each raises ValueError (shapes, values) or TypeError (dtypes)
naming what was expected, what came, and how to fix it. Checks that read tensor values synchronise with the device,
so callers skip them while a CUDA graph is being captured (:func:`capturing`)."""
from __future__ import annotations

import torch

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
