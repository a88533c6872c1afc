"""From `hpcrlhf sbatch/submit` arguments to a cluster job: the `hpcrlhf train` (or `eval`) command line the
nodes run and the Slurm options, checked against each other before anything is written or queued.

A recipe is code: the `package.module:function` rules it names are imported and run by the job. They
are imported here too, after the config is validated and before anything is written or queued, so
a rule that cannot be imported fails now rather than on the cluster."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path

from hpcrlhf.bench.suites import get_suite
from hpcrlhf.config.jobspec import BenchJob, EvalJob, TrainJob, literal_setting, resolve_recipe
from hpcrlhf.errors import ConfigError
from hpcrlhf.hpc.allocation import check_fits
from hpcrlhf.hpc.image import check_image
from hpcrlhf.hpc.sbatch import SlurmOptions
from hpcrlhf.models.context import require_generation_fits


@dataclass(frozen=True)
class ClusterJob:
    argv: list[str]
    """`hpcrlhf <argv>` is what the job runs (a `train` command line with absolute paths)."""
    options: SlurmOptions
    notes: tuple[str, ...] = ()
    """Things the user should know about the shape (printed, never acted on silently)."""


def config_paths(cfg: object) -> list[str]:
    """Every absolute path a job config names (model folders, data files), in config order."""
    found: list[str] = []

    def walk(value: object) -> None:
        if is_dataclass(value):
            for f in fields(value):
                walk(getattr(value, f.name))
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, str) and value.startswith("/"):
            found.append(value)

    walk(cfg)
    return list(dict.fromkeys(found))


def check_user_code(cfg: object, python: str, container: str | None) -> list[str]:
    """Import the user's code `cfg` names -- every `package.module:function` rule and metric
    (`hpcrlhf.rewards.rules.rule_names`) and the agent section's environment, tools and parser
    (`hpcrlhf.agents.loading.agent_code_names`) -- as the job will, before it is written or queued: a
    ConfigError names the field, the name and why. Only when the job runs this Python outside a
    container (the default); otherwise returns a note that the job imports them when it starts."""
    from hpcrlhf.agents.loading import agent_code_names, check_agent_code  # only for code to check
    from hpcrlhf.rewards.rules import check_rules, rule_names  # only for code to check

    names = rule_names(cfg) + agent_code_names(cfg)
    if not names:
        return []
    if container or python != sys.executable:
        named = ", ".join(f"{field} {name!r}" for field, name in names)
        where = f"the image's {python}" if container else python
        return [f"{named} not imported here: the job runs them in {where}, not in this Python ({sys.executable}); "
                "code that cannot be imported there fails when the job starts"]
    try:
        check_rules(cfg)
        check_agent_code(cfg)
    except ConfigError as e:
        raise ConfigError(f"{e} (checked before queueing the job, with this Python)") from None
    return []


def check_trackers(cfg: object, python: str, container: str | None) -> list[str]:
    """The packages of `log.backends` (W&B, MLflow), looked up as the job will when it runs this Python
    outside a container; otherwise a note that the job checks them when it starts."""
    from hpcrlhf.run.trackers import MODULES, require_installed  # only for a job that logs

    backends = tuple(getattr(getattr(cfg, "log", None), "backends", ()))
    if not [b for b in backends if b != "tensorboard"]:
        return []
    if container or python != sys.executable:
        where = f"the image's {python}" if container else python
        return [f"log.backends {list(backends)}: the packages ({', '.join(MODULES[b] for b in backends)}) are not "
                f"looked up here: the job needs them in {where}"]
    try:
        require_installed(backends)
    except ConfigError as e:
        raise ConfigError(f"{e} (checked before queueing the job, with this Python)") from None
    return []


def container_binds(paths: Sequence[str], run_dir: str) -> tuple[list[str], list[str]]:
    """(folders to bind, notes): each path's folder -- the path itself when it is a folder here, else
    its parent (a file, or a path only the compute nodes have) -- unless the run folder (always bound)
    or another bound folder holds it."""
    def within(path: str, folders: Sequence[str]) -> bool:
        return any(path == p or path.startswith(p.rstrip("/") + "/") for p in folders)

    folders, notes = [], []
    for path in (p for p in paths if not within(p, [run_dir])):
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        if not os.path.exists(path):
            notes.append(f"{path} (named by the recipe) is not on this host; its folder {folder} is bound into the "
                         "container: the compute nodes must have it")
        folders.append(os.path.realpath(folder) if os.path.exists(folder) else folder)
    keep: list[str] = []
    for folder in sorted(set(folders)):
        if not within(folder, [run_dir, *keep]):
            keep.append(folder)
    return keep, notes


def cluster_job(kind: str, recipe: str | None, overrides: Sequence[str], output_dir: str | None,
                **slurm: object) -> ClusterJob:
    """The job `hpcrlhf train KIND --config RECIPE --set ...` on Slurm, with options `slurm` (None:
    the default; nodes/GPUs default to the recipe's placement for Ray, 1 x 1 for MPI)."""
    recipe_path = resolve_recipe(recipe) if kind != "bench" else None
    if recipe_path is not None and Path(recipe_path).exists() and recipe == recipe_path:
        recipe = str(Path(recipe_path).resolve())  # the job runs elsewhere: a user's file by absolute path
    if kind == "eval":  # its folder defaults to RUN/eval; the run it reads is named by absolute path too
        run = EvalJob(recipe, tuple(overrides)).config().run
        overrides = [*overrides, *literal_setting("run", str(Path(run).resolve()) if run else None)]
        output_dir = output_dir or EvalJob(recipe, tuple(overrides)).config().out_dir
    run_dir = str(Path(output_dir or f"runs/{kind}-{Path(recipe or 'defaults').stem}").resolve())
    given = {k: v for k, v in slurm.items() if v is not None}
    if given.get("cache_dir"):  # like the run folder: relative to here, written absolute
        given["cache_dir"] = os.path.abspath(str(given["cache_dir"]))
    if kind == "bench":  # a benchmark suite: its systems run one after the other on one Ray cluster
        if given.get("launcher", "ray") != "ray":
            raise ConfigError("--launcher: a bench job runs on Ray (its all-ranks baseline starts its own srun step)")
        suite = get_suite(recipe or "")
        argv = BenchJob.from_settings(suite.name, overrides, run_dir).argv()
        cfg, shape = None, (suite.nodes, suite.gpus_per_node)
        given["launcher"] = "ray"
    else:
        job = (EvalJob(recipe, tuple(overrides), output_dir=run_dir) if kind == "eval"
               else TrainJob(kind, recipe, tuple(overrides), run_dir))
        argv, cfg = job.argv(), job.config()
        ray = kind == "ppo" and cfg.placement.runtime == "ray"
        given.setdefault("launcher", "ray" if ray else "mpi")
        shape = (cfg.placement.nodes, cfg.placement.gpus_per_node) if kind == "ppo" else (1, 1)
    notes = []
    if given["launcher"] == "ray":
        given.setdefault("nodes", shape[0])
        given.setdefault("gpus_per_node", shape[1])
        if (given["nodes"], given["gpus_per_node"]) != shape:
            notes.append(f"the recipe's node map uses {shape[0]} x {shape[1]} of the {given['nodes']} x "
                         f"{given['gpus_per_node']} asked for; to re-plan it for the whole allocation, add --set "
                         f"placement.nodes={given['nodes']} --set placement.gpus_per_node={given['gpus_per_node']}")
        cpus = getattr(getattr(cfg, "placement", None), "cpus_per_node", None)  # (a bench or eval job: none)
        if cpus is not None and "cpus_per_gpu" not in given:  # the cores the node map was checked against
            given["cpus_per_gpu"] = -(-cpus // int(given["gpus_per_node"]))
            notes.append(f"--cpus-per-gpu={given['cpus_per_gpu']}: placement.cpus_per_node {cpus} over "
                         f"{given['gpus_per_node']} GPU(s) per node")
    else:
        given.setdefault("nodes", 1)
        given.setdefault("gpus_per_node", 1)
    given.setdefault("job_name", f"hpcrlhf-{kind}")
    given.setdefault("python", "python" if given.get("container") else sys.executable)
    given["binds"] = tuple(given.get("binds") or ())
    if given.get("container"):
        notes += check_image(str(given["container"]), str(given["python"]))
        binds, missing = container_binds(config_paths(cfg) if cfg is not None else [], run_dir)
        given["binds"] = tuple(binds) + given["binds"]
        notes += missing
    options = SlurmOptions(run_dir=run_dir, **given)  # type: ignore[arg-type]
    check_fits(argv, options.nodes, options.gpus_per_node, launcher=options.launcher,
               where="the requested --nodes/--gpus-per-node",
               cpus_per_node=options.cpus_per_gpu * options.gpus_per_node if options.cpus_per_gpu else None,
               cpus_from="--cpus-per-gpu x --gpus-per-node")
    if cfg is not None:
        if kind != "eval":  # (an eval job checks its prompts against its models when it starts)
            require_generation_fits(cfg, kind)  # a model folder here is checked now
        notes += check_trackers(cfg, options.python, options.container)
        # last: the user's code runs once everything else is known to be valid
        notes += check_user_code(cfg, options.python, options.container)
    return ClusterJob(argv, options, tuple(notes))
