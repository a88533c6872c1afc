"""Which GPUs each role gets: a deterministic first-fit over the allocation's nodes.

Colocated roles form one unit placed once; every member gets exactly the unit's GPUs. Units are
placed in role order (actor, critic, ref, reward: a group where its first member comes), then
the vLLM engines one by one, then the reward models' servers (one GPU each). A unit of k nodes x g GPUs takes the g lowest free GPUs on each of
the first k nodes that still have g free; an engine of TP t takes the t lowest free GPUs of the
first node with t free, as a TP group must not span nodes; a server takes the lowest free GPU. Servers
colocated with a unit take its GPUs in turn (server k on its k-th GPU, wrapping around). Ranks are
numbered node-major.
Nothing is moved or shrunk to make a layout fit: what does not fit is a problem.

First fit fills nodes in order, so the nodes anything runs on are the first ones: a node is only
looked at once something is placed on it, and the allocation's remaining nodes are counted as idle,
never listed. Placing on 100,000 nodes costs what placing on the nodes used costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable, Mapping, Sequence

from hpcrlhf.config.schema import MODEL_ROLES
from hpcrlhf.placement.problems import Problem

SERVICES = ("vllm", "reward_server")
"""Placement roles that are not DeepSpeed ranks: they take GPUs after (or inside) the model roles' units."""
MAX_NODES = 100_000
"""The most nodes an allocation may have (`hpcrlhf plan`, `sbatch`, `submit`): ten times today's largest GPU
clusters (about 10,000 nodes). A larger count is a typo (or an overflow), refused with this limit."""
MAX_GPUS_PER_NODE = 64
"""The most GPUs a node may have (today's nodes have 4 to 16)."""


def allocation_problems(nodes: int, gpus_per_node: int, keys: tuple[str, str]) -> list[Problem]:
    """An allocation shape outside 1..MAX_NODES x 1..MAX_GPUS_PER_NODE; `keys` name the two settings."""
    found = []
    for key, value, limit, what in ((keys[0], nodes, MAX_NODES, "nodes"), (keys[1], gpus_per_node, MAX_GPUS_PER_NODE,
                                                                          "GPUs per node")):
        if value < 1:
            found.append(Problem(key, value, "an allocation needs at least one", "use 1 or more"))
        elif value > limit:
            found.append(Problem(key, value, f"more {what} than hpcrlhf plans for (at most {limit:,})",
                                 f"use at most {limit:,}"))
    return found


@dataclass(frozen=True, order=True)
class Device:
    """One GPU of the allocation: node index (0-based, in allocation order) and GPU on that node."""

    node: int
    gpu: int

    def __str__(self) -> str:
        return f"node {self.node} gpu {self.gpu}"


@dataclass(frozen=True)
class Layout:
    """Devices of each role (rank order), of each vLLM engine (TP rank order), and the
    colocation groups that actually share GPUs (roles with GPUs only)."""

    ranks: dict[str, tuple[Device, ...]]
    engines: tuple[tuple[Device, ...], ...]
    servers: tuple[Device, ...]
    """The GPU of each reward model's server, in server order."""
    colocated: tuple[tuple[str, ...], ...]
    idle: tuple[Device, ...]
    """GPUs nothing runs on, on the nodes before `used_nodes`."""
    used_nodes: int
    """Nodes 0 .. used_nodes - 1 are those anything was placed on; every later node of the allocation is idle."""
    complete: bool
    """Everything asked for was placed."""


@dataclass(frozen=True)
class _Unit:
    roles: tuple[str, ...]
    """Roles (not vLLM) sharing these GPUs; the first names the unit in messages."""
    nodes: int
    gpus_per_node: int
    with_vllm: bool
    with_servers: bool = False

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def describe_devices(devices: Iterable[Device]) -> str:
    """`node 0 gpus 0-3, node 1 gpu 5`: devices grouped by node, consecutive GPUs as ranges."""
    by_node: dict[int, list[int]] = {}
    for d in sorted(devices):
        by_node.setdefault(d.node, []).append(d.gpu)
    parts = []
    for node, gpus in by_node.items():
        runs, start = [], gpus[0]
        for prev, cur in zip(gpus, gpus[1:] + [None]):
            if cur != prev + 1:
                runs.append(f"{start}-{prev}" if prev > start else f"{start}")
                start = cur
        parts.append(f"node {node} gpu{'s' * (len(gpus) > 1)} {','.join(runs)}")
    return ", ".join(parts)


