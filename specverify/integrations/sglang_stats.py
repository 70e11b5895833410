"""Bookkeeping shared by the SGLang plugin (:mod:`specverify.integrations.sglang`, its hooks) and its attention
backend (:mod:`specverify.integrations.sglang_backend`): counters of which path ran and log-once messages.

It lives apart from both so that the backend, which the plugin creates, does not import the plugin. Plain Python:
importing it imports neither SGLang nor torch.
"""
from __future__ import annotations

import logging

logger = logging.getLogger("specverify.sglang")

#: Counters the tests read to prove a path really ran (cheap: plain int increments on the host).
STATS: dict[str, int] = {
    "routing_ours": 0, "routing_declined": 0,
    "alignment_ours": 0, "alignment_declined": 0,
    "allreduce_ours": 0, "allreduce_declined": 0,
    "verify_ours": 0, "verify_declined": 0,
}

_LOGGED: set[str] = set()


def log_once(key: str, msg: str, level: int = logging.INFO) -> None:
    """Log ``msg`` on the ``specverify.sglang`` logger the first time ``key`` is seen in this process."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, msg)


def reset_stats() -> None:
    """Zero :data:`STATS` (tests)."""
    for k in STATS:
        STATS[k] = 0
