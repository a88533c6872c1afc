"""The node map as text (`hpcrlhf plan`): node by node, GPU by GPU with its occupants and
memory by part (the allocation's idle last nodes in one line), the memory of each phase of a step
(generate, train, weight_sync) per set of alike GPUs, then one summary line per role and the vLLM
engines' KV-cache capacity."""

from __future__ import annotations

from hpcrlhf.algos.estimators import ESTIMATORS
from hpcrlhf.placement.layout import describe_devices, node_range, plural, shape_text
from hpcrlhf.placement.memory import GIB
from hpcrlhf.placement.nodemap import NodeMap
from hpcrlhf.placement.roles import RolePlan


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def _count(n: int) -> str:
    """Parameters as people say them, to three digits: 6.74B, 13.0B, 427K."""
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            value = n / scale
            return f"{value:.{max(0, 3 - len(str(int(value))))}f}{unit}"
    return str(n)


def _columns(rows: list[list[str]]) -> list[str]:
    """Rows of cells, each column padded to its widest cell (the last column is not padded)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)] if rows else []
    return ["  ".join([cell.ljust(w) for cell, w in zip(row, widths)] + [row[-1]]).rstrip() for row in rows]


def _role_row(plan: RolePlan) -> list[str]:
    offload = [name for name, on in (("optimizer", plan.offload_optimizer), ("params", plan.offload_params)) if on]
    return [f"  {plan.name}", f"{plural(plan.ranks, 'rank')} ({shape_text(plan.nodes, plan.gpus_per_node)})",
            f"ZeRO-{plan.zero_stage}", f"offload: {'+'.join(offload) or 'none'}", f"{_count(plan.params)} params",
            ", ".join(plan.models) or "-"]


def _phase_lines(m: NodeMap) -> list[str]:
    """Each set of GPUs with the same occupant roles and the same memory per phase, in one line."""
    groups: dict[tuple, int] = {}
    for device, occupants in m.devices.items():
        if occupants:
            totals = tuple((phase, parts.total) for phase, parts in m.phase_memory(device).items())
            key = (tuple(dict.fromkeys(o.role for o in occupants)), totals)
            groups[key] = groups.get(key, 0) + 1
    if not groups:
        return []
    sleepers = [name for name, plan in m.roles.items() if plan.sleep] + (["vllm"] if m.vllm and m.vllm.sleep else [])
    rows = [[f"  {' + '.join(roles)}", f"({plural(count, 'GPU')})",
             *[f"{phase} {_gib(total)}" for phase, total in totals[:-1]], f"{totals[-1][0]} {_gib(totals[-1][1])} GiB"]
            for (roles, totals), count in groups.items()]
    return [f"memory by phase (sleep: {', '.join(sleepers) or 'none'})"] + _columns(rows)


def estimator_line(name: str, samples_per_prompt: int) -> str:
    """What ppo.advantage_estimator is and needs, as the plan shows it."""
    e = ESTIMATORS[name]
    needs = ["a critic" if e.needs_critic else "no critic"]
    needs.append(f"groups of {samples_per_prompt} samples per prompt" if e.needs_groups
                 else f"{plural(samples_per_prompt, 'sample')} per prompt")
    needs.append("the KL penalty folded into each response's score" if e.sequence_level else "a per-token KL penalty")
    return f"estimator: {e.name} -- {e.summary}; {', '.join(needs)}"


def render_text(m: NodeMap) -> str:
    """The map as text: node by node, GPU by GPU, then one line per role and per engine."""
    capacity = _gib(m.gpu_memory)
    gpu_rows, node_of_row = [], []
    for device, occupants in m.devices.items():
        parts = m.memory(device)
        shown = " + ".join(f"{name} {_gib(v)}" for name, v in parts.as_dict().items() if v)
        total = _gib(parts.total)
        if m.sleeps(device):  # its occupants take turns: what fits is the most held at once
            total = f"{total} in all, at most {_gib(m.peak(device)[1].total)} at once"
        gpu_rows.append([f"  gpu {device.gpu}", " + ".join(o.label for o in occupants) or "idle",
                         f"{shown + ' = ' if shown else ''}{total} / {capacity} GiB"])
        node_of_row.append(device.node)
        work = m.cpu_work(device.node) if device.gpu == m.gpus_per_node - 1 else []
        if work:  # the node's rule servers and agent environments
            of = f" of {m.cpus_per_node}" if m.cpus_per_node is not None else ""
            gpu_rows.append(["  cpu", " + ".join(what for what, _ in work),
                             f"{plural(sum(c for _, c in work), 'CPU core')}{of}"])
            node_of_row.append(device.node)
    lines = [f"node map: {shape_text(m.nodes, m.gpus_per_node)} = {plural(m.nodes * m.gpus_per_node, 'GPU')} "
             f"of {capacity} GiB"]
    for i, row in enumerate(_columns(gpu_rows)):
        if i == 0 or node_of_row[i] != node_of_row[i - 1]:
            lines.append(f"node {node_of_row[i]}")
        lines.append(row)
    if m.idle_nodes:  # the allocation's last nodes: one line, however many
        each = " each" * (m.idle_nodes > 1)
        lines.append(f"{node_range(m.nodes - m.idle_nodes, m.nodes - 1)}: idle ({plural(m.gpus_per_node, 'GPU')}{each})")
    lines += _phase_lines(m)
    role_rows = [_role_row(plan) for plan in m.roles.values()]
    if m.vllm:
        e = m.vllm
        role_rows.append(["  vllm", f"{plural(e.engines, 'engine')} x TP {e.tensor_parallel_size}", "vLLM",
                          f"gpu_memory_utilization {e.gpu_memory_utilization:g}", f"{_count(e.params)} params",
                          e.model])
    if m.reward_servers:
        on_gpus = sum(s.device is not None for s in m.reward_servers)
        role_rows.append(["  reward_server", plural(len(m.reward_servers), "server"),
                          f"{on_gpus} on GPUs, {len(m.reward_servers) - on_gpus} on CPU cores", "", "",
                          ", ".join(dict.fromkeys(s.name for s in m.reward_servers))])
    lines += ["roles"] + _columns(role_rows)
    lines.append(f"colocated: {', '.join(' + '.join(g) for g in m.colocated) or 'none'}")
    lines.append(estimator_line(m.estimator, m.samples_per_prompt))
    if m.vllm and m.vllm.memory:
        tokens, kv = m.vllm.memory.kv_cache_tokens, _gib(m.vllm.memory.parts.kv_cache)
        rows = [[f"  vllm{i}", describe_devices(group), f"{kv} GiB per GPU = {tokens:,} tokens"]
                for i, group in enumerate(m.engines)]
        lines += ["kv cache"] + _columns(rows)
    if m.reward_servers:
        rows = [[f"  {s.label}", f"reward.sources[{s.source}] {s.name}", s.where,
                 f"weights {_gib(s.memory.weights)} GiB" if s.memory else plural(s.cpus, "CPU core"), s.model or ""]
                for s in m.reward_servers]
        lines += ["reward servers (address and token made when the job starts)"] + _columns(rows)
    return "\n".join(lines) + "\n"