def node_range(first: int, last: int) -> str:
    """`node 2`, `nodes 2-99999`."""
    return f"nodes {first}-{last}" if last > first else f"node {first}"


def plural(n: int, word: str) -> str:
    """`1 node`, `2 nodes`."""
    return f"{n} {word}{'s' * (n != 1)}"


def shape_text(nodes: int, gpus_per_node: int) -> str:
    """`2 nodes x 8 GPUs`."""
    return f"{plural(nodes, 'node')} x {plural(gpus_per_node, 'GPU')}"


def _units(shapes: Mapping[str, tuple[int, int]], engines: int, tp: int, groups: Sequence[tuple[str, ...]],
           problems: list[Problem]) -> list[_Unit]:
    """Placement units in order; an inconsistent colocation group is a problem and no unit."""
    units, done = [], set()
    for role in MODEL_ROLES:
        if role in done or not shapes[role][0] * shapes[role][1]:
            continue
        group = next((g for g in groups if role in g), (role,))
        done.update(group)
        members = tuple(r for r in group if r not in SERVICES)
        sizes = {r: shapes[r] for r in members}
        if len(set(sizes.values())) > 1:
            shown = ", ".join(f"{r} {shape_text(*s)}" for r, s in sizes.items())
            problems.append(Problem("placement.colocate", list(group), f"colocated roles share the same GPUs, so "
                                    f"they need the same shape, but: {shown}", "give them the same nodes and "
                                    "gpus_per_node, or split the group"))
            continue
        nodes, per_node = shapes[role]
        unit = _Unit(members, nodes, per_node, "vllm" in group, "reward_server" in group)
        if unit.with_vllm and engines * tp != unit.gpus:
            fit = f"placement.vllm.engines={unit.gpus // tp}" if unit.gpus % tp == 0 else "a TP size dividing it"
            problems.append(Problem("placement.vllm.engines", engines, f"vLLM is colocated with {role}, which has "
                                    f"{unit.gpus} GPUs, but {engines} engines x TP {tp} take {engines * tp}; "
                                    f"colocated engines cover exactly their group's GPUs",
                                    f"use {fit}, or take vllm out of the group"))
            continue
        if unit.with_vllm and per_node % tp:
            problems.append(Problem("placement.vllm.tensor_parallel_size", tp, f"vLLM is colocated with {role}, "
                                    f"which has {per_node} GPUs per node, so TP groups of {tp} would span nodes",
                                    f"use a tensor_parallel_size dividing {per_node}"))
            continue
        units.append(unit)
    return units


def _fits_shape(unit: _Unit, nodes: int, gpus_per_node: int, problems: list[Problem]) -> bool:
    key, ok = f"placement.{unit.roles[0]}", True
    if unit.gpus_per_node > gpus_per_node:
        alt = (f"nodes: {unit.gpus // gpus_per_node}, gpus_per_node: {gpus_per_node} for the same {unit.gpus} GPUs"
               if unit.gpus % gpus_per_node == 0 else f"at most {gpus_per_node} GPUs per node and more nodes")
        problems.append(Problem(f"{key}.gpus_per_node", unit.gpus_per_node,
                                f"more than the {gpus_per_node} GPUs of a node", f"use {alt}"))
        ok = False
    if unit.nodes > nodes:
        problems.append(Problem(f"{key}.nodes", unit.nodes, f"more than the {nodes} nodes of the allocation",
                                f"ask for {unit.nodes} nodes (--nodes {unit.nodes}), or give the role fewer nodes"))
        ok = False
    return ok


