"""The `hpcrlhf` command: parse, build the config, hand over to the job. Nothing else lives here."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpcrlhf import __version__
from hpcrlhf.errors import ConfigError, HpcrlhfError

RECIPES = Path(__file__).parent / "recipes"


def resolve_recipe(spec: str | None) -> str | None:
    """A recipe is a YAML path, or the name of one shipped in hpcrlhf/recipes/ (without .yaml)."""
    if spec is None or Path(spec).exists():
        return spec
    shipped = RECIPES / f"{spec}.yaml"
    if shipped.exists():
        return str(shipped)
    names = ", ".join(sorted(p.stem for p in RECIPES.glob("*.yaml"))) or "none"
    raise ConfigError(f"--config: '{spec}' is neither a file nor a shipped recipe; shipped recipes: {names}")


def build_config(kind: str, recipe: str | None, overrides: list[str], output_dir: str | None):
    from hpcrlhf.config.loader import load_config
    from hpcrlhf.config.schema import JOB_CONFIGS

    overrides = list(overrides) + ([f"output_dir={output_dir}"] if output_dir else [])
    return load_config(JOB_CONFIGS[kind], resolve_recipe(recipe), overrides)


def cmd_train(args: argparse.Namespace) -> int:
    from hpcrlhf.signals import EXIT_REQUEUE
    from hpcrlhf.trainers import TRAINERS

    cfg = build_config(args.kind, args.config, args.set, args.output_dir)
    result = TRAINERS[args.kind](cfg)
    return EXIT_REQUEUE if result.get("status") == "stopped" else 0


def cmd_config(args: argparse.Namespace) -> int:
    from hpcrlhf.config.loader import describe, to_yaml
    from hpcrlhf.config.schema import JOB_CONFIGS

    if args.config or args.set:
        print(to_yaml(build_config(args.kind, args.config, args.set, None)), end="")
    else:
        print(describe(JOB_CONFIGS[args.kind]), end="")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from hpcrlhf.demo import run_demo

    return run_demo(Path(args.output_dir), fresh=args.fresh)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="RECIPE",
                   help="YAML recipe overriding the defaults (a path, or a shipped recipe name)")
    p.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting, e.g. --set optim.lr=3e-4 (repeatable; applied after the recipe)")


def build_parser() -> argparse.ArgumentParser:
    from hpcrlhf.config.schema import JOB_CONFIGS

    kinds = sorted(JOB_CONFIGS)
    parser = argparse.ArgumentParser(
        prog="hpcrlhf",
        description="RLHF pipelines (SFT, RM, DPO, KTO, PPO) on shared HPC clusters.",
        epilog="Settings come from typed defaults, then --config RECIPE, then --set KEY=VALUE. "
               "`hpcrlhf config KIND` lists every setting with its documentation.",
    )
    parser.add_argument("--version", action="version", version=f"hpcrlhf {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="run a training job on this machine (or under torchrun/srun/mpirun)",
                       description="Run a training job. Launch under torchrun, the deepspeed launcher, srun "
                                   "or mpirun for several ranks. Exit status 3 means the job stopped on a "
                                   "signal (SIGUSR1/SIGTERM) after checkpointing: run it again to resume.")
    p.add_argument("kind", choices=kinds, help="job kind")
    _add_config_args(p)
    p.add_argument("--output-dir", "-o", metavar="DIR", help="run folder (same as --set output_dir=DIR)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("config", help="print a job kind's settings with their documentation",
                       description="Print every setting of a job kind with its default and documentation, "
                                   "or, with --config/--set, the resolved config that `train` would use.")
    p.add_argument("kind", choices=kinds, help="job kind")
    _add_config_args(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("demo", help="the main job on the embedded defaults (tiny bundled model and task)",
                       description="Fine-tune the bundled tiny model on the bundled arithmetic task and "
                                   "print its task score before and after. Needs no network, GPU or cluster.")
    p.add_argument("--output-dir", "-o", default="runs/demo", metavar="DIR", help="demo run folder (default: runs/demo)")
    p.add_argument("--fresh", action="store_true", help="delete the demo folder first instead of resuming it")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except HpcrlhfError as e:
        print(f"hpcrlhf: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
