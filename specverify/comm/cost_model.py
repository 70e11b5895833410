"""Allreduce latency model: what verify-wall charges per allreduce when it runs ``--tp > 1`` on one GPU.

``allreduce_cost_us(nbytes, world_size, link, algo)`` returns microseconds from a table of
``latency = alpha_us + bytes_moved(nbytes, world_size) / bandwidth`` per (link, algorithm). :data:`source` says
where the figures come from: ``"cited"`` (the defaults below, public figures, none measured by us) until
:func:`load_measured` replaces them with rows measured by ``bench/bench_allreduce.py --json`` on a multi-GPU
machine, after which it reads ``"measured: <file>"``.

Cited figures (8 ranks unless said; eager launches, not CUDA graphs):

| what                                  | figure                                   | where                                     |
| ------------------------------------- | ---------------------------------------- | ----------------------------------------- |
| NCCL allreduce, 8x H100 NVLink         | 19.5 us @ 1 KB, 20.7 @ 16 KB, 23.1 @ 64 KB, 25.2 @ 512 KB, 32.4 @ 1 MB | ByteDance-Seed/Triton-distributed issue #57 (torch.distributed) |
| NCCL ring, small messages, 8x A100     | 33.7 us with one channel                  | NVIDIA/nccl-tests issue #123              |
| NCCL over PCIe, small messages         | ~25 us                                   | specverify issue 7 (seed measurements)    |
| one-shot IPC allreduce, 8x H100        | 6-15 us from small to 1 MB                | pytorch/pytorch PR #114001, as quoted in issue #131739 (a user saw ~17 us) |
| custom one-shot on NVLink              | 6-8 us at <= 64 KiB                       | specverify issue 7                         |
| one-shot vs two-shot on PCIe           | one-shot stops paying at ~64 KiB           | specverify issue 7                         |

The linear fits below pass through those points within ~1-2 us; they are a model for planning, not a benchmark.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specverify.comm import thresholds

#: Where the figures in use come from: "cited" or "measured: <path>".
source = "cited"


@dataclass(frozen=True)
class LinearCost:
    """``alpha_us + traffic_factor(world) * nbytes / bytes_per_us``."""

    alpha_us: float
    bytes_per_us: float  # bytes a rank moves per microsecond once the fixed cost is paid
    traffic: str  # "oneshot": (w-1)*n read per rank; "twoshot": 2*(w-1)/w*n; "ring": 2*(w-1)/w*n

    def __call__(self, nbytes: int, world_size: int) -> float:
        w = max(int(world_size), 1)
        if w == 1:
            return 0.0
        factor = (w - 1) if self.traffic == "oneshot" else 2.0 * (w - 1) / w
        return self.alpha_us + factor * nbytes / self.bytes_per_us


# NVLink NCCL: 19.5 us at 1 KB rising to 32.4 us at 1 MB over 8 ranks -> alpha ~19.5, slope 12.9 us per
# 1.75 MiB moved (2*7/8 * 1 MiB) -> ~142 kB/us. One-shot: 6 us + 7 * 64 KiB at 230 kB/us = 8 us at 64 KiB.
_CITED: dict[tuple[str, str], LinearCost] = {
    ("nvlink", "nccl"): LinearCost(19.5, 142_000.0, "ring"),
    ("nvlink", "oneshot"): LinearCost(6.0, 230_000.0, "oneshot"),
    ("nvlink", "twoshot"): LinearCost(9.0, 230_000.0, "twoshot"),
    ("pcie", "nccl"): LinearCost(25.0, 20_000.0, "ring"),
    ("pcie", "oneshot"): LinearCost(8.0, 20_000.0, "oneshot"),
    ("pcie", "twoshot"): LinearCost(11.0, 20_000.0, "twoshot"),
}

_TABLE: dict[tuple[str, str], LinearCost] = dict(_CITED)
_MEASURED: dict[tuple[str, str, int], list[tuple[int, float]]] = {}

_LINKS = ("nvlink", "pcie")
_ALGOS = ("auto", "oneshot", "twoshot", "nccl", "fused")


def allreduce_cost_us(nbytes: int, world_size: int, link: str = "nvlink", algo: str = "auto") -> float:
    """Modelled latency in microseconds of one allreduce of ``nbytes`` per rank over ``world_size`` ranks.

    Parameters
    ----------
    nbytes : int
        Message size per rank (e.g. ``tokens * hidden * 2`` for bf16).
    world_size : int
        Tensor-parallel ranks; 1 costs 0.
    link : {"nvlink", "pcie"}
        How the GPUs are connected.
    algo : {"auto", "oneshot", "twoshot", "nccl", "fused"}
        ``auto`` takes the algorithm :mod:`specverify.comm.thresholds` would choose; ``fused`` (allreduce +
        residual + RMSNorm) is charged as one-shot (the norm adds well under a microsecond for a few rows).

    Returns
    -------
    float
        Microseconds; interpolated from measured rows when :func:`load_measured` loaded some for this
        (link, algo, world size), else from the cited linear fits (see :data:`source`).

    Raises
    ------
    ValueError
        Unknown link or algo, negative nbytes, world_size < 1.

    Examples
    --------
    >>> round(allreduce_cost_us(56 * 1024, 8, "nvlink", "nccl"), 1) > round(allreduce_cost_us(56 * 1024, 8), 1)
    True
    """
    if link not in _LINKS:
        raise ValueError(f"link must be one of {_LINKS}, got {link!r}")
    if algo not in _ALGOS:
        raise ValueError(f"algo must be one of {_ALGOS}, got {algo!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size == 1:
        return 0.0
    if algo == "fused":
        algo = "oneshot"
    if algo == "auto":
        algo = thresholds.choose(nbytes, world_size, link)
    rows = _MEASURED.get((link, algo, world_size))
    if rows:
        return _interpolate(rows, nbytes)
    return _TABLE[(link, algo)](nbytes, world_size)


def _interpolate(rows: list[tuple[int, float]], nbytes: int) -> float:
    if nbytes <= rows[0][0]:
        return rows[0][1]
    for (x0, y0), (x1, y1) in zip(rows, rows[1:]):
        if nbytes <= x1:
            return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = rows[-2:] if len(rows) > 1 else (rows[0], rows[0])
    slope = (y1 - y0) / (x1 - x0) if x1 != x0 else 0.0
    return y1 + slope * (nbytes - x1)


def load_measured(path: str | Path) -> int:
    """Use latencies measured by ``bench/bench_allreduce.py --json PATH`` (multi-GPU rows only).

    Rows labelled correctness-only (ranks sharing one GPU) are ignored. Returns how many rows were loaded; when
    any were, :data:`source` becomes ``"measured: <path>"``.
    """
    global source
    data = json.loads(Path(path).read_text())
    rows = data["rows"] if isinstance(data, dict) else data
    loaded = 0
    table: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
    for row in rows:
        if row.get("correctness_only") or row.get("link") not in _LINKS:
            continue
        if row["algo"] not in ("oneshot", "twoshot", "nccl"):
            continue  # fused rows are charged as one-shot; keep only the plain algorithms
        algo = row["algo"]
        table.setdefault((row["link"], algo, int(row["world_size"])), []).append((int(row["nbytes"]), float(row["us"])))
        loaded += 1
    if loaded:
        for key in table:
            table[key].sort()
        _MEASURED.clear()
        _MEASURED.update(table)
        source = f"measured: {path}"
    return loaded


def reset() -> None:
    """Back to the cited figures."""
    global source
    _MEASURED.clear()
    source = "cited"
