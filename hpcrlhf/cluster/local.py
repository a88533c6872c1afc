"""A multi-node Ray cluster on this one machine: one Ray node per loopback address (127.0.0.2,
127.0.0.3, ...), each with its own ports and declared (fake) GPUs, so that placement across
nodes is exercised for real without a cluster.

Ray rewrites 127.0.0.1 and localhost to the machine's external address, so the nodes use other
loopback addresses. Each node runs in its own session and is stopped by process group: `ray
stop` would kill every Ray process on the machine, other users' included.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpcrlhf.cluster.bootstrap import PORTS_PER_NODE, RayPorts, ray_start_args, wait_for_nodes
from hpcrlhf.errors import HpcrlhfError


LOCAL_PORT_BASE = 30000


def free_port_block(size: int, start: int = 20000, end: int = 60000, host: str = "127.0.0.1") -> int:
    """The first port of `size` consecutive ports from `start` that are all free on `host` right now."""
    for base in range(start, end - size, size):
        socks = []
        try:
            for port in range(base, base + size):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise HpcrlhfError(f"no block of {size} free ports between {start} and {end}")


@dataclass
class LocalRayCluster:
    """Handles of a running local cluster; `stop()` ends every process it started."""

    address: str
    """The head's GCS address (ip:port), for `ray.init(address=...)`."""
    node_ips: list[str]
    """Node addresses in node-map order (the head first)."""
    temp_dir: Path
    groups: list[int] = field(default_factory=list)
    """Process group of each node's `ray start` (the node's daemons inherit it)."""

    def stop(self, timeout_s: float = 5.0) -> None:
        stop_process_groups(self.groups, timeout_s)

    def __enter__(self) -> "LocalRayCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def stop_process_groups(groups: list[int], timeout_s: float = 5.0) -> None:
    """SIGTERM every process group, SIGKILL what is left after `timeout_s` (daemons started in their
    own sessions: only what this process started is touched)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(_group_alive(g) for g in groups):
            time.sleep(0.2)
        if not any(_group_alive(g) for g in groups):
            return


def ray_executable() -> str:
    """The `ray` command of this Python environment (its bin folder first, then PATH): the nodes
    must run the same Ray, and their workers the same Python, as this process."""
    found = shutil.which("ray", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if found is None:
        raise HpcrlhfError(f"no `ray` command next to {sys.executable} or on PATH: install ray[default]")
    return found


def start_local_cluster(num_nodes: int, gpus_per_node: int, *, cpus_per_node: int = 2, root: Path,
                        timeout_s: float = 120.0) -> LocalRayCluster:
    """Start `num_nodes` Ray nodes on 127.0.0.2.. with `gpus_per_node` declared GPUs each, and wait
    until all have joined. Logs and sockets live under `root` (keep the path short: Ray's socket
    paths must fit in 107 bytes)."""
    root.mkdir(parents=True, exist_ok=True)
    ips = [f"127.0.0.{2 + i}" for i in range(num_nodes)]
    base = free_port_block(PORTS_PER_NODE * num_nodes, start=LOCAL_PORT_BASE)  # Slurm jobs' blocks lie below
    ports = [RayPorts.from_base(base + i * PORTS_PER_NODE) for i in range(num_nodes)]
    address = f"{ips[0]}:{ports[0].gcs}"
    cluster = LocalRayCluster(address=address, node_ips=ips, temp_dir=root)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    try:
        for i, (ip, p) in enumerate(zip(ips, ports)):
            args = ray_start_args(node_ip=ip, ports=p, head_address=None if i == 0 else address,
                                  num_cpus=cpus_per_node, num_gpus=gpus_per_node,
                                  temp_dir=str(root) if i == 0 else None)
            args[0] = ray_executable()
            log = open(root / f"ray_start_{i}.log", "w")
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            cluster.groups.append(proc.pid)
            if proc.wait(timeout=timeout_s) != 0:
                raise HpcrlhfError(f"`{' '.join(args)}` failed; see {root / f'ray_start_{i}.log'}")
        import ray

        ray.init(address=address, log_to_driver=False)
        try:
            wait_for_nodes(ips, timeout_s)
        finally:
            ray.shutdown()
    except BaseException:
        cluster.stop()
        raise
    return cluster
