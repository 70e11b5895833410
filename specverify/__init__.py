"""specverify: kernels and runtime pieces that make the verify pass of speculative decoding cheap.

Public names are loaded lazily so that ``import specverify`` stays cheap (no Triton, no CUDA) — the SGLang plugin
entry point and ``specverify env`` rely on that.
"""
from __future__ import annotations

import importlib
import os as _os

__version__ = "0.1.0"

from specverify import envvars as _envvars  # noqa: E402  (plain Python: keeps the import cheap)

_envvars.configure_logging()

# In a source checkout, kernels/ and csrc/ sit beside this package rather than inside it (an install maps them to
# specverify.kernels and specverify/csrc); let the checkout resolve them the same way when run from its root.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (not _os.path.isdir(_os.path.join(__path__[0], "kernels"))
        and _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py"))
        and _os.path.isfile(_os.path.join(_root, "pyproject.toml"))):
    __path__.append(_root)

# public name -> module that defines it
_LAZY = {
    # foundation
    "DraftTree": "specverify.tree",
    "BatchedDraftTree": "specverify.tree",
    "ModelConfig": "specverify.configs",
    "get_config": "specverify.configs",
    "list_configs": "specverify.configs",
    "per_rank_shapes": "specverify.configs",
    "verify_bytes": "specverify.configs",
    # tree attention
    "tree_attention": "specverify.attention",
    "tree_attention_mla": "specverify.attention",
    # MoE
    "moe_route": "specverify.moe",
    "fused_moe": "specverify.moe",
    "moe_block": "specverify.moe_layer",
    "append_shared_expert": "specverify.moe",
    # acceptance and KV
    "verify_greedy": "specverify.accept",
    "verify_sampling": "specverify.accept",
    "compact_kv": "specverify.kv_cache",
    # runtime
    "VerifyGraphPool": "specverify.graph_pool",
    "DraftLengthController": "specverify.controller",
    "plan_draft_lengths": "specverify.plan",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'specverify' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
