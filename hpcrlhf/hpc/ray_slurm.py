"""A Ray cluster over a Slurm allocation, and the PPO driver on it.

    srun --ntasks-per-node=1 python -m hpcrlhf.hpc.ray_slurm node   # one Ray node per allocated node
    python -m hpcrlhf.hpc.ray_slurm driver <hpcrlhf args>   # on the first node: wait for all, train

Node 0 of the allocation (`scontrol show hostnames` order) runs the head. Its GCS port comes from
the job id (`job_ports`), so the other nodes find it without shared files, and two jobs sharing a
node use different ports; the other nodes take the first free block after their own job-derived
base. Token authentication is on when the script exported RAY_AUTH_MODE=token; the dashboard is
off. Ray's processes ignore SIGUSR1/SIGUSR2 (a time-limit signal delivered to the whole job must
reach the driver, which checkpoints, and not kill the cluster under it). A worker node stops when
the head has gone; every node stops on SIGTERM/SIGINT (the script's teardown). A node whose Ray ends by
itself fails its task: srun ends the nodes' step, and the script then stops the driver (job lost: 4).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Sequence

from hpcrlhf.cluster.bootstrap import PORTS_PER_NODE, RayPorts, private_temp_dir, ray_start_args, wait_for_nodes
from hpcrlhf.cluster.local import free_port_block, ray_executable, stop_process_groups
from hpcrlhf.errors import HpcrlhfError
from hpcrlhf.hpc.allocation import Allocation, check_fits, node_addresses
from hpcrlhf.hpc.program import CLI, run_module
from hpcrlhf.run.signals import catch_early_stop_signals

PORT_BASE = 20000
PORT_SLOTS = 60
"""Job-derived port blocks: 20000 + (job id % 60) x 130 (+130 per node): below the local clusters'
ports (30000+, hpcrlhf.cluster.local) and Linux's ephemeral ports (32768+)."""
JOIN_TIMEOUT_S = float(os.environ.get("HPCRLHF_RAY_JOIN_TIMEOUT_S", "300"))
"""How long the driver waits for every node to join (and a worker for the head to come up)."""
RAY_IGNORED = (signal.SIGUSR1, signal.SIGUSR2)


def job_ports(job_id: int, node_index: int = 0) -> RayPorts:
    """Node `node_index`'s first-choice ports in job `job_id` (the head's are fixed by the job id)."""
    return RayPorts.from_base(PORT_BASE + ((job_id % PORT_SLOTS) + node_index) * PORTS_PER_NODE)


def head_address(alloc: Allocation) -> str:
    return f"{node_addresses(alloc.hosts[:1])[0]}:{job_ports(alloc.job_id).gcs}"


