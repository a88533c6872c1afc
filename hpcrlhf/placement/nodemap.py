"""The static node map of a PPO job: which GPU of the allocation runs what, computed once.

`build_node_map(cfg)` resolves the roles (models, effective DeepSpeed settings, memory per
rank), places them on the allocation (`layout`), checks the result against the config and every
GPU's memory, and returns a `NodeMap`, or raises one `PlacementError` listing every problem with
its fix. Nothing is adjusted to make a layout fit. The runtime places its Ray actors exactly as
the map says: `role_ranks(role)` gives rank r's device, `engines` each vLLM engine's TP group.
`hpcrlhf plan` prints it as text (`render.render_text`) or JSON (`to_json()`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from hpcrlhf.algos.estimators import ESTIMATORS
from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.placement.layout import (MODEL_ROLES, Device, Layout, allocation_problems, assign, idle_problem, plural,
                                      shape_text)
from hpcrlhf.placement.memory import GIB, PHASES, MemoryParts, phase_parts
from hpcrlhf.placement.problems import Problem, raise_problems
from hpcrlhf.placement.roles import EnginePlan, RolePlan, check_batches, check_roles, resolve_roles
from hpcrlhf.placement.servers import ServerPlan, gpu_servers, plan_servers, port_problems

__all__ = ["Device", "NodeMap", "Occupant", "ServerPlan", "build_node_map"]


@dataclass(frozen=True)
class Occupant:
    """A role rank (or one TP rank of a vLLM engine, or a reward model's server) on a GPU."""

    role: str
    """actor, critic, ref, reward, vllm or reward_server."""
    rank: int
    """Rank within the role; for vllm the engine's index, for reward_server the server's."""
    tp_rank: int | None = None
    tp_size: int | None = None

    @property
    def label(self) -> str:
        """`actor[0]`, `vllm0 tp1/2`."""
        if self.role == "vllm":
            return f"vllm{self.rank} tp{self.tp_rank}/{self.tp_size}"
        if self.role == "reward_server":
            return f"reward_server{self.rank}"
        return f"{self.role}[{self.rank}]"


@dataclass(frozen=True)
class _GpuMemory:
    """What one GPU holds, by part: in each phase of a step, every occupant's most, and the largest phase."""

    phases: dict[str, MemoryParts]
    most: MemoryParts
    peak: tuple[str, MemoryParts]


@dataclass(frozen=True)
class NodeMap:
    """Roles on the GPUs of an allocation of `nodes` x `gpus_per_node`, and what each GPU holds."""

    nodes: int
    gpus_per_node: int
    gpu_memory: int
    """Bytes of one GPU."""
    roles: dict[str, RolePlan]
    """The DeepSpeed roles that have GPUs, with their effective settings and memory per rank."""
    vllm: EnginePlan | None
    """The vLLM engines (None without engines)."""
    ranks: dict[str, tuple[Device, ...]]
    """Role -> the device of each rank, in rank order (node-major)."""
    engines: tuple[tuple[Device, ...], ...]
    """Each vLLM engine's devices, in TP-rank order (all on one node)."""
    colocated: tuple[tuple[str, ...], ...]
    """Groups of roles that share exactly the same GPUs."""
    devices: dict[Device, tuple[Occupant, ...]]
    """Every GPU of the nodes anything runs on (node, then GPU order) -> what runs on it (empty: idle)."""
    idle_nodes: int = 0
    """The allocation's last nodes, on which nothing runs: counted, not listed in `devices`."""
    estimator: str = "gae"
    """ppo.advantage_estimator: what it needs (hpcrlhf.algos.estimators) decides the roles."""
    samples_per_prompt: int = 1
    reward_servers: tuple[ServerPlan, ...] = ()
    """The job's own reward servers (`reward.sources[i].servers`), in server order."""
    env_workers: int = 0
    """Agent environment threads beside each vLLM engine, on its node (`agent.env_workers`; 0: no agent)."""
    cpus_per_node: int | None = None
    """CPU cores of one node (`placement.cpus_per_node`), when known: the CPU work is checked against them."""
    _by_roles: dict[tuple[str, ...], _GpuMemory] = field(default_factory=dict, init=False, repr=False,
                                                           compare=False)
    """What a GPU holds depends only on which roles it holds: each set of roles is summed once, not once per
    GPU of a map of 100,000 engines."""
    _cpu_work: dict[int, list[tuple[str, int]]] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Each node's CPU work (`cpu_work`), worked out for every node at once (key -1: done)."""

    def role_ranks(self, role: str) -> list[Device]:
        """The device of each rank of `role` (empty for a role without GPUs)."""
        if role not in MODEL_ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(MODEL_ROLES)} (vLLM: NodeMap.engines)")
        return list(self.ranks.get(role, ()))

    def cpu_work(self, node: int) -> list[tuple[str, int]]:
        """What the map runs on `node`'s CPU cores, (what, cores) each: its rule servers, then the
        agent environments' threads of its vLLM engines (a thread counted as a core)."""
        if not self._cpu_work:  # every node's at once: one pass over the servers and engines
            on: dict[int, list[tuple[str, int]]] = {}
            for s in self.reward_servers:
                if s.device is None:
                    on.setdefault(s.node, []).append((s.label, s.cpus))
            engines: dict[int, int] = {}
            for group in self.engines:
                engines[group[0].node] = engines.get(group[0].node, 0) + 1
            if self.env_workers:
                for n, count in engines.items():
                    on.setdefault(n, []).append((f"environments ({plural(count, 'engine')} x "
                                                 f"{plural(self.env_workers, 'thread')})", count * self.env_workers))
            self._cpu_work.update(on)
            self._cpu_work[-1] = []  # computed (a map with no CPU work at all too)
        return list(self._cpu_work.get(node, []))

    def cpu_shortfall(self, cpus_per_node: int) -> tuple[int, list[tuple[str, int]]] | None:
        """(node, its CPU work) of the first node whose CPU work claims more than `cpus_per_node` cores."""
        works = ((node, self.cpu_work(node)) for node in range(self.nodes - self.idle_nodes))
        return next(((node, work) for node, work in works if sum(c for _, c in work) > cpus_per_node), None)

    def occupant_memory(self, occupant: Occupant) -> MemoryParts | None:
        """What one occupant holds on its GPU (None when a model's shape is unknown)."""
        if occupant.role == "vllm":
            return self.vllm.memory.parts if self.vllm and self.vllm.memory else None
        if occupant.role == "reward_server":
            return self.reward_servers[occupant.rank].memory
        return self.roles[occupant.role].memory

    def memory(self, device: Device) -> MemoryParts:
        """What `device` holds, summed over its occupants, by part (every phase's most)."""
        return self._memory(device).most

    def phase_memory(self, device: Device) -> dict[str, MemoryParts]:
        """What `device` holds in each phase of a step (`memory.PHASES`), by part."""
        return dict(self._memory(device).phases)

    def peak(self, device: Device) -> tuple[str, MemoryParts]:
        """The phase in which `device` holds the most, and what it holds then."""
        return self._memory(device).peak

    def _memory(self, device: Device) -> _GpuMemory:
        """What a GPU holding `device`'s occupant roles holds, worked out once per set of roles (a
        reward server counts by its number: servers may serve different models)."""
        key = tuple(o.label if o.role == "reward_server" else o.role for o in self.devices[device])
        if key not in self._by_roles:
            # every rank of a role holds the same
            occupants = [o if o.role == "reward_server" else Occupant(o.role, 0) for o in self.devices[device]]
            held = [(self.occupant_memory(o) or MemoryParts(), self._kind(o), self._sleeps(o)) for o in occupants]
            phases = {phase: sum((phase_parts(parts, kind=kind, sleeps=sleeps, phase=phase)
                                  for parts, kind, sleeps in held), MemoryParts()) for phase in PHASES}
            self._by_roles[key] = _GpuMemory(phases, sum((parts for parts, _, _ in held), MemoryParts()),
                                             max(phases.items(), key=lambda item: item[1].total))
        return self._by_roles[key]

    def sleeps(self, device: Device) -> bool:
        """Whether an occupant of `device` frees its memory between phases."""
        return any(self._sleeps(o) for o in self.devices[device])

    def _kind(self, occupant: Occupant) -> str:
        if occupant.role in ("vllm", "reward_server"):
            return "engine" if occupant.role == "vllm" else "frozen"
        return "trained" if self.roles[occupant.role].trainable else "frozen"

    def _sleeps(self, occupant: Occupant) -> bool:
        if occupant.role in ("vllm", "reward_server"):  # a server answers whenever asked: it never sleeps
            return occupant.role == "vllm" and bool(self.vllm and self.vllm.sleep)
        return self.roles[occupant.role].sleep

    def to_json(self) -> str:
        """The map as JSON of plain types with sorted keys (stable for tools and golden files)."""
        return json.dumps(_plain(self), indent=2, sort_keys=True) + "\n"


