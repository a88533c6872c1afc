"""GPU-only tests: collected everywhere, run where a CUDA device is (benchmarks/gpu-check.sh)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run benchmarks/gpu-check.sh on one)"))
