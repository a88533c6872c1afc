"""The package's import graph, read from the source (every `import`, function-local ones included):
the CLI sits on top. No library module imports `hpcrlhf.cli` -- a job travels as a typed
`hpcrlhf.config.jobspec` record, and launchers run the `hpcrlhf` program by module name -- so no
import circle passes through it. (Issue 27: cli, hpc/* and bench/* used to form a 7-module circle.)

To see the graph yourself: `python -m tests.test_layering` prints each module's importers of the CLI
and every circle (strongly connected set) of modules."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hpcrlhf"
ENTRY_POINTS = {"hpcrlhf.__main__"}
"""Modules that are programs, not library: they may import the CLI."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the hpcrlhf modules it imports (a `from pkg import name` counts as pkg.name when that is
    a module, else as pkg)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hpcrlhf"):
                targets |= {resolve(f"{node.module}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names if a.name.startswith("hpcrlhf")}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(group)

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_the_circle_finder_finds_circles_and_only_them():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert sorted(map(sorted, circles(graph))) == [["a", "b", "c"], ["d", "e"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_local_imports():
    graph = import_graph()
    assert "hpcrlhf.trainers.ppo.ray.entry" in graph["hpcrlhf.trainers.ppo"]  # imported inside run_ppo only
    assert "hpcrlhf.cli" in graph["hpcrlhf.__main__"]


def test_no_library_module_imports_the_cli():
    importers = sorted(m for m, targets in import_graph().items() if "hpcrlhf.cli" in targets)
    assert set(importers) <= ENTRY_POINTS, (
        f"{sorted(set(importers) - ENTRY_POINTS)} import hpcrlhf.cli: take jobs as hpcrlhf.config.jobspec records "
        "and run the `hpcrlhf` program with hpcrlhf.hpc.program.run_module instead")


def test_no_import_circle_passes_through_the_cli():
    through = [sorted(c) for c in circles(import_graph()) if "hpcrlhf.cli" in c]
    assert not through, through


def test_the_cluster_runtime_needs_no_trainer():
    """hpcrlhf.cluster (Ray sessions, worker groups, engines) is a runtime the PPO trainer uses; the
    PPO role workers live with the PPO code and build their models with hpcrlhf.models.factory."""
    graph = import_graph()
    uses = sorted((m, t) for m, targets in graph.items() if m.startswith("hpcrlhf.cluster")
                  for t in targets if t.startswith("hpcrlhf.trainers"))
    assert not uses, uses


if __name__ == "__main__":
    g = import_graph()
    print("importers of hpcrlhf.cli:", sorted(m for m, t in g.items() if "hpcrlhf.cli" in t))
    for c in circles(g):
        print("circle:", ", ".join(sorted(c)))
