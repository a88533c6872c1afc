"""One local two-node Ray cluster (127.0.0.2 and 127.0.0.3, 4 declared GPUs each) for the tests of
this package; stopped (and the driver disconnected) before the rest of the suite runs."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="package")
def ray_cluster():
    import ray

    from hpcrlhf.cluster.local import start_local_cluster

    root = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths are limited
    with start_local_cluster(2, 4, cpus_per_node=4, root=root) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            yield cluster
        finally:
            ray.shutdown()
