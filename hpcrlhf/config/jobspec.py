"""A job as data: what `hpcrlhf train KIND --config RECIPE --set K=V -o DIR`, `hpcrlhf eval ...` and
`hpcrlhf bench --suite S ...` ask for, with the one conversion to and from their command lines.

The CLI builds its `train`, `eval` and `bench` arguments here (`add_train_arguments`,
`add_eval_arguments`, `add_bench_arguments`), and the code that writes a job into a Slurm script, checks
it against an allocation or runs a benchmark system reads it back with `job_from_argv` -- so a cluster job, the benchmark and the `hpcrlhf` command always agree on
what a command line means, and none of them needs the CLI module."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path
from collections.abc import Sequence

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.recipe_yaml import quoted
from hpcrlhf.config.schema import JOB_CONFIGS, EvalJobConfig
from hpcrlhf.config.schema.evaluation import RUN_SETTINGS
from hpcrlhf.errors import ConfigError

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
"""The recipes shipped with hpcrlhf (`--config ppo-7b` names hpcrlhf/recipes/ppo-7b.yaml)."""
BENCH_SETTINGS = ("model", "reward_model", "systems", "steps")
"""What a cluster benchmark job takes as --set KEY=VALUE (its `hpcrlhf bench` options)."""


def resolve_recipe(spec: str | None) -> str | None:
    """A recipe is a YAML path, or the name of one shipped in hpcrlhf/recipes/ (without .yaml)."""
    if spec is None or Path(spec).exists():
        return spec
    shipped = RECIPES / f"{spec}.yaml"
    if shipped.exists():
        return str(shipped)
    names = ", ".join(sorted(p.stem for p in RECIPES.glob("*.yaml"))) or "none"
    raise ConfigError(f"--config: '{spec}' is neither a file nor a shipped recipe; shipped recipes: {names}")


def build_config(kind: str, recipe: str | None, overrides: Sequence[str], output_dir: str | None):
    """The typed config of job `kind`: its defaults, then the recipe, then the overrides (and the run
    folder, as `output_dir=`, taken literally)."""
    overrides = list(overrides) + literal_setting("output_dir", output_dir)
    return load_config(JOB_CONFIGS[kind], resolve_recipe(recipe), overrides)


def literal_setting(key: str, path: str | None) -> list[str]:
    """`--set KEY=PATH` for a path given as an option (`-o DIR`, `--model PATH`; none when not given): quoted,
    so the path is taken as written -- `-o 2024-01-01` or `-o '"x"'` names that folder, not a date or `x`."""
    return [] if path is None else [f"{key}={quoted(path)}"]


def path_text(text: str) -> str:
    """argparse type of an option naming a file or folder: the text as given, but never empty (what an unset
    shell variable gives, `-o "$OUT"`, would otherwise fall back to the default silently)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is an empty path (an unset shell variable?): give the file or "
                                         "folder, or leave the option out for its default")
    return text


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", type=path_text, metavar="RECIPE",
                   help="YAML recipe overriding the defaults (a path, or a shipped recipe name)")
    p.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting, e.g. --set optim.lr=3e-4 (repeatable; applied after the recipe)")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `hpcrlhf train` (after the command name)."""
    p.add_argument("kind", choices=sorted(JOB_CONFIGS), help="job kind")
    add_config_arguments(p)
    p.add_argument("--output-dir", "-o", type=path_text, metavar="DIR",
                   help="run folder (same as --set output_dir=DIR)")


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `hpcrlhf eval` (after the command name)."""
    add_config_arguments(p)
    p.add_argument("--model", "-m", type=path_text, metavar="PATH", help="model folder (same as --set model.path=PATH)")
    p.add_argument("--run", "-r", type=path_text, metavar="RUN",
                   help="a run folder: its checkpoints are evaluated with its settings (same as --set run=RUN)")
    p.add_argument("--checkpoints", metavar="SPEC",
                   help="with --run: latest (default), all, best, model or a step, alone or in a comma list (100,200,model)")
    p.add_argument("--output-dir", "-o", type=path_text, metavar="DIR",
                   help="where the results and answers go (default: RUN/eval, or runs/eval)")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `hpcrlhf bench` (after the command name)."""
    p.add_argument("--suite", metavar="NAME",
                   help="suite to run (--list shows them: cpu, cpu-longtail, gpu-1, gpu-7b, ...)")
    p.add_argument("--output", "-o", type=path_text, metavar="DIR", help="results folder (default: runs/bench-SUITE)")
    p.add_argument("--systems", metavar="A,B", help="run only these systems of the suite (dschat: real DeepSpeed-Chat "
                                                    "alone, with --dschat-dir)")
    p.add_argument("--steps", type=int, metavar="N", help="measured steps (after warm-up; default: the suite's)")
    p.add_argument("--model", type=path_text, metavar="PATH", help="actor/reference model folder (gpu suites need one)")
    p.add_argument("--reward-model", type=path_text, metavar="PATH",
                   help="reward model (and critic) folder (default: --model)")
    p.add_argument("--dschat-dir", type=path_text, metavar="DIR",
                   help="a DeepSpeedExamples checkout: also run real DeepSpeed-Chat step 3 on the same models, "
                        "prompts and lengths (GPU suites as its scripts do; CPU suites in bf16, ZeRO-2) and parse its log")
    p.add_argument("--dschat-critic", type=path_text, metavar="DIR",
                   help="DeepSpeed-Chat step-2 output (its critic/reward model, with pytorch_model.bin; default: made "
                        "from the reward model by DeepSpeed-Chat's own code)")
    p.add_argument("--list", action="store_true", help="list the suites and their systems")