class FreeGPUs:
    """The free GPUs of the nodes placed on so far (0, 1, ...), and first fit over them.

    The allocation's next nodes are wholly free and join only when chosen, so a huge allocation costs
    what its used nodes cost. A node's free count only falls, so once a node has fewer than g free GPUs
    it never again fits a request for g: a cursor per g skips such nodes for good. A run of E engines
    over N nodes then looks at about E + N nodes, not E x N (`looked` counts them)."""

    def __init__(self, nodes: int, gpus_per_node: int):
        self.allocation = (nodes, gpus_per_node)
        self.nodes: list[list[int]] = []
        """Free GPUs of each node placed on so far, lowest first."""
        self.looked = 0
        """Nodes examined by every `take` so far: the cost of placing."""
        self._cursor: dict[int, int] = {}  # g -> every node before it has fewer than g free GPUs

    def take(self, nodes: int, per_node: int) -> list[Device] | None:
        """First fit: the `per_node` lowest free GPUs on each of the first `nodes` nodes with room
        (None, and nothing taken, when there are not enough)."""
        start = self._cursor.get(per_node, 0)
        while start < len(self.nodes) and len(self.nodes[start]) < per_node:
            start, self.looked = start + 1, self.looked + 1
        self._cursor[per_node] = start
        chosen = []
        for n in range(start, len(self.nodes)):
            if len(chosen) == nodes:
                break
            self.looked += 1
            if len(self.nodes[n]) >= per_node:
                chosen.append(n)
        while len(chosen) < nodes and len(self.nodes) < self.allocation[0] and per_node <= self.allocation[1]:
            chosen.append(len(self.nodes))
            self.nodes.append(list(range(self.allocation[1])))
        if len(chosen) < nodes:
            return None
        devices = []
        for n in chosen:
            devices += [Device(n, g) for g in self.nodes[n][:per_node]]
            del self.nodes[n][:per_node]
        return devices


def _demand_problem(units: list[_Unit], engines: int, tp: int, servers: int, nodes: int, gpus_per_node: int) -> Problem:
    asks = [f"{'+'.join(u.roles)}{'+vllm' * u.with_vllm}{'+reward_server' * u.with_servers} {u.gpus}" for u in units]
    asks += [f"vllm {engines * tp} ({engines} engines x TP {tp})"] if engines else []
    asks += [f"reward_server {servers}"] if servers else []
    total = sum(u.gpus for u in units) + engines * tp + servers
    tips = []
    for pair in (("actor", "ref"), ("critic", "reward")):
        sizes = [u for u in units if u.roles == (pair[0],) or u.roles == (pair[1],)]
        if len(sizes) == 2 and sizes[0].nodes == sizes[1].nodes and sizes[0].gpus_per_node == sizes[1].gpus_per_node:
            tips.append(f"colocate [{', '.join(pair)}] (saves {sizes[0].gpus} GPUs)")
    if not tips:
        tips.append("colocate roles on the same GPUs (placement.colocate; roles in a group need the same shape, "
                    "e.g. [[actor, ref], [critic, reward]])")
    excess = total - nodes * gpus_per_node
    if engines * tp > excess:
        tips.append(f"fewer vLLM engines (placement.vllm.engines={engines - -(-excess // tp)})")
    if servers:
        tips.append("colocate the reward servers (add reward_server to a group, e.g. [critic, reward_server])")
    tips.append(f"more nodes (--nodes {-(-total // gpus_per_node)})")
    return Problem("placement", shape_text(nodes, gpus_per_node),
                   f"the roles ask for {total} GPUs ({', '.join(asks)}) but the allocation has {nodes * gpus_per_node}",
                   "; ".join(tips))


