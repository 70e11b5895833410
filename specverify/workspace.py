"""Per-device scratch buffers that only grow, safe for CUDA graphs captured before they grow."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["grown_workspace"]

#: Buffers replaced by larger ones: CUDA graphs captured earlier still point at them, so they stay allocated.
_RETIRED: list = []


def grown_workspace(store: dict, device: torch.device, need: Sequence[int],
                    make: Callable[[Sequence[int]], tuple], what: str) -> tuple:
    """The workspace of ``device`` in ``store`` (a tuple of 1-d tensors), rebuilt by ``make(sizes)`` when a buffer
    has fewer elements than ``need`` says (each size the larger of the old and the needed one). The replaced tuple
    is kept alive (graphs that captured it replay into it). ``make`` must zero what must start at zero.

    Raises
    ------
    RuntimeError
        The workspace must grow during CUDA-graph capture (``what`` names the op): run one eager call at the
        largest shape first.
    """
    key = (device.type, device.index)
    ws = store.get(key)
    if ws is not None and all(t.numel() >= n for t, n in zip(ws, need)):
        return ws
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what}: the workspace must grow outside CUDA-graph capture; run one eager call at the "
                           "largest token count first")
    if ws is not None:
        _RETIRED.append(ws)
        need = [max(n, t.numel()) for t, n in zip(ws, need)]
    ws = make(need)
    store[key] = ws
    return ws
