"""Every ``SPECVERIFY_*`` environment knob, read in one place.

The README's table lists the same names; ``specverify env`` prints their current values. Read the values through
the functions here (never ``os.environ`` elsewhere in the package) so a test can monkeypatch the environment.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    meaning: str


#: The table the README mirrors. Keep it sorted by name.
ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("SPECVERIFY_ALLREDUCE", "auto", "Custom allreduce: `auto` (eligibility gate), `off` (always NCCL), `oneshot`/`twoshot` (force an algorithm)."),
    EnvVar("SPECVERIFY_ALLREDUCE_TIMEOUT_S", "10", "Seconds a peer flag wait may spin before the allreduce raises instead of hanging."),
    EnvVar("SPECVERIFY_CACHE_DIR", "~/.cache/specverify", "JIT cache for compiled CUDA sources (versioned by specverify, arch and CUDA version, file-locked)."),
    EnvVar("SPECVERIFY_COMMIT", "", "Commit recorded in benchmark JSON (set by a runner that ships a `git archive` export; wins over git)."),
    EnvVar("SPECVERIFY_DISABLE_TRITON", "0", "`1` makes `impl=\"auto\"` choose the torch reference everywhere (debugging)."),
    EnvVar("SPECVERIFY_LOG_LEVEL", "WARNING", "Logging level of the `specverify` logger."),
    EnvVar("SPECVERIFY_MLA_WGMMA", "1", "`0` keeps MLA tree attention on the `tl.dot` kernels where the Gluon wgmma kernel would be the default (CUDA sm_90, a Triton with Gluon where the kernel compiles: 3.6-3.9)."),
    EnvVar("SPECVERIFY_PDL", "1", "`0` launches no kernel of the verify pass as a programmatic dependent (PDL, sm_90+): each waits for the previous one to finish before it starts."),
    EnvVar("SPECVERIFY_SGLANG_ALLREDUCE", "1", "SGLang plugin: replace SGLang's custom-allreduce class with ours where eligible."),
    EnvVar("SPECVERIFY_SGLANG_ATTENTION", "1", "SGLang plugin: register the `specverify` attention backend."),
    EnvVar("SPECVERIFY_SGLANG_GRAPH_POOL", "0", "SGLang plugin (experimental): one verify graph runner per draft length."),
    EnvVar("SPECVERIFY_SGLANG_ROUTING", "1", "SGLang plugin: route DeepSeek-V3/Kimi-K2 MoE top-k and block alignment through our kernels."),
)

_BY_NAME = {v.name: v for v in ENV_VARS}


def get(name: str) -> str:
    """The value of knob ``name`` (one of :data:`ENV_VARS`), or its default."""
    if name not in _BY_NAME:
        raise KeyError(f"unknown specverify environment variable {name!r}; known: {sorted(_BY_NAME)}")
    return os.environ.get(name, _BY_NAME[name].default)


def configure_logging() -> None:
    """Apply ``SPECVERIFY_LOG_LEVEL`` to the ``specverify`` logger. Below WARNING (INFO, DEBUG) the logger gets a
    stderr handler of its own when it has none, so the once-per-cause fallback messages of ``impl="auto"`` show."""
    import logging

    logger = logging.getLogger("specverify")
    name = get("SPECVERIFY_LOG_LEVEL").strip().upper()
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        logger.warning("SPECVERIFY_LOG_LEVEL=%r is not a logging level (DEBUG, INFO, WARNING, ERROR); using WARNING",
                       name)
        level = logging.WARNING
    logger.setLevel(level)
    if level < logging.WARNING and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("specverify %(levelname)s: %(message)s"))
        logger.addHandler(handler)


def get_flag(name: str) -> bool:
    """Knob ``name`` read as a boolean (``1/true/yes/on`` are true)."""
    return get(name).strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    """The JIT cache directory (``SPECVERIFY_CACHE_DIR``), expanded; not created here."""
    return Path(os.path.expanduser(get("SPECVERIFY_CACHE_DIR")))


def triton_interpret() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``, Triton's own knob)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def snapshot() -> dict[str, str]:
    """Every knob with its current value, for ``specverify env``."""
    return {v.name: get(v.name) for v in ENV_VARS}
