"""The node map made real on a Ray cluster: node i of the map is a named Ray node, and GPU g of
node i is bundle g of that node's placement group.

One placement group per node, each bundle pinned to its node by the node's `node:<ip>` resource
(after the GPU bundles, one bundle of CPUs for each reward server the map puts on the node's cores),
so Ray can never hand out bundles in an order that splits a TP group or swaps two nodes: the map
stays the single source of truth. Ray's GPU accounting still reserves the devices (other jobs
cannot take them), but Ray does not choose device numbers: a worker sees exactly the GPUs the map
gives it through CUDA_VISIBLE_DEVICES (Ray's own setting of it is switched off).
"""

from __future__ import annotations

import ipaddress
import os
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

from hpcrlhf.errors import PlacementError
from hpcrlhf.placement import Device, NodeMap
from hpcrlhf.run.usercode import load_named

NODE_PIN = 0.001
"""Amount of a node's `node:<ip>` resource a bundle asks for: pins the bundle to that node."""


@dataclass(frozen=True)
class RayNode:
    node_id: str
    ip: str
    gpus: float
    is_head: bool
    hostname: str = ""
    cpus: float = 0.0

    def describe(self, index: int) -> str:
        return f"node {index} ({self.hostname}, {self.ip})" if self.hostname else f"node {index} ({self.ip})"


def live_nodes() -> list[RayNode]:
    import ray

    return [RayNode(n["NodeID"], n["NodeManagerAddress"], n["Resources"].get("GPU", 0.0),
                    "node:__internal_head__" in n["Resources"], n.get("NodeManagerHostname", ""),
                    n["Resources"].get("CPU", 0.0))
            for n in ray.nodes() if n.get("Alive")]


def dead_node_ids() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}


def order_nodes(nodes: Sequence[RayNode], node_ips: Sequence[str] | None = None) -> list[RayNode]:
    """Ray nodes in node-map order: as `node_ips` lists them (the allocation's host order), else the
    head first and then by address."""
    if node_ips is None:
        return sorted(nodes, key=lambda n: (not n.is_head, ipaddress.ip_address(n.ip)))
    by_ip = {n.ip: n for n in nodes}
    return [by_ip[ip] for ip in node_ips if ip in by_ip]


def check_cluster(node_map: NodeMap, nodes: Sequence[RayNode], node_ips: Sequence[str] | None = None) -> None:
    """The Ray cluster must have the map's node count, each node at least the map's GPUs."""
    problems = []
    if node_ips is not None:
        missing = [ip for ip in node_ips if ip not in {n.ip for n in nodes}]
        if missing:
            problems.append(f"Ray nodes expected but not in the cluster: {', '.join(missing)}")
    if len(nodes) < node_map.nodes:
        problems.append(f"the node map needs {node_map.nodes} nodes but the Ray cluster has {len(nodes)} "
                        f"({', '.join(n.ip for n in nodes) or 'none'}): start the missing nodes or plan with "
                        f"--nodes {len(nodes)}")
    for i, n in enumerate(nodes[:node_map.nodes]):
        if n.gpus < node_map.gpus_per_node:
            problems.append(f"node {i} ({n.ip}) has {n.gpus:g} GPUs but the node map puts {node_map.gpus_per_node} "
                            f"on every node: plan with --gpus-per-node {int(n.gpus)}")
        on_cores = [s for s in node_map.reward_servers if s.device is None and s.node == i]
        if sum(s.cpus for s in on_cores) > n.cpus:
            problems.append(f"node {i} ({n.ip}) has {n.cpus:g} CPUs but the node map runs {len(on_cores)} reward "
                            f"server(s) of placement.reward_server.cpus={on_cores[0].cpus} there: fewer servers "
                            f"(reward.sources[].servers) or fewer CPUs each")
    if problems:
        raise PlacementError("the Ray cluster does not match the node map:\n" + "\n".join(f"- {p}" for p in problems))


WORKER_SETUP = "HPCRLHF_WORKER_SETUP"
"""Environment variable: `package.module:function` that every Ray worker of a job calls with itself once its
role and rank are set (`RoleWorker`), before it builds anything -- profilers, extra logging, the tests' fault
injection. The driver's variables named HPCRLHF_WORKER_* reach the workers (`worker_env`)."""


