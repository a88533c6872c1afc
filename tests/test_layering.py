"""The package's import graph, read from the source with `ast` (every `import`, function-local ones
included): no import circle, and no import from a lower layer into a higher one.

The layers, lowest first (a module belongs to the layer of the longest name listed below that is the
module or a package holding it; modules of one layer may import each other):

 1. `hpcrlhf` (the version), errors, formats                         -- imports nothing of hpcrlhf
 2. logs, run.signals, run.files, run.diskspace, run.usercode,     -- what keeps files and processes safe,
    run.lock, cache, hub, namespaces                                    used by everything that writes or waits
                                                                        (logs writes the run's third_party.log)
 3. algos.estimators                                                 -- the advantage estimators' names and
                                                                        needs: plain data the config checks
 4. config                                                           -- typed configs, recipes, jobs as data
 5. algos                                                            -- the maths (pure tensor functions)
 6. data                                                             -- sources, the bundled task, tokenisation
 7. models                                                           -- loading, tiny models, LoRA, export
 8. engines                                                          -- DeepSpeed, process groups, rollout engines
 9. agents                                                           -- multi-turn rollouts on the engines:
                                                                        environments, tools, the scheduler
10. models.factory, rewards                                          -- models built in engines; reward models
                                                                        and rules scoring with them
11. run                                                              -- the run folder: Run, its checkpoints,
                                                                        metrics, stats, the NaN/Inf guard
12. placement                                                        -- the static node map (`hpcrlhf plan`)
13. cluster                                                          -- the Ray runtime: no trainer code
14. trainers                                                         -- one per job kind, PPO's roles
15. inference, evaluation, demo, plots, bench                        -- programs built on the trainers
16. hpc                                                              -- Slurm, submitit, MPI, containers
17. cli, __main__                                                    -- the `hpcrlhf` command

So the CLI sits on top: no library module imports `hpcrlhf.cli` -- a job travels as a typed
`hpcrlhf.config.jobspec` record, and launchers run the `hpcrlhf` program by module name. (Issue 27:
cli, hpc/* and bench/* used to form a 7-module circle.) A function-local import is counted like any
other; one may reach a higher layer only with a comment on its line saying why (a plugin looked up at
run time, say). A new module must be placed in `LAYERS` (the test names it).

To see the graph yourself: `python -m tests.test_layering` prints every import that goes up a layer
and every circle (strongly connected set) of modules."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hpcrlhf"
ENTRY_POINTS = {"hpcrlhf.__main__"}
"""Modules that are programs, not library: they may import the CLI."""

LAYERS: tuple[tuple[str, ...], ...] = (
    ("hpcrlhf", "hpcrlhf.errors", "hpcrlhf.formats"),
    ("hpcrlhf.logs", "hpcrlhf.run.signals", "hpcrlhf.run.files", "hpcrlhf.run.diskspace", "hpcrlhf.run.usercode",
     "hpcrlhf.run.lock", "hpcrlhf.cache", "hpcrlhf.hub", "hpcrlhf.namespaces"),
    ("hpcrlhf.algos.estimators",),
    ("hpcrlhf.config",),
    ("hpcrlhf.algos",),
    ("hpcrlhf.data",),
    ("hpcrlhf.models",),
    ("hpcrlhf.engines",),
    ("hpcrlhf.agents",),
    ("hpcrlhf.models.factory", "hpcrlhf.rewards"),
    ("hpcrlhf.run",),
    ("hpcrlhf.placement",),
    ("hpcrlhf.cluster",),
    ("hpcrlhf.trainers",),
    ("hpcrlhf.inference", "hpcrlhf.evaluation", "hpcrlhf.demo", "hpcrlhf.plots", "hpcrlhf.bench"),
    ("hpcrlhf.hpc",),
    ("hpcrlhf.cli", "hpcrlhf.__main__"),
)
"""The layers, lowest first (see the module docstring)."""
HEAVY = ("torch", "transformers", "deepspeed", "ray", "vllm")
"""Libraries that take seconds to import: `hpcrlhf --help` and the commands a login node runs
import none of them."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@dataclass(frozen=True)
class Import:
    """One hpcrlhf module named by an import statement of another."""

    source: str
    target: str
    line: int
    local: bool
    """Inside a function (runs when the function does, not when the module is imported)."""
    commented: bool
    """The import's line carries a `#` comment (the reason it is where it is)."""


