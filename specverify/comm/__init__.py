"""Tensor-parallel communication for the verify pass: IPC allreduce, NCCL fallback, algorithm table, cost model.

- :class:`CustomAllReduce` — one-shot / two-shot allreduce over CUDA IPC (``csrc/allreduce.cu``), fused residual
  add + RMSNorm, NCCL above the thresholds.
- :class:`NcclAllReduce` — thin NCCL binding on torch's current stream (graph-capturable).
- :mod:`~specverify.comm.thresholds` — the algorithm table by message size, world size and link.
- :func:`allreduce_cost_us` — the latency model verify-wall charges when it runs ``--tp > 1`` on one GPU.
"""
from __future__ import annotations

from specverify.comm.cost_model import allreduce_cost_us
from specverify.comm.custom_allreduce import AllReduceTimeoutError, CustomAllReduce, residual_rmsnorm_reference
from specverify.comm.nccl import NcclAllReduce, NcclUnavailableError
from specverify.comm.thresholds import Rule, ThresholdTable, choose, get_table, refit, set_table

__all__ = [
    "AllReduceTimeoutError",
    "CustomAllReduce",
    "NcclAllReduce",
    "NcclUnavailableError",
    "Rule",
    "ThresholdTable",
    "allreduce_cost_us",
    "choose",
    "get_table",
    "refit",
    "residual_rmsnorm_reference",
    "set_table",
]