def _device(d: Device) -> dict[str, int]:
    return {"node": d.node, "gpu": d.gpu}


def _plain(m: NodeMap) -> dict[str, Any]:
    roles = {name: {"models": list(r.models), "params": r.params, "nodes": r.nodes, "gpus_per_node": r.gpus_per_node,
                    "trainable": r.trainable, "zero_stage": r.zero_stage, "offload_optimizer": r.offload_optimizer,
                    "offload_params": r.offload_params, "sleep": r.sleep, "memory_per_rank": r.memory.as_dict() if r.memory else None,
                    "ranks": [_device(d) for d in m.ranks.get(name, ())]} for name, r in m.roles.items()}
    vllm = None
    if m.vllm:
        e = m.vllm
        vllm = {"model": e.model, "params": e.params, "tensor_parallel_size": e.tensor_parallel_size,
                "gpu_memory_utilization": e.gpu_memory_utilization, "sleep": e.sleep,
                "memory_per_gpu": e.memory.parts.as_dict() if e.memory else None,
                "engines": [{"devices": [_device(d) for d in group],
                             "kv_cache_tokens": e.memory.kv_cache_tokens if e.memory else None} for group in m.engines]}
    devices = [{**_device(d), "occupants": [o.label for o in occ],
                "memory": {**m.memory(d).as_dict(), "total": m.memory(d).total},
                "memory_by_phase": {phase: parts.total for phase, parts in m.phase_memory(d).items()}}
               for d, occ in m.devices.items()]
    works = ((node, m.cpu_work(node)) for node in range(m.nodes - m.idle_nodes))
    cpu_work = [{"node": node, "work": [{"what": what, "cpus": cpus} for what, cpus in work]} for node, work in works if work]
    return {"allocation": {"nodes": m.nodes, "gpus_per_node": m.gpus_per_node, "gpu_memory_bytes": m.gpu_memory,
                           "cpus_per_node": m.cpus_per_node},
            "cpu_work": cpu_work, "env_workers_per_engine": m.env_workers,
            "roles": roles, "vllm": vllm, "colocated": [list(g) for g in m.colocated], "devices": devices,
            "idle_nodes": m.idle_nodes, "reward_servers": [_server_json(s) for s in m.reward_servers],
            "estimator": {**dataclasses.asdict(ESTIMATORS[m.estimator]), "samples_per_prompt": m.samples_per_prompt}}


