"""The Ray cluster a job runs on: the one at RAY_ADDRESS (a Slurm job's, a user's), else a local
one started for the job and stopped after it."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from hpcrlhf.logs import get_logger

log = get_logger()


@contextmanager
def ray_session(nodes: int, gpus_per_node: int) -> Iterator[Optional[list[str]]]:
    """Connect this process to Ray for the block. Yields the node addresses in node-map order: the
    local cluster's, or HPCRLHF_NODE_IPS (a Slurm job's allocation order); None: Ray's own order
    (head first)."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    if address:
        log.info(f"connecting to the Ray cluster at {address} (RAY_ADDRESS)")
        ray.init(address=address, log_to_driver=False)
        order = os.environ.get("HPCRLHF_NODE_IPS")
        try:
            yield order.split(",") if order else None
        finally:
            ray.shutdown()
        return

    from hpcrlhf.cluster.local import start_local_cluster

    root = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths are limited
    log.info(f"no RAY_ADDRESS: starting a local Ray cluster of {nodes} node(s) x {gpus_per_node} GPU(s) "
             f"(logs in {root})")
    with start_local_cluster(nodes, gpus_per_node, cpus_per_node=os.cpu_count() or 1, root=root) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            yield cluster.node_ips
        finally:
            ray.shutdown()