def _port_open(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def wait_for_head(address: str, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not _port_open(address):
        if time.monotonic() >= deadline:
            raise HpcrlhfError(f"the Ray head at {address} did not come up within {timeout_s:.0f} s: see the head "
                               f"node's `ray start` output in the job log")
        time.sleep(1.0)


def node_ports(alloc: Allocation, node_index: int, node_ip: str) -> RayPorts:
    ports = job_ports(alloc.job_id, node_index)
    first = ports.gcs
    if node_index == 0:
        try:
            free_port_block(PORTS_PER_NODE, first, first + PORTS_PER_NODE + 1, host=node_ip)
        except HpcrlhfError:
            raise HpcrlhfError(f"ports {first}-{first + PORTS_PER_NODE - 1} on {alloc.hosts[0]} are in use (another "
                               f"job with id = {alloc.job_id} mod {PORT_SLOTS}?): resubmit the job") from None
        return ports
    return RayPorts.from_base(free_port_block(PORTS_PER_NODE, first, 65535 - PORTS_PER_NODE, host=node_ip))


def start_node(alloc: Allocation, node_index: int) -> subprocess.Popen:
    """`ray start --block` for this host as node `node_index` of the allocation, in its own session,
    with SIGUSR1/SIGUSR2 ignored by every Ray process (inherited through exec)."""
    node_ip = node_addresses([socket.gethostname()])[0]
    ports = node_ports(alloc, node_index, node_ip)
    head = None if node_index == 0 else head_address(alloc)
    if head is not None:
        wait_for_head(head)
    args = ray_start_args(node_ip=node_ip, ports=ports, head_address=head, num_cpus=alloc.cpus_per_node,
                          num_gpus=alloc.gpus_per_node, block=True,
                          temp_dir=private_temp_dir(Path(f"/tmp/hpcrlhf-{alloc.job_id}-{node_index}")))
    args[0] = ray_executable()
    print(f"hpcrlhf: Ray {'head' if head is None else 'worker'} on {socket.gethostname()} ({node_ip}), "
          f"ports {ports.gcs}-{ports.max_worker}", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a node starts its own, never joins another
    env.update(RAY_USAGE_STATS_ENABLED="0", **ports.env())
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in RAY_IGNORED}
    try:
        return subprocess.Popen(args, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def stop_node(proc: subprocess.Popen) -> None:
    stop_process_groups([proc.pid], timeout_s=10)


def run_node(alloc: Allocation | None = None, *, poll_s: float = 2.0) -> int:
    """Run this host's Ray node until SIGTERM/SIGINT, or (a worker) until the head has gone."""
    alloc = alloc or Allocation.from_env()
    index = int(os.environ["SLURM_NODEID"]) if "SLURM_NODEID" in os.environ else alloc.hosts.index(socket.gethostname())
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    for sig in RAY_IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    proc = start_node(alloc, index)
    head, missed = head_address(alloc), 0
    try:
        while not stopping and proc.poll() is None:
            time.sleep(poll_s)
            if index > 0:
                missed = 0 if _port_open(head) else missed + 1
                if missed >= 3:
                    print(f"hpcrlhf: the Ray head at {head} has gone; stopping this node", flush=True)
                    return 0  # (the head's own node says why)
    finally:
        stop_node(proc)
    if stopping:
        return 0
    # its Ray processes ended by themselves: a failure of this task, so srun ends the nodes' step and the script the job
    print(f"hpcrlhf: the Ray node on {socket.gethostname()} (node {index}) ended by itself (status {proc.returncode}): "
          "the job has lost it", flush=True)
    return proc.returncode or 1


def prepare_driver(argv: Sequence[str], alloc: Allocation | None = None) -> dict[str, str]:
    """Check the job against the allocation, wait until every node has joined the Ray cluster, and
    return the environment the `hpcrlhf` command needs to use it (RAY_ADDRESS, node order)."""
    import ray

    alloc = alloc or Allocation.from_env()
    check_fits(argv, alloc.nodes, alloc.gpus_per_node, launcher="ray", where=f"the allocation of job {alloc.job_id}",
               cpus_per_node=alloc.cpus_per_node)
    address, ips = head_address(alloc), node_addresses(alloc.hosts)
    wait_for_head(address)
    ray.init(address=address, log_to_driver=False)
    try:
        wait_for_nodes(ips, JOIN_TIMEOUT_S)
    finally:
        ray.shutdown()
    print(f"hpcrlhf: all {len(ips)} Ray node(s) joined: {', '.join(ips)}", flush=True)
    return {"RAY_ADDRESS": address, "HPCRLHF_NODE_IPS": ",".join(ips)}


def run_driver(argv: Sequence[str]) -> int:
    catch_early_stop_signals()
    os.environ.update(prepare_driver(argv))
    return run_module(CLI, argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m hpcrlhf.hpc.ray_slurm {node | driver HPCRLHF_ARGS}"
    if not argv or argv[0] not in ("node", "driver"):
        print(usage, file=sys.stderr)
        return 2
    try:
        if argv[0] == "node":
            return run_node()
        return run_driver(argv[1:])
    except HpcrlhfError as e:
        print(f"hpcrlhf: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