def _server_json(s: ServerPlan) -> dict[str, Any]:
    return {"server": s.index, "source": s.source, "name": s.name, "replica": s.replica, "kind": s.kind, "node": s.node,
            "device": _device(s.device) if s.device else None, "cpus": s.cpus, "model": s.model, "params": s.params,
            "memory": s.memory.as_dict() if s.memory else None}


def _occupants(layout: Layout, gpus_per_node: int, tp: int,
               servers: tuple[ServerPlan, ...]) -> dict[Device, tuple[Occupant, ...]]:
    seats: dict[Device, list[Occupant]] = {Device(n, g): [] for n in range(layout.used_nodes)
                                           for g in range(gpus_per_node)}
    for role in MODEL_ROLES:
        for rank, d in enumerate(layout.ranks.get(role, ())):
            seats[d].append(Occupant(role, rank))
    for e, group in enumerate(layout.engines):
        for t, d in enumerate(group):
            seats[d].append(Occupant("vllm", e, t, tp))
    for server in servers:
        if server.device:
            seats[server.device].append(Occupant("reward_server", server.index))
    return {d: tuple(occ) for d, occ in seats.items()}


def build_node_map(cfg: PPOConfig, nodes: int | None = None, gpus_per_node: int | None = None,
                   cpus_per_node: int | None = None) -> NodeMap:
    """Place `cfg`'s roles on its `placement` allocation, or on `nodes` x `gpus_per_node` (with
    `cpus_per_node` cores each) when given (`hpcrlhf plan --nodes/--gpus-per-node/--cpus-per-node`).
    Raises PlacementError listing every problem."""
    p = cfg.placement
    nodes = p.nodes if nodes is None else nodes
    gpus_per_node = p.gpus_per_node if gpus_per_node is None else gpus_per_node
    cpus_per_node = p.cpus_per_node if cpus_per_node is None else cpus_per_node
    where = shape_text(nodes, gpus_per_node)
    shape = allocation_problems(nodes, gpus_per_node, ("placement.nodes", "placement.gpus_per_node"))
    if cpus_per_node is not None and cpus_per_node < 1:
        shape.append(Problem("placement.cpus_per_node", cpus_per_node, "a node needs at least one CPU core",
                             "give the CPU cores of one node, e.g. 64"))
    raise_problems(shape, where)
    gpu_memory = int(p.gpu_memory_gb * GIB)
    problems: list[Problem] = []
    check_roles(cfg, problems)
    roles, engine, served = resolve_roles(cfg, gpu_memory, problems)
    check_batches(cfg, roles, problems)
    shapes = {r: (getattr(p, r).nodes, getattr(p, r).gpus_per_node) for r in MODEL_ROLES}
    tp = p.vllm.tensor_parallel_size
    layout = assign(nodes, gpus_per_node, shapes, p.vllm.engines, tp, p.colocate, problems, gpu_servers(cfg))
    servers = plan_servers(cfg, layout.servers, layout.used_nodes, served)
    problems += port_problems(servers, layout.used_nodes)
    if layout.complete and (layout.idle or layout.used_nodes < nodes) and not p.allow_idle_gpus:
        sequences = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
        problems.append(idle_problem(layout, nodes, gpus_per_node, p.vllm.engines, tp, sequences))
    node_map = NodeMap(nodes, gpus_per_node, gpu_memory, roles, engine, layout.ranks, layout.engines, layout.colocated,
                       _occupants(layout, gpus_per_node, tp, servers), nodes - layout.used_nodes,
                       cfg.ppo.advantage_estimator, cfg.rollout.samples_per_prompt, servers,
                       cfg.agent.env_workers if cfg.agent is not None else 0, cpus_per_node)
    _check_memory(node_map, cfg.engine.gradient_checkpointing, problems)
    _check_cpus(node_map, problems)
    raise_problems(problems, where)
    return node_map