def _option(name: str, value: object) -> list[str]:
    """`--name value`, or `--name=value` when the value would read as an option (it starts with -)."""
    text = str(value)
    return [f"{name}={text}"] if text.startswith("-") else [name, text]


class _Parser(argparse.ArgumentParser):
    """A parser that raises instead of printing and exiting."""

    def error(self, message: str):
        raise ConfigError(message)


def _parse(command: str, add, argv: Sequence[str]) -> argparse.Namespace:
    args = list(argv)
    if args[:1] != [command]:
        raise ConfigError(f"cluster jobs run `hpcrlhf {command} ...`, not `hpcrlhf {' '.join(args)}`")
    parser = _Parser(prog=f"hpcrlhf {command}", add_help=False)
    add(parser)
    try:
        return parser.parse_args(args[1:])
    except ConfigError as e:
        raise ConfigError(f"not a valid `hpcrlhf {command}` command line ({e}): hpcrlhf {' '.join(args)}") from None


@dataclass(frozen=True)
class TrainJob:
    """`hpcrlhf train KIND [--config RECIPE] [--set KEY=VALUE ...] [--output-dir DIR]`."""

    kind: str
    recipe: str | None = None
    overrides: tuple[str, ...] = ()
    output_dir: str | None = None

    def argv(self) -> list[str]:
        args = ["train", self.kind] + (_option("--config", self.recipe) if self.recipe else [])
        args += [arg for o in self.overrides for arg in _option("--set", o)]
        return args + (_option("--output-dir", self.output_dir) if self.output_dir else [])

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> TrainJob:
        return cls(a.kind, a.config, tuple(a.set), a.output_dir)

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> TrainJob:
        return cls.from_args(_parse("train", add_train_arguments, argv))

    def config(self):
        return build_config(self.kind, self.recipe, self.overrides, self.output_dir)