@functools.cache
def imports() -> tuple[Import, ...]:
    """Every import of an hpcrlhf module by another (a `from pkg import name` counts as pkg.name when
    that is a module, else as pkg)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = []
    for name, path in modules.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text, str(path))
        local = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for node in ast.walk(fn)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hpcrlhf"):
                targets = {resolve(f"{node.module}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Import):
                targets = {resolve(a.name) for a in node.names if a.name.startswith("hpcrlhf")}
            else:
                continue
            commented = any("#" in lines[i - 1] for i in range(node.lineno, (node.end_lineno or node.lineno) + 1))
            found += [Import(name, t, node.lineno, id(node) in local, commented) for t in targets if t and t != name]
    return tuple(found)


def import_graph() -> dict[str, set[str]]:
    """Module -> the hpcrlhf modules it imports, function-local imports included."""
    graph: dict[str, set[str]] = {module_name(p): set() for p in PACKAGE.rglob("*.py")}
    for edge in imports():
        graph[edge.source].add(edge.target)
    return graph


def layer_of(module: str) -> int | None:
    """The index in LAYERS of `module`'s layer: that of the longest listed name that is the module or
    a package holding it (None: not placed)."""
    best, found = -1, None
    for i, layer in enumerate(LAYERS):
        for name in layer:
            if (module == name or module.startswith(name + ".")) and len(name) > best and (name != "hpcrlhf" or module == name):
                best, found = len(name), i
    return found


def upward(edges: Iterable[Import]) -> list[Import]:
    """The imports that go from a module to one in a higher layer."""
    return [e for e in edges if (layer_of(e.target) or 0) > (layer_of(e.source) or 0)]


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
    local = [e for e in imports() if e.source == "hpcrlhf.trainers.ppo" and e.target == "hpcrlhf.trainers.ppo.ray.entry"]
    assert local and all(e.local for e in local)


def test_a_module_belongs_to_the_layer_of_its_longest_listed_name():
    assert layer_of("hpcrlhf") == 0
    assert layer_of("hpcrlhf.algos.estimators") == 2
    assert layer_of("hpcrlhf.algos.ppo") == layer_of("hpcrlhf.algos") == 4
    assert layer_of("hpcrlhf.models.factory") > layer_of("hpcrlhf.engines.rollout") > layer_of("hpcrlhf.models.context")
    assert layer_of("hpcrlhf.cli") == len(LAYERS) - 1
    assert layer_of("hpcrlhf.no_such_module") is None
    edge = Import("hpcrlhf.config.schema", "hpcrlhf.data.tasks", 1, local=True, commented=False)
    assert upward([edge]) == [edge]
    assert upward([Import("hpcrlhf.data.tasks", "hpcrlhf.config.schema", 1, local=False, commented=False)]) == []


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not unplaced, f"{unplaced}: place each in tests/test_layering.py's LAYERS (lowest layer first)"


def test_no_import_circle():
    found = [sorted(c) for c in circles(import_graph())]
    assert not found, f"modules that import each other (directly or round a circle): {found}"


def test_no_module_level_import_goes_up_a_layer():
    up = [f"{e.source}:{e.line} imports {e.target}" for e in upward(imports()) if not e.local]
    assert not up, up


def test_a_function_local_import_goes_up_a_layer_only_with_its_reason():
    up = [f"{e.source}:{e.line} imports {e.target}" for e in upward(imports()) if e.local and not e.commented]
    assert not up, f"{up}: import the lower layer's code into the higher one instead, or say on the line why not"


def test_a_function_local_import_says_why_it_is_not_at_the_top():
    """Imports belong at the top of a module; one inside a function keeps a heavy library (or a
    measured start-up cost) out of commands that do not need it, and says so on its line."""
    silent = [f"{e.source}:{e.line} imports {e.target}" for e in imports() if e.local and not e.commented]
    assert not silent, f"{silent}: import at the top of the module, or say on the line why not (e.g. `# torch`)"


PROBE = """
import json, sys
from hpcrlhf.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("loaded:" + json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))), file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["--help"], ["config", "ppo"], ["plan", "ppo-7b", "--nodes", "2", "--gpus-per-node", "8"]],
                         ids=["help", "config", "plan"])
def test_the_light_commands_import_no_heavy_library(args):
    """The commands a login node runs start in a fraction of a second: the modules they import keep
    torch & co. inside the functions that need them."""
    code = f"HEAVY = {HEAVY!r}\n" + PROBE
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=PACKAGE.parent, capture_output=True, text=True,
                          timeout=120)
    line = [x for x in proc.stderr.splitlines() if x.startswith("loaded:")]
    assert line, proc.stderr[-2000:]
    assert json.loads(line[-1].removeprefix("loaded:")) == [], f"hpcrlhf {' '.join(args)} imports {line[-1]}"


def test_no_library_module_imports_the_cli():
    importers = sorted(m for m, targets in import_graph().items() if "hpcrlhf.cli" in targets)
    assert set(importers) <= ENTRY_POINTS, (
        f"{sorted(set(importers) - ENTRY_POINTS)} import hpcrlhf.cli: take jobs as hpcrlhf.config.jobspec records "
        "and run the `hpcrlhf` program with hpcrlhf.hpc.program.run_module instead")


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
    for e in upward(imports()):
        print(f"up a layer: {e.source}:{e.line} -> {e.target}" + (" (function-local)" if e.local else ""))
    for c in circles(g):
        print("circle:", ", ".join(sorted(c)))