def _check_cpus(m: NodeMap, problems: list[Problem]) -> None:
    """A node whose CPU work (rule servers, agent environments) claims more cores than it has."""
    short = m.cpu_shortfall(m.cpus_per_node) if m.cpus_per_node is not None else None
    if short is not None:
        problems.append(cpu_problem(*short, m.cpus_per_node, "placement.cpus_per_node"))


def cpu_problem(node: int, work: list[tuple[str, int]], cpus_per_node: int, field: str) -> Problem:
    """Node `node`'s CPU `work` claims more than its `cpus_per_node` cores (`field` says where that came from)."""
    claimed = ", ".join(f"{what}: {cpus}" for what, cpus in work)
    fixes = []
    if any(what.startswith("environments") for what, _ in work):
        fixes.append("fewer environment threads per engine (agent.env_workers)")
    if any(what.startswith("reward_server") for what, _ in work):
        fixes.append("fewer rule servers (reward.sources[].servers) or fewer CPUs each (placement.reward_server.cpus)")
    return Problem(field, cpus_per_node, f"node {node}'s CPU work ({claimed}) claims {sum(c for _, c in work)} "
                   f"CPU cores, more than its {cpus_per_node}",
                   "; ".join(["nodes with more CPU cores (Slurm: --cpus-per-gpu)", *fixes]))