def run_settings(run_dir: str) -> tuple[dict, str]:
    """The settings `hpcrlhf eval --run RUN` takes from the run's config.yaml (`RUN_SETTINGS`: the base
    model, LoRA, task, held-out data, evaluation, rules, seed), and the file's name."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"run: {run_dir} has no config.yaml: name a run folder `hpcrlhf train` wrote (it holds "
                          "config.yaml and checkpoints/)")
    run = yaml.safe_load(path.read_text())
    if not isinstance(run, dict):
        raise ConfigError(f"{path} is no run config (not a mapping): name a run folder `hpcrlhf train` wrote")
    out = {}
    for section, keys in RUN_SETTINGS.items():
        value = run.get(section)
        if value is not None:
            out[section] = value if keys is None or not isinstance(value, dict) else {
                k: v for k, v in value.items() if k in keys}
    return out, str(path)


@dataclass(frozen=True)
class EvalJob:
    """`hpcrlhf eval [--config RECIPE] [--set KEY=VALUE ...] [--model PATH | --run RUN] [--checkpoints SPEC]
    [--output-dir DIR]`."""

    recipe: str | None = None
    overrides: tuple[str, ...] = ()
    model: str | None = None
    run: str | None = None
    checkpoints: str | None = None
    output_dir: str | None = None
    kind: ClassVar[str] = "eval"

    def argv(self) -> list[str]:
        args = ["eval"] + (_option("--config", self.recipe) if self.recipe else [])
        args += [arg for o in self.overrides for arg in _option("--set", o)]
        for option in ("model", "run", "checkpoints", "output_dir"):
            value = getattr(self, option)
            args += _option(f"--{option.replace('_', '-')}", value) if value is not None else []
        return args

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> EvalJob:
        if a.run is not None and a.model is not None:
            raise ConfigError(f"--model {a.model} and --run {a.run}: evaluate a model folder, or a run's models, "
                              "not both (a run's base model is model.path in its config.yaml)")
        return cls(a.config, tuple(a.set), a.model, a.run, a.checkpoints, a.output_dir)

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> EvalJob:
        return cls.from_args(_parse("eval", add_eval_arguments, argv))

    def config(self) -> EvalJobConfig:
        """Defaults, then the run's settings (`run_settings`, when a run is named: --run, --set run= or the
        recipe's `run`), then the recipe, then the overrides and the options."""
        recipe = resolve_recipe(self.recipe)
        overrides = list(self.overrides) + [s for key in ("model", "run", "checkpoints", "output_dir")
                                            for s in literal_setting("model.path" if key == "model" else key,
                                                                     getattr(self, key))]
        cfg = load_config(EvalJobConfig, recipe, overrides)
        if cfg.run is None:
            return cfg
        return load_config(EvalJobConfig, recipe, overrides, base=run_settings(cfg.run))


@dataclass(frozen=True)
class BenchJob:
    """`hpcrlhf bench --suite SUITE --output DIR [--model PATH] [--reward-model PATH] [--systems A,B]
    [--steps N]` (the options a cluster benchmark job may set)."""

    suite: str
    output: str | None = None
    model: str | None = None
    reward_model: str | None = None
    systems: str | None = None
    steps: int | None = None

    def argv(self) -> list[str]:
        args = ["bench", *_option("--suite", self.suite)] + (_option("--output", self.output) if self.output else [])
        for key in BENCH_SETTINGS:
            value = getattr(self, key)
            args += _option(f"--{key.replace('_', '-')}", value) if value is not None else []
        return args

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> BenchJob:
        a = _parse("bench", add_bench_arguments, argv)
        if not a.suite:
            raise ConfigError(f"a bench job names its suite (--suite NAME): hpcrlhf {' '.join(argv)}")
        return cls(a.suite, a.output, a.model, a.reward_model, a.systems, a.steps)

    @classmethod
    def from_settings(cls, suite: str, overrides: Sequence[str], output: str) -> BenchJob:
        """The job `hpcrlhf sbatch --kind bench SUITE --set model=PATH ...` asks for: the --set keys are
        the bench options model, reward_model, systems, steps."""
        given: dict = {}
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep or key not in BENCH_SETTINGS:
                raise ConfigError(f"--set {item}: a bench job takes --set KEY=VALUE with KEY one of "
                                  f"{', '.join(BENCH_SETTINGS)}")
            if key == "steps":
                try:
                    value = int(value)
                except ValueError:
                    raise ConfigError(f"--set {item}: steps is a whole number of measured steps, e.g. steps=5") from None
            given[key] = value
        return cls(suite, output, **given)


def job_from_argv(argv: Sequence[str]) -> TrainJob | EvalJob | BenchJob:
    """The job a cluster script runs (`hpcrlhf train ...`, `hpcrlhf eval ...` or `hpcrlhf bench ...`)."""
    if list(argv[:1]) == ["bench"]:
        return BenchJob.from_argv(argv)
    if list(argv[:1]) == ["eval"]:
        return EvalJob.from_argv(argv)
    return TrainJob.from_argv(argv)
