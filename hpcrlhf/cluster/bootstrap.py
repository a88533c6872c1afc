"""Starting Ray nodes by hand, as a Slurm job (or a test) does: the `ray start` command lines,
the ports each node uses, and waiting until every expected node has joined.

Pure functions render the commands, so the sbatch renderer and the local test cluster share
them. Every port is given explicitly: two Ray nodes on one host (a test cluster, or two jobs
sharing a Slurm node) would otherwise collide on Ray's defaults.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass, fields
from pathlib import Path
from collections.abc import Callable, Sequence

from hpcrlhf.engines.store_ports import NODE_SERVICE_PORTS, STORE_PORTS_ENV, ports_text
from hpcrlhf.errors import HpcrlhfError

PORTS_PER_NODE = 110 + NODE_SERVICE_PORTS
"""Ports one node of a job takes from its base: Ray's 10 service ports, its 100 worker ports, then
20 for the job's own rendezvous stores (hpcrlhf.engines.rendezvous) and reward servers."""


@dataclass(frozen=True)
class RayPorts:
    """The ports of one Ray node (`gcs` is used by the head only)."""

    gcs: int
    node_manager: int
    object_manager: int
    dashboard_agent_grpc: int
    dashboard_agent_listen: int
    runtime_env_agent: int
    metrics_export: int
    client_server: int
    autoscaler_metrics: int
    dashboard_metrics: int
    min_worker: int
    max_worker: int

    @classmethod
    def from_base(cls, base: int) -> RayPorts:
        """Consecutive ports from `base`: 10 service ports, then 100 worker ports (one per worker
        process; Ray needs one per actor/task worker alive at the same time)."""
        if not 1024 <= base <= 65535 - PORTS_PER_NODE:
            raise HpcrlhfError(f"Ray base port {base} is out of range: use 1024..{65535 - PORTS_PER_NODE}")
        names = [f.name for f in fields(cls)][:10]
        return cls(**{n: base + i for i, n in enumerate(names)}, min_worker=base + 10, max_worker=base + 109)

    @property
    def stores(self) -> range:
        """The node's ports for the job's torch.distributed stores (rendezvous of process groups and
        weight-sync groups) and its reward servers: the block's last 20, after Ray's."""
        return range(self.max_worker + 1, self.gcs + PORTS_PER_NODE)

    def env(self) -> dict[str, str]:
        """Environment of `ray start` for the ports not given as flags: the head's autoscaler and
        dashboard metrics servers (Ray's defaults, 44217 and 44227, would be shared by every job on a
        node and, bound to all interfaces, tell each job's metrics to any user), and the ports of the
        job's stores, which the node's workers inherit (hpcrlhf.engines.rendezvous)."""
        return {"AUTOSCALER_METRIC_PORT": str(self.autoscaler_metrics), "DASHBOARD_METRIC_PORT": str(self.dashboard_metrics),
                STORE_PORTS_ENV: ports_text(self.stores)}


HEALTH_CHECKS = {"health_check_period_ms": 2000, "health_check_timeout_ms": 6000, "health_check_failure_threshold": 5}
"""How the head's GCS decides a node is dead (set here rather than left to Ray's defaults): a
node whose raylet stops answering is declared dead after 5 failed checks, 10-30 s, and the
actors on it fail, so the driver ends the run (hpcrlhf.cluster.worker_group.gather) instead of
waiting on them. Not lower: a node busy loading a 70B checkpoint must not be declared dead."""


def private_temp_dir(parent: Path) -> str:
    """Ray's temp folder for a node, inside `parent` made private to this user (0700).

    Ray makes its temp folder (sockets, logs, session files) world-writable (0777: "so others can
    use it"), so in /tmp any user could replace a node's sockets or files. Inside a 0700 parent
    nobody else can reach it. `parent` is created if needed; an existing one must be this user's
    and not a symlink (a predictable name in /tmp could have been planted by someone else)."""
    try:
        parent.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        info = parent.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise HpcrlhfError(f"{parent} exists and is not a folder of this user (uid {os.getuid()}); Ray's temp "
                               "folder for this node would be in it: remove it, or ask who made it") from None
    os.chmod(parent, 0o700)
    return str(parent / "ray")


def ray_start_args(*, node_ip: str, ports: RayPorts, head_address: str | None, num_cpus: int, num_gpus: int,
                   temp_dir: str | None = None, resources: dict[str, float] | None = None,
                   block: bool = False) -> list[str]:
    """`ray start` for a head (`head_address` None) or a worker joining `head_address` (ip:port).

    The dashboard is off (on shared nodes it would be reachable by other users); usage stats are
    off (compute nodes are offline); so is the log monitor, which tails every log file of the node
    to publish it to drivers that print workers' output -- hpcrlhf's drivers do not
    (`log_to_driver=False`: the output stays in the run's logs), and it took ~2.5 % of CI's CPU."""
    args = ["ray", "start", f"--node-ip-address={node_ip}", f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
            f"--node-manager-port={ports.node_manager}", f"--object-manager-port={ports.object_manager}",
            f"--dashboard-agent-grpc-port={ports.dashboard_agent_grpc}",
            f"--dashboard-agent-listen-port={ports.dashboard_agent_listen}",
            f"--runtime-env-agent-port={ports.runtime_env_agent}", f"--metrics-export-port={ports.metrics_export}",
            f"--min-worker-port={ports.min_worker}", f"--max-worker-port={ports.max_worker}",
            "--disable-usage-stats", "--include-log-monitor=false"]
    if head_address is None:
        args += ["--head", f"--port={ports.gcs}", f"--ray-client-server-port={ports.client_server}",
                 "--include-dashboard=false", f"--system-config={json.dumps(HEALTH_CHECKS, sort_keys=True)}"]
    else:
        args += [f"--address={head_address}"]
    if temp_dir:
        args.append(f"--temp-dir={temp_dir}")
    if resources:
        args.append(f"--resources={json.dumps(resources, sort_keys=True)}")
    if block:
        args.append("--block")
    return args


def alive_node_ips() -> list[str]:
    """Addresses of the live nodes of the Ray cluster this process is connected to."""
    import ray

    return [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]


def wait_for_nodes(expected_ips: Sequence[str], timeout_s: float = 120.0, *,
                   alive: Callable[[], list[str]] = alive_node_ips, poll_s: float = 0.5) -> None:
    """Block until every node in `expected_ips` has joined; on timeout, fail naming the missing ones.

    Polling, never a fixed sleep: a slow node delays the start, a missing one ends it clearly."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = sorted(set(expected_ips) - set(alive()))
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise HpcrlhfError(
                f"{len(missing)} of {len(expected_ips)} Ray node(s) did not join within {timeout_s:.0f} s: "
                f"{', '.join(missing)}; check their `ray start` logs (the node's /tmp/ray/session_latest/logs, "
                f"or the job's srun output) and that they can reach the head")
        time.sleep(poll_s)
