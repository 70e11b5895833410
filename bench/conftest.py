"""pytest-benchmark suite set-up: GPU-only (``pytest bench/ --benchmark-only`` on a CUDA machine)."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="the benchmark suite needs a CUDA GPU")
        for item in items:
            item.add_marker(skip)
