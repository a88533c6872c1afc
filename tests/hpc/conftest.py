"""One local Slurm cluster (2 nodes x 4 fake GPUs, tests/slurm_cluster.py) for the tests that ask
for it. Without root or the Slurm packages those tests skip and say why; under CI (CI=true) they
fail instead, so the Slurm tests can never silently stop running there."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests.slurm_cluster import start_slurm_cluster, unavailable_reason


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = unavailable_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Slurm tests, but {reason}")
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="slurm", dir="/tmp"))
    cluster = start_slurm_cluster(base, num_nodes=2, gpus_per_node=4)
    try:
        yield cluster
    finally:
        cluster.stop()
