"""Where the job's own reward servers run (`reward.sources[i].servers`): pure planning, no Ray.

Servers are numbered over the sources in order, each source's replicas together. A reward model's
server holds the model on one GPU (`layout.assign` gives it one, colocated or of its own); a rule's
server takes `placement.reward_server.cpus` CPU cores of a node the roles already use, server j of
the rule servers on node j mod (nodes used), so a server never turns an idle node into a used one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpcrlhf.config.schema import PPOConfig, source_name
from hpcrlhf.engines.store_ports import MAX_SERVERS_PER_NODE
from hpcrlhf.placement.layout import Device, plural
from hpcrlhf.placement.memory import MemoryParts, frozen_memory
from hpcrlhf.placement.problems import Problem
from hpcrlhf.placement.shapes import ModelShape


@dataclass(frozen=True)
class ServerPlan:
    """One reward server of the job: what it serves and where."""

    index: int
    """Its number among the job's servers (`reward_server<index>`)."""
    source: int
    """The reward.sources entry it serves."""
    name: str
    """That source's metric name (`reward/<name>`): the job's servers keep the source's name."""
    replica: int
    """Which of the source's `servers` it is."""
    kind: Literal["model", "rule"]
    node: int
    device: Device | None
    """The GPU of a reward model's server (None: a rule's server, on CPU cores)."""
    cpus: int
    """CPU cores reserved for a rule's server (0 for a model's: it has its GPU)."""
    model: str | None
    params: int
    """Parameters of the served model (as a value model), 0 for a rule."""
    memory: MemoryParts | None
    """What a model's server holds on its GPU (None: a rule, or a model of unknown shape)."""

    @property
    def label(self) -> str:
        return f"reward_server{self.index}"

    @property
    def where(self) -> str:
        """`node 0 gpu 1`, `node 1 CPU slot`."""
        return str(self.device) if self.device else f"node {self.node} CPU slot"


def gpu_servers(cfg: PPOConfig) -> int:
    """How many of the job's servers serve reward models (each takes one GPU)."""
    return sum(src.servers for _, src in cfg.served_sources() if src.model)


def plan_servers(cfg: PPOConfig, gpus: tuple[Device, ...], used_nodes: int,
                 shapes: dict[str, ModelShape | None]) -> tuple[ServerPlan, ...]:
    """Every server of the job in order: model servers on `gpus` (from `layout.assign`, in model-server
    order), rule servers round-robin over nodes 0 .. used_nodes - 1; `shapes` maps each served model's
    path to its shape (None: unknown, already a problem)."""
    plans, model_k, rule_k = [], 0, 0
    wanted = [(i, src, replica) for i, src in cfg.served_sources() for replica in range(src.servers)]
    for index, (i, src, replica) in enumerate(wanted):
        if src.model:
            model_k += 1
            if model_k > len(gpus):  # not placed: the layout reported it
                continue
            device, shape = gpus[model_k - 1], shapes.get(src.model)
            params = shape.value_model_params if shape else 0
            memory = frozen_memory(params, ranks=1, zero_stage=0, precision=cfg.engine.precision,
                                   offload_params=False) if shape else None
            plans.append(ServerPlan(index, i, source_name(i, src), replica, "model", device.node, device, 0,
                                    src.model, params, memory))
        else:
            plans.append(ServerPlan(index, i, source_name(i, src), replica, "rule", rule_k % max(used_nodes, 1), None,
                                    cfg.placement.reward_server.cpus, None, 0, None))
            rule_k += 1
    return tuple(plans)


def port_problems(servers: tuple[ServerPlan, ...], used_nodes: int) -> list[Problem]:
    """A node with more servers than its share of the job's port block holds (MAX_SERVERS_PER_NODE)."""
    count: dict[int, int] = {}
    for server in servers:
        count[server.node] = count.get(server.node, 0) + 1
    crowded = {node: n for node, n in count.items() if n > MAX_SERVERS_PER_NODE}
    if not crowded:
        return []
    node, n = min(crowded.items())
    more = f" (and {len(crowded) - 1} more nodes)" if len(crowded) > 1 else ""
    room = MAX_SERVERS_PER_NODE * used_nodes
    return [Problem("reward.sources[].servers", plural(len(servers), "server"),
                    f"node {node} would run {n} reward servers{more}, but a node listens for at most "
                    f"{MAX_SERVERS_PER_NODE} (its share of the job's port block)",
                    f"use at most {room} servers on these {plural(used_nodes, 'node')}, or spread model servers "
                    "over more GPUs' nodes")]
