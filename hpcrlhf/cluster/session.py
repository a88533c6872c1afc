"""The Ray cluster a job runs on: the one at RAY_ADDRESS (a Slurm job's, a user's), else a local
one started for the job and stopped after it.

The local cluster is token-authenticated, like a Slurm job's (RAY_AUTH_MODE=token): Ray 2.60's
GCS, raylets, agents and workers listen on every interface of the host whatever node address they
are given (measured: `::` for --node-ip-address 127.0.0.2, and 127.0.0.1 is rewritten to the
host's external address), so without a token anyone who can reach the host could list the GCS and
run code as the user. The token is a fresh random file (0600) in the cluster's own folder (0700),
given only to the nodes and to this driver, and deleted when the cluster stops (its logs stay).
Before any of that, `isolate_local_cluster` moves the job into a private network namespace (only
loopback; hpcrlhf.cluster.netns), so the open ports are not even on the host's interfaces.

The local cluster is this host, so `local_cluster_problem` checks the node map against the host's
own GPUs before one is started (unless the recipe simulates its GPUs: placement.simulated_gpus)."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterator

from hpcrlhf.cluster import netns
from hpcrlhf.cluster.local import ray_auth_environ, start_local_cluster
from hpcrlhf.config.schema import TrainJobConfig
from hpcrlhf.errors import ConfigError
from hpcrlhf.logs import get_logger
from hpcrlhf.placement.layout import plural, shape_text
from hpcrlhf.placement.problems import Problem

log = get_logger()


def host_gpus() -> int:
    """The GPUs this host has, as torch sees them (0 on a CPU-only host)."""
    import torch

    return torch.cuda.device_count()


def local_cluster_problem(nodes: int, gpus_per_node: int, *, gpus_here: int, simulated: bool) -> Problem | None:
    """Why a local Ray cluster for a map of `nodes` x `gpus_per_node` cannot run on this host of
    `gpus_here` GPUs (None: it can). Every node of a local cluster is this host and its workers see the
    map's GPU numbers, so only a one-node map uses distinct real GPUs; `simulated` GPUs (declared,
    not real) always fit."""
    if simulated or (nodes == 1 and gpus_per_node <= gpus_here):
        return None
    have = "no GPU" if gpus_here == 0 else plural(gpus_here, "GPU")
    reason = (f"without RAY_ADDRESS the job starts a local Ray cluster on this host, which has {have} "
              "(torch.cuda.device_count())")
    if nodes > 1 and nodes * gpus_per_node <= gpus_here:
        reason += f"; the local cluster's {nodes} nodes would all share its GPUs 0-{gpus_per_node - 1}"
    smaller = (f"a layout of 1 node x at most {plural(gpus_here, 'GPU')} (placement.nodes=1, placement.gpus_per_node="
               f"{gpus_here} and roles that fit)" if gpus_here else
               "a recipe made for this host (ppo-tiny-ray-colocated simulates its GPUs on CPU, for tiny models)")
    fix = (f"run it on a Slurm allocation of {shape_text(nodes, gpus_per_node)} (`hpcrlhf submit RECIPE` or `hpcrlhf "
           f"sbatch RECIPE`, with the same --set options), attach to a running Ray cluster that has them "
           f"(RAY_ADDRESS=HOST:PORT), or use {smaller}")
    return Problem("placement", shape_text(nodes, gpus_per_node), reason, fix)


def isolate_local_cluster(kind: str, cfg: TrainJobConfig) -> None:
    """First thing of a job that will start its own Ray cluster (a Ray PPO job without RAY_ADDRESS):
    move the process into a private network as placement.local_network asks (hpcrlhf.cluster.netns),
    while it is still single-threaded. Other jobs are left alone."""
    placement = getattr(cfg, "placement", None)
    if kind != "ppo" or placement is None or placement.runtime != "ray" or os.environ.get("RAY_ADDRESS"):
        return

    try:
        netns.isolate(placement.local_network)
    except OSError as e:
        raise ConfigError(f"placement.local_network=private: this job cannot enter a private network namespace "
                          f"({e.strerror or e}); have the administrator allow unprivileged user namespaces, run "
                          "the job on a Slurm allocation (`hpcrlhf submit`/`sbatch`), or set "
                          "placement.local_network=auto (the host's network, with a warning) or host") from None


@contextmanager
def ray_session(nodes: int, gpus_per_node: int) -> Iterator[list[str] | None]:
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
