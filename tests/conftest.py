"""Test set-up shared by every test file.

Without a CUDA device the Triton kernels run in Triton's CPU interpreter; ``TRITON_INTERPRET`` must be set before
triton (and so specverify's kernels) is first imported, which is why this happens at the top of conftest.
"""
from __future__ import annotations

import os

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch missing is reported by the imports below
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

DEVICE = "cuda" if _HAS_CUDA else "cpu"

# The SGLang plugin tests run in their own environment (sglang installed without its dependencies); elsewhere the
# folder is not collected at all.
import importlib.metadata  # noqa: E402


def _sglang_installed() -> bool:
    try:  # the installed distribution, not the tests/sglang folder (a namespace package on sys.path)
        importlib.metadata.version("sglang")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


collect_ignore = [] if _sglang_installed() else ["sglang"]


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Without a GPU the interpreter makes the suite CPU-bound in one process: where pytest-xdist is installed (the
    ``test`` extra) and no ``-n`` was given, run it in one worker per core, at most 4 (``-n 0`` runs serially)."""
    opt = config.option
    if _HAS_CUDA or not hasattr(opt, "numprocesses") or opt.numprocesses is not None or \
            os.environ.get("PYTEST_XDIST_WORKER") or getattr(opt, "collectonly", False) or \
            getattr(opt, "usepdb", False):
        return
    workers = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if workers > 1:
        opt.numprocesses, opt.dist, opt.tx = workers, "load", ["popen"] * workers


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs several CUDA GPUs")
    n_gpu = torch.cuda.device_count() if _HAS_CUDA else 0
    for item in items:
        if "gpu" in item.keywords and not _HAS_CUDA:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(skip_multi)


@pytest.fixture
def device() -> str:
    """``cuda`` when a GPU is present, else ``cpu`` (Triton kernels then run in the interpreter)."""
    return DEVICE


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer poisoned with NaN (or -1 for integers) so unwritten elements cannot pass."""
    out = torch.empty_like(t)
    if out.is_floating_point():
        out.fill_(math.nan)
    else:
        out.fill_(-1)
    return out


@pytest.fixture
def poison():
    return nan_like


class LaunchSpy:
    """Stands in for a ``@triton.jit`` kernel called as ``kernel[grid](...)``: records each launch's grid and keyword
    arguments (its constexprs), then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids, self.kwargs = kernel, [], []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.grids.append(grid)
            self.kwargs.append(kwargs)
            return launch(*args, **kwargs)

        return run


def spy_launches(monkeypatch, module, name: str) -> LaunchSpy:
    """Replace ``module.<name>`` (a Triton kernel) with a :class:`LaunchSpy` of it for the test."""
    spy = LaunchSpy(getattr(module, name))
    monkeypatch.setattr(module, name, spy)
    return spy


def warm_up_for_capture(step):
    """Run ``step()`` eagerly (compiles, allocates workspaces), then once on a side stream, as CUDA-graph capture
    wants before it records; returns the eager call's result."""
    result = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    return result


def check_graph_replay(step, inputs, replays: int = 2, check=None) -> None:
    """Capture ``step()`` (already warmed up: compiled, workspaces allocated) in a CUDA graph, then ``replays``
    times: replay, compare every captured output with an eager ``step()`` bit for bit (or, with ``check``, hand the
    captured outputs to ``check`` instead), and refill ``inputs`` in place with fresh normals, so later replays must
    follow inputs that changed after capture."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        if check is not None:
            check(captured)
        else:
            eager = step()
            pairs = zip(captured, eager, strict=True) if isinstance(captured, tuple) else [(captured, eager)]
            for i, (got, want) in enumerate(pairs):
                assert torch.equal(got, want), f"graph replay output {i} differs from the eager call"
        for t in inputs:
            t.copy_(torch.randn_like(t))


@pytest.fixture
def graph_replay():
    """:func:`check_graph_replay`, for GPU tests of capturable ops."""
    return check_graph_replay
