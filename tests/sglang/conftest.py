"""Set-up for the SGLang plugin tests (run only in the SGLang virtual environment, ``.ci/sglang_env.sh``).

The parent conftest has already set ``TRITON_INTERPRET=1`` on a machine without CUDA. Here: the import-only
stand-ins SGLang's module-level imports need (``standins.py``), then SGLang's plugin loading, once per session, the
way every SGLang process does it. Every test in this folder carries the ``sglang`` marker.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

if importlib.util.find_spec("sglang") is not None:  # only in the SGLang venv: never alter other test sessions
    sys.path.insert(0, os.path.dirname(__file__))
    import standins

    standins.install()
    HIDDEN_CUDA = standins.hide_cuda_from_sglang()  # GPU machine without sgl_kernel: SGLang's CPU code paths


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.sglang)


@pytest.fixture(scope="session")
def sglang_loaded():
    """SGLang with our plugin loaded through its own entry-point machinery (all parts enabled)."""
    pytest.importorskip("sglang", reason="SGLang is not installed: run in the venv made by .ci/sglang_env.sh")
    for name in ("SPECVERIFY_SGLANG_ATTENTION", "SPECVERIFY_SGLANG_ROUTING", "SPECVERIFY_SGLANG_ALLREDUCE"):
        os.environ.setdefault(name, "1")
    os.environ.pop("SGLANG_PLUGINS", None)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from specverify.integrations import sglang as plugin

    return plugin


@pytest.fixture
def testcase():
    """The unittest-style object SGLang's attention test kit reports through (skipTest / assertions)."""
    import unittest

    class _Case(unittest.TestCase):
        def runTest(self):  # pragma: no cover - never run, only a carrier
            pass

    return _Case()
