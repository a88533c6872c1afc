"""The Ray cluster a job runs on: the one at RAY_ADDRESS (a Slurm job's, a user's), else a local
one started for the job and stopped after it.

The local cluster is token-authenticated, like a Slurm job's (RAY_AUTH_MODE=token): Ray 2.60's
GCS, raylets, agents and workers listen on every interface of the host whatever node address they
are given (measured: `::` for --node-ip-address 127.0.0.2, and 127.0.0.1 is rewritten to the
host's external address), so without a token anyone who can reach the host could list the GCS and
run code as the user. The token is a fresh random file (0600) in the cluster's own folder (0700),
given only to the nodes and to this driver, and deleted when the cluster stops (its logs stay)."""

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

    from hpcrlhf.cluster.local import ray_auth_environ, start_local_cluster

    root = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths are limited; 0700
    log.info(f"no RAY_ADDRESS: starting a local Ray cluster of {nodes} node(s) x {gpus_per_node} GPU(s), "
             f"token-authenticated (logs in {root})")
    try:
        with start_local_cluster(nodes, gpus_per_node, cpus_per_node=os.cpu_count() or 1, root=root,
                                 auth_token_path=root / "auth_token") as cluster:
            with ray_auth_environ(cluster.client_env()):
                ray.init(address=cluster.address, log_to_driver=False)
                try:
                    yield cluster.node_ips
                finally:
                    ray.shutdown()
    finally:
        (root / "auth_token").unlink(missing_ok=True)
