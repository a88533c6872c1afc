"""The Slurm allocation a job runs in, and the check that a job fits it before anything starts.

    python -m hpcrlhf.hpc.allocation {ray|mpi} <hpcrlhf args>   # first line of every job script

`Allocation.from_env()` reads what Slurm gives every job (its id, hosts in allocation order, GPUs
and CPUs per node, how many times it was requeued). `check_fits` compares a job with it: a PPO
job's node map must fit the allocation's nodes x GPUs, an MPI job must not run more ranks on a
node than it has GPUs. The same check runs before submission against the requested shape
(`hpcrlhf sbatch/submit`) and inside the job against the real allocation, before the Ray nodes or
the driver start, so a wrong shape costs seconds and says why in the job log.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import sys
from dataclasses import dataclass
from collections.abc import Mapping, Sequence

from hpcrlhf.bench.runner import bench_fits
from hpcrlhf.config.jobspec import BenchJob, job_from_argv
from hpcrlhf.errors import ConfigError, HpcrlhfError, PlacementError
from hpcrlhf.placement import build_node_map
from hpcrlhf.placement.nodemap import cpu_problem


@dataclass(frozen=True)
class Allocation:
    job_id: int
    hosts: tuple[str, ...]
    """Host names in allocation order (`scontrol show hostnames`): node 0 of the node map is hosts[0]."""
    gpus_per_node: int
    cpus_per_node: int
    tasks_per_node: int = 1
    restart_count: int = 0

    @property
    def nodes(self) -> int:
        return len(self.hosts)

    def shape(self) -> str:
        return f"{self.nodes} node(s) x {self.gpus_per_node} GPU(s)"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None,
                 hostnames: Sequence[str] | None = None) -> Allocation:
        """The allocation of the Slurm job this process runs in (raises ConfigError outside one)."""
        env = os.environ if env is None else env
        if "SLURM_JOB_ID" not in env:
            raise ConfigError("not inside a Slurm job (no SLURM_JOB_ID): submit the script with sbatch, "
                              "or run `hpcrlhf train` directly on this machine")
        if hostnames is None:
            hostnames = expand_hostnames(env.get("SLURM_JOB_NODELIST", socket.gethostname()))
        gpus = env.get("SLURM_GPUS_ON_NODE")
        if gpus is None:
            visible = env.get("CUDA_VISIBLE_DEVICES", "")
            gpus = str(len([d for d in visible.split(",") if d.strip()]))
        tasks = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1").split("(")[0]
        return cls(job_id=int(env["SLURM_JOB_ID"]), hosts=tuple(hostnames), gpus_per_node=int(gpus),
                   cpus_per_node=int(env.get("SLURM_CPUS_ON_NODE", os.cpu_count() or 1)),
                   tasks_per_node=int(tasks), restart_count=int(env.get("SLURM_RESTART_COUNT", "0")))


def expand_hostnames(nodelist: str) -> list[str]:
    """Slurm's compressed node list as host names, in order: `n[1-3,07]` -> n1 n2 n3 n07,
    `a[1-2]b[3-4]` -> a1b3 a1b4 a2b3 a2b4 (zero padding from the lower bound). What `scontrol show
    hostnames` prints, computed here because the job's steps may run inside a container without
    Slurm's tools."""
    def bad(why: str) -> ConfigError:
        return ConfigError(f"SLURM_JOB_NODELIST {nodelist!r} cannot be read: {why}")

    entries, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise bad("unbalanced brackets")
        if ch == "," and depth == 0:
            entries.append(nodelist[start:i].strip())
            start = i + 1
    if depth:
        raise bad("unbalanced brackets")
    hosts: list[str] = []
    for entry in filter(None, entries):
        choices = [_bracket_values(part[1:-1], bad) if part.startswith("[") else [part]
                   for part in filter(None, re.split(r"(\[[^\]]*\])", entry))]
        hosts += ["".join(c) for c in itertools.product(*choices)]
    if not hosts:
        raise bad("no host names")
    return hosts


def _bracket_values(ranges: str, bad) -> list[str]:
    """`1-3,07` -> 1 2 3 07: the values of one bracket of a Slurm node list."""
    values = []
    for item in ranges.split(","):
        lo, _, hi = item.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise bad(f"range {item!r} is not N or N-M")
        values += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi or lo) + 1)]
    return values


def node_addresses(hosts: Sequence[str]) -> list[str]:
    """The address each host resolves to (what its Ray node and torch.distributed bind to)."""
    return [socket.gethostbyname(h) for h in hosts]


def check_fits(args: Sequence[str], nodes: int, gpus_per_node: int, *, launcher: str, where: str,
               cpus_per_node: int | None = None, cpus_from: str = "the allocation") -> None:
    """Raise unless the job `hpcrlhf <args>` fits `nodes` x `gpus_per_node` (and, when known,
    `cpus_per_node` CPU cores, as `cpus_from` says: the job's rule servers take theirs) under `launcher`.

    `where` names what is checked against ("the allocation of job 42", "--nodes/--gpus-per-node")."""
    job = job_from_argv(args)
    if isinstance(job, BenchJob):
        return bench_fits(job, nodes, gpus_per_node, where)
    kind, cfg = job.kind, job.config()
    if kind == "eval" and launcher == "ray":
        raise ConfigError("launcher ray: an eval job runs as ranks of its own; use --launcher mpi (one rank per GPU)")
    if launcher == "ray":
        node_map = build_node_map(cfg)  # the map the driver will use: a bad recipe fails here
        if node_map.nodes > nodes or node_map.gpus_per_node > gpus_per_node:
            raise PlacementError(
                f"the node map needs {node_map.nodes} node(s) x {node_map.gpus_per_node} GPU(s) "
                f"(placement.nodes / placement.gpus_per_node) but {where} has {nodes} node(s) x "
                f"{gpus_per_node} GPU(s): ask for --nodes {node_map.nodes} --gpus-per-node "
                f"{node_map.gpus_per_node}, or re-plan the recipe with `hpcrlhf plan RECIPE --nodes {nodes} "
                f"--gpus-per-node {gpus_per_node}`")
        short = node_map.cpu_shortfall(cpus_per_node) if cpus_per_node is not None else None
        if short is not None:
            raise PlacementError(f"{cpu_problem(*short, cpus_per_node, cpus_from)}")
    elif kind == "ppo" and cfg.placement.runtime == "ray":
        raise ConfigError("launcher mpi: this PPO recipe says placement.runtime=ray; use --launcher ray "
                          "(or --set placement.runtime=local for single-process-group PPO)")


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 when `hpcrlhf <args>` fits this job's allocation under the launcher, else 2 with why."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("ray", "mpi"):
        print("usage: python -m hpcrlhf.hpc.allocation {ray|mpi} HPCRLHF_ARGS", file=sys.stderr)
        return 2
    try:
        alloc = Allocation.from_env()
        check_fits(argv[1:], alloc.nodes, alloc.gpus_per_node, launcher=argv[0],
                   where=f"the allocation of job {alloc.job_id}")
    except HpcrlhfError as e:
        print(f"hpcrlhf: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"hpcrlhf: the job fits the allocation ({alloc.shape()})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