def assign(nodes: int, gpus_per_node: int, shapes: Mapping[str, tuple[int, int]], engines: int, tp: int,
           colocate: Sequence[tuple[str, ...]], problems: list[Problem], gpu_servers: int = 0) -> Layout:
    """Place every role (shapes: role -> (nodes, gpus_per_node), 0 GPUs for none), `engines`
    vLLM engines of TP `tp` and `gpu_servers` reward-model servers of one GPU; add a problem for
    anything that cannot be placed."""
    found_before = len(problems)
    has = ({r for r in MODEL_ROLES if shapes[r][0] * shapes[r][1]} | ({"vllm"} if engines else set())
           | ({"reward_server"} if gpu_servers else set()))
    # a group is placed by its model roles with GPUs: without one, its engines and servers are placed alone
    groups = [g for g in (tuple(r for r in group if r in has) for group in colocate)
              if len(g) >= 2 and any(r in MODEL_ROLES for r in g)]
    units = _units(shapes, engines, tp, groups, problems)
    free_engines = engines if "vllm" in has and not any("vllm" in g for g in groups) else 0
    if free_engines and tp > gpus_per_node:
        problems.append(Problem("placement.vllm.tensor_parallel_size", tp, f"a TP group must sit on one node, "
                                f"and a node has {gpus_per_node} GPUs", f"use a TP size of at most {gpus_per_node}"))
        free_engines = 0
    units = [u for u in units if _fits_shape(u, nodes, gpus_per_node, problems)]
    free_servers = 0 if any("reward_server" in g for g in groups) else gpu_servers
    over = sum(u.gpus for u in units) + free_engines * tp + free_servers > nodes * gpus_per_node
    if over:
        problems.append(_demand_problem(units, free_engines, tp, free_servers, nodes, gpus_per_node))
    free = FreeGPUs(nodes, gpus_per_node)
    ranks: dict[str, tuple[Device, ...]] = {}
    engine_devices: list[tuple[Device, ...]] = []
    servers: list[Device] = []
    for unit in units:
        taken = free.take(unit.nodes, unit.gpus_per_node)
        if taken is None:
            if not over:
                left = ", ".join(f"node {n}: {len(g)}" for n, g in enumerate(free.nodes))
                problems.append(Problem(f"placement.{unit.roles[0]}", shape_text(unit.nodes, unit.gpus_per_node),
                                        f"needs {unit.gpus_per_node} free GPUs on each of {unit.nodes} nodes, but "
                                        f"after the roles before it the free GPUs are {left}",
                                        "reshape the role to the free GPUs, colocate it, or add nodes"))
            continue
        for role in unit.roles:
            ranks[role] = tuple(taken)
        if unit.with_vllm:  # consecutive GPUs of a node form one TP group
            engine_devices += [tuple(taken[i : i + tp]) for i in range(0, len(taken), tp)]
        if unit.with_servers:
            servers = [taken[k % len(taken)] for k in range(gpu_servers)]
    for e in range(free_engines):
        taken = free.take(1, tp)
        if taken is None:
            if not over:
                most = max(map(len, free.nodes), default=0)
                problems.append(Problem("placement.vllm.engines", engines, f"engines {e}-{engines - 1} need {tp} free "
                                        f"GPUs on one node each (a TP group cannot span nodes), but at most {most} "
                                        f"are free on any node", f"use {e} engines, a TP size of at most "
                                        f"{max(most, 1)}, or reshape the roles so the free GPUs sit on one node"))
            break
        engine_devices.append(tuple(taken))
    for k in range(free_servers):
        taken = free.take(1, 1)
        if taken is None:
            if not over:
                problems.append(Problem("placement.reward_server", plural(gpu_servers, "server"),
                                        f"reward-model servers {k}-{gpu_servers - 1} need a GPU each, but no GPU is "
                                        "free after the roles and engines", "colocate them (add reward_server to a "
                                        "group, e.g. [critic, reward_server]), fewer servers, or more nodes "
                                        f"(--nodes {nodes + 1})"))
            break
        servers += taken
    idle = tuple(Device(n, g) for n, gpus in enumerate(free.nodes) for g in gpus)
    return Layout(ranks, tuple(engine_devices), tuple(servers), tuple(groups), idle, len(free.nodes),
                  complete=len(problems) == found_before)


def idle_problem(layout: Layout, nodes: int, gpus_per_node: int, engines: int, tp: int, sequences: int) -> Problem:
    """GPUs of a complete layout left idle, with what could use them: more vLLM engines (as many
    as fit and split the rollout's `sequences`), or fewer nodes."""
    tips = []
    free = {n: 0 for n in range(layout.used_nodes)}
    for d in layout.idle:
        free[d.node] += 1
    idle_nodes = nodes - layout.used_nodes
    room = sum(count // tp for count in free.values()) + idle_nodes * (gpus_per_node // tp)
    can_add = not any("vllm" in group for group in layout.colocated)  # colocated engines tile their group
    tries = range(min(room, sequences - engines), 0, -1) if can_add else ()  # engines + k must divide sequences
    more = next((k for k in tries if sequences % (engines + k) == 0), 0)
    if more:
        tips.append(f"give them to vLLM: placement.vllm.engines={engines + more} ({more} more engine(s) of TP {tp}"
                    f"{'' if engines else ', with rollout.backend=vllm'})")
    empty = idle_nodes + sum(count == gpus_per_node for count in free.values())
    if empty:
        tips.append(f"ask for {plural(nodes - empty, 'node')} (--nodes {nodes - empty})")
    tips += ["give them to a role (more ranks)", "or set placement.allow_idle_gpus=true"]
    where = [describe_devices(layout.idle)] if layout.idle else []
    if idle_nodes:
        gpus = f"gpus 0-{gpus_per_node - 1}" if gpus_per_node > 1 else "gpu 0"
        where.append(f"{node_range(layout.used_nodes, nodes - 1)} {gpus}")
    count = len(layout.idle) + idle_nodes * gpus_per_node
    return Problem("placement", shape_text(nodes, gpus_per_node), f"{count:,} of {nodes * gpus_per_node:,} "
                   f"GPUs would idle ({', '.join(where)})", "; ".join(tips))
