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
    from hpcrlhf.config.loader import describe, load_config, to_yaml
    from hpcrlhf.config.schema import JOB_CONFIGS, GenerateConfig

    cls = GenerateConfig if args.kind == "generate" else JOB_CONFIGS[args.kind]
    if args.config or args.set:
        print(to_yaml(load_config(cls, resolve_recipe(args.config), args.set)), end="")
    else:
        print(describe(cls), end="")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from hpcrlhf.config.loader import load_config
    from hpcrlhf.config.schema import GenerateConfig
    from hpcrlhf.inference import run_generate

    overrides = list(args.set)
    overrides += [f"model.path={args.model}"] if args.model else []
    overrides += [f"output={args.output}"] if args.output else []
    run_generate(load_config(GenerateConfig, resolve_recipe(args.config), overrides))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from hpcrlhf.inference import chat

    return chat(args.model, backend=args.backend, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                greedy=args.greedy, system=args.system, history=not args.no_history, raw=args.raw, seed=args.seed)


def cmd_plan(args: argparse.Namespace) -> int:
    from hpcrlhf.placement import build_node_map

    node_map = build_node_map(build_config("ppo", args.recipe, args.set, None), args.nodes, args.gpus_per_node)
    print(node_map.to_json() if args.json else node_map.render(), end="")
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
        description="RLHF pipelines (SFT, RM, DPO, KTO, CSFT, PPO/GRPO/RLOO/REINFORCE++, rejection sampling) on shared HPC clusters.",
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
    p.add_argument("kind", choices=kinds + ["generate"], help="job kind")
    _add_config_args(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("generate", help="batch generation over a dataset, optionally scored, to JSONL",
                       description="Answer every prompt of a dataset (data.train_path, or the bundled task's held-out "
                                   "prompts) and write one JSON line per response; with a `reward` section each "
                                   "response is also scored. `hpcrlhf config generate` lists the settings.")
    _add_config_args(p)
    p.add_argument("--model", "-m", metavar="PATH", help="model folder (same as --set model.path=PATH)")
    p.add_argument("--output", "-o", metavar="FILE", help="JSONL file to write (same as --set output=FILE)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with a model interactively (reads stdin)",
                       description="Type a message, get the model's answer. /reset forgets the conversation, /quit "
                                   "(or Ctrl-D) leaves. Models with a chat template see the whole conversation.")
    p.add_argument("--model", "-m", required=True, metavar="PATH", help="model folder (e.g. runs/ppo/model)")
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="generation engine (default: hf)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="longest answer (default: 128)")
    p.add_argument("--temperature", type=float, default=0.7, metavar="T", help="sampling temperature (default: 0.7)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    p.add_argument("--system", metavar="TEXT", help="system message (models with a chat template)")
    p.add_argument("--no-history", action="store_true", help="answer each message on its own")
    p.add_argument("--raw", action="store_true",
                   help="send each message as a plain prompt, without the chat template (models fine-tuned "
                        "without one, such as those trained on the bundled task)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("plan", help="print the node map of a PPO recipe on a cluster allocation (no GPUs needed)",
                       description="Place a PPO job's roles (actor, critic, reference, reward models, vLLM engines) "
                                   "on an allocation of nodes x GPUs as the recipe's `placement` section says, check "
                                   "the layout (GPU counts, TP groups, batch splits, memory per GPU) and print it. "
                                   "Exit status 2 lists every problem with its fix.")
    p.add_argument("recipe", metavar="RECIPE", help="PPO recipe: a YAML path, or a shipped recipe name (ppo-7b)")
    p.add_argument("--nodes", type=int, metavar="N", help="nodes of the allocation (default: placement.nodes)")
    p.add_argument("--gpus-per-node", type=int, metavar="G",
                   help="GPUs per node (default: placement.gpus_per_node)")
    p.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting, e.g. --set placement.vllm.engines=8 (repeatable)")
    p.add_argument("--json", action="store_true", help="print the node map as JSON")
    p.set_defaults(func=cmd_plan)

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