# ---------------------------------------------------------------- the memory check
def _check_memory(m: NodeMap, checkpointing: bool, problems: list[Problem]) -> None:
    """Every GPU's occupants must fit its memory; GPUs over it with the same occupant roles are
    reported once (the first, and how many more)."""
    over: dict[tuple[str, ...], list[Device]] = {}
    for device, occupants in m.devices.items():
        if any(m.occupant_memory(o) is None for o in occupants):
            continue  # a model of unknown shape: already a problem
        if m.peak(device)[1].total > m.gpu_memory:
            over.setdefault(tuple(o.role for o in occupants), []).append(device)
    for roles, devices in over.items():
        first = devices[0]
        phase, parts = m.peak(first)
        detail = "; ".join(f"{o.label} {_parts_text(phase_parts(m.occupant_memory(o), kind=m._kind(o), sleeps=m._sleeps(o), phase=phase))}"
                           for o in m.devices[first])
        more = f" (and {len(devices) - 1} more GPUs with the same roles)" if len(devices) > 1 else ""
        when = f" {_PHASE_TEXT[phase]}" if m.sleeps(first) else ""
        fixes = "; ".join(_memory_fixes(m, roles, checkpointing))
        problems.append(Problem("placement.gpu_memory_gb", m.gpu_memory / GIB,
                                f"{first}{more} needs {parts.total / GIB:.1f} GiB{when}, more than its "
                                f"{m.gpu_memory / GIB:.1f} GiB: {detail}", fixes))


_PHASE_TEXT = {"generate": "while vLLM generates", "train": "while the roles train",
               "weight_sync": "during the weight sync"}


def _parts_text(parts: MemoryParts) -> str:
    """`weights 12.6 + optimizer 18.8 GiB`."""
    shown = [f"{name} {value / GIB:.1f}" for name, value in parts.as_dict().items() if value]
    return (" + ".join(shown) or "0.0") + " GiB"


def _memory_fixes(m: NodeMap, roles: tuple[str, ...], checkpointing: bool) -> list[str]:
    """What would shrink these roles' share of a GPU, most effective first."""
    tips = []
    if "vllm" in roles and m.vllm and len(roles) > 1:  # vLLM's claim is usually the largest share
        claim = f"{m.vllm.gpu_memory_utilization:g} x {m.gpu_memory / GIB:.1f} GiB"
        tips.append(f"a lower placement.vllm.gpu_memory_utilization (vLLM claims {claim} here)")
        sleepers = [f"placement.{r}.sleep=true" for r in dict.fromkeys(roles) if r in m.roles and m.roles[r].trainable
                    and not m.roles[r].sleep and not m.roles[r].offload_params]
        sleepers += [] if m.vllm.sleep else ["placement.vllm.sleep=true"]
        if sleepers:
            tips.append(f"{' and '.join(sleepers)} (vLLM and the trained roles take turns with the GPU memory; GPUs "
                        "only, with rollout.max_staleness=0)")
    for name in dict.fromkeys(r for r in roles if r in m.roles):
        plan, key = m.roles[name], f"placement.{name}"
        if plan.zero_stage < 3:
            tips.append(f"{key}.zero_stage=3 (shard its {'states' if plan.trainable else 'weights'} over its ranks)")
        if plan.trainable and not plan.offload_optimizer and plan.zero_stage >= 1:
            tips.append(f"{key}.offload_optimizer=true")
        if plan.zero_stage == 3 and not plan.offload_params:
            tips.append(f"{key}.offload_params=true")
        if plan.trainable and plan.memory and plan.memory.activations and not checkpointing:
            tips.append("engine.gradient_checkpointing=true (or a smaller train.micro_batch_size)")
    # More ranks shrink only what ZeRO shards: a trained role's states from stage 1, weights at 3.
    sharded = [r for r in dict.fromkeys(roles) if r in m.roles
               and (m.roles[r].zero_stage == 3 or (m.roles[r].trainable and m.roles[r].zero_stage >= 1))]
    if sharded:
        tips.append(f"more GPUs for {', '.join(sharded)} (placement.<role>.nodes / gpus_per_node)")
    if "reward_server" in roles:
        tips.append("fewer reward servers on these GPUs (colocate them with another group, or give them GPUs of "
                    "their own: leave reward_server out of placement.colocate)")
    if len(roles) > 1:
        tips.append("colocate fewer roles on these GPUs")
    if roles == ("vllm",):
        tips.append("a larger placement.vllm.tensor_parallel_size")
    return list(dict.fromkeys(tips))