def worker_env() -> dict[str, str]:
    """The driver's HPCRLHF_WORKER_* variables, for every worker's environment; a WORKER_SETUP that
    does not import is a ConfigError here, in the driver (`reserve` calls it before it holds anything)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("HPCRLHF_WORKER_")}
    if env.get(WORKER_SETUP):
        load_named(env[WORKER_SETUP], f"{WORKER_SETUP}={env[WORKER_SETUP]!r}", "function")
    return env


@dataclass
class Reservation:
    """The devices of a node map held on a Ray cluster; `actor_options` places a worker on one."""

    node_map: NodeMap
    nodes: list[RayNode]
    """Ray node of each map node."""
    groups: list[Any]
    """One placement group per map node; bundle g is GPU g, then one bundle per reward server on its cores."""
    worker_vars: dict[str, str] = field(default_factory=dict)
    """The driver's HPCRLHF_WORKER_* variables (`worker_env`, checked once by `reserve`): in every worker's environment."""

    def actor_options(self, devices: Sequence[Device], *, env: dict[str, str] | None = None) -> dict[str, Any]:
        """`.options(...)` for a Ray actor on `devices` (one GPU, or a vLLM engine's TP group): it
        runs in the first device's bundle with that device's share (1 / occupants), and sees
        exactly `devices` as its GPUs."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        first = devices[0]
        if any(d.node != first.node for d in devices):
            raise PlacementError(f"devices {list(devices)} span several nodes; one worker runs on one node")
        share = 1.0 / len(self.node_map.devices[first])
        visible = ",".join(str(d.gpu) for d in devices)
        return {
            "num_cpus": 0,
            "num_gpus": share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.groups[first.node], first.gpu),
            "runtime_env": {"env_vars": {**self.worker_vars, **(env or {}), "CUDA_VISIBLE_DEVICES": visible,
                                         "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
        }

    def cpu_slot_options(self, server: int, *, env: dict[str, str] | None = None) -> dict[str, Any]:
        """`.options(...)` for reward server `server` of the map on its node's CPU cores: its own bundle
        of `placement.reward_server.cpus` CPUs, and no GPU."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        plan = self.node_map.reward_servers[server]
        if plan.device is not None:
            raise PlacementError(f"reward server {server} runs on {plan.device}, not on CPU cores")
        return {"num_cpus": plan.cpus, "num_gpus": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.groups[plan.node], cpu_bundle(self.node_map,
                                                                                                           server)),
                "runtime_env": {"env_vars": {**self.worker_vars, **(env or {}), "CUDA_VISIBLE_DEVICES": "",
                                             "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}}

    def ip_of(self, device: Device) -> str:
        return self.nodes[device.node].ip

    def lost_nodes(self, wait_s: float = 0.0, *, poll_s: float = 1.0) -> list[int]:
        """Map indices of the nodes Ray has declared dead; with `wait_s`, wait up to that long for
        its health checks (hpcrlhf.cluster.bootstrap.HEALTH_CHECKS) to declare one."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = dead_node_ids()
            lost = [i for i, n in enumerate(self.nodes) if n.node_id in dead]
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(poll_s)

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            remove_placement_group(group)
        self.groups = []


def cpu_bundle(node_map: NodeMap, server: int) -> int:
    """The bundle of reward server `server` (on CPU cores) in its node's placement group: after the GPUs'."""
    plan = node_map.reward_servers[server]
    before = [s for s in node_map.reward_servers[:server] if s.device is None and s.node == plan.node]
    return node_map.gpus_per_node + len(before)


def reserve(node_map: NodeMap, node_ips: Sequence[str] | None = None, timeout_s: float = 60.0) -> Reservation:
    """Hold every GPU of `node_map` on the connected Ray cluster (all nodes or none); a worker setup hook
    that does not import fails here, before anything is held."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    worker_vars = worker_env()
    nodes = order_nodes(live_nodes(), node_ips)
    check_cluster(node_map, nodes, node_ips)
    nodes = nodes[:node_map.nodes]
    cores = {i: [s.cpus for s in node_map.reward_servers if s.device is None and s.node == i] for i in range(len(nodes))}
    groups = [placement_group([{"GPU": 1.0, f"node:{n.ip}": NODE_PIN} for _ in range(node_map.gpus_per_node)]
                              + [{"CPU": float(c), f"node:{n.ip}": NODE_PIN} for c in cores[i]],
                              strategy="STRICT_PACK", name=f"hpcrlhf-node{i}") for i, n in enumerate(nodes)]
    refs = [g.ready() for g in groups]
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        stuck = [f"node {i} ({nodes[i].ip})" for i, ref in enumerate(refs) if ref in pending]
        for g in groups:
            remove_placement_group(g)
        raise PlacementError(f"could not reserve the node map's GPUs within {timeout_s:.0f} s on "
                             f"{', '.join(stuck) or 'some nodes'}: are other jobs holding GPUs there?")
    return Reservation(node_map, nodes, groups, worker_vars)
