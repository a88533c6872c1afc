"""The `hpcrlhf` command: parse, build the config, hand over to the job. Nothing else lives here.

A command imports the modules only it needs when it runs (`cmd_*`), each import with what it would
cost every command's start-up, `--help` included, at the top of this module (`python -X importtime
-m hpcrlhf --help`: 140-190 ms of imports here): torch for some, 25-150 ms each for the Ray session,
the node map, the benchmark and the Slurm modules (140 ms together). What the parser loads anyway
(the configs) is imported at the top. tests/test_layering.py checks that `--help`, `config` and
`plan` import no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from hpcrlhf import __version__
from hpcrlhf.config.jobspec import (EvalJob, TrainJob, add_bench_arguments, add_config_arguments, add_eval_arguments,
                                    add_train_arguments, build_config, literal_setting, path_text, resolve_recipe)
from hpcrlhf.config.loader import describe, load_config, to_yaml
from hpcrlhf.config.schema import JOB_CONFIGS, GenerateConfig, ServeRewardConfig
from hpcrlhf.errors import ConfigError, HpcrlhfError, WorkerLost
from hpcrlhf.logs import route_third_party, stop_routing_third_party
from hpcrlhf.run.signals import EXIT_INTERRUPTED, EXIT_LOST, EXIT_REQUEUE, release_interrupt
from hpcrlhf.trainers import TRAINERS


def cmd_train(args: argparse.Namespace) -> int:
    from hpcrlhf.cluster.session import isolate_local_cluster  # start-up: +80 ms

    cfg = TrainJob.from_args(args).config()
    isolate_local_cluster(args.kind, cfg)
    from hpcrlhf.engines.distributed import leave_process_group  # torch: only once isolated (a single thread)

    result = TRAINERS[args.kind](cfg)
    leave_process_group()  # this process's one job is over
    return EXIT_REQUEUE if result.get("status") == "stopped" else 0


def cmd_config(args: argparse.Namespace) -> int:
    from hpcrlhf.config.reference import config_classes, markdown  # start-up: +4 ms

    cls = config_classes()[args.kind]
    cfg = load_config(cls, resolve_recipe(args.config), args.set) if args.config or args.set else None
    if args.markdown:
        print(markdown(args.kind, cfg), end="")
    else:
        print(describe(cls) if cfg is None else to_yaml(cfg), end="")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from hpcrlhf.inference import run_generate  # torch, transformers

    overrides = list(args.set) + literal_setting("model.path", args.model) + literal_setting("output", args.output)
    run_generate(load_config(GenerateConfig, resolve_recipe(args.config), overrides))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    cfg = EvalJob.from_args(args).config()
    from hpcrlhf.evaluation import run_eval  # torch, transformers

    result = run_eval(cfg)
    from hpcrlhf.engines.distributed import leave_process_group  # torch

    leave_process_group()
    return EXIT_REQUEUE if result.get("status") == "stopped" else 0


def cmd_serve_reward(args: argparse.Namespace) -> int:
    from hpcrlhf.rewards.server import run_server  # torch, transformers, aiohttp

    overrides = list(args.set) + literal_setting("output_dir", args.output_dir)
    return run_server(load_config(ServeRewardConfig, resolve_recipe(args.config), overrides))


def cmd_chat(args: argparse.Namespace) -> int:
    from hpcrlhf.inference import Utf8Lines, chat  # torch, transformers

    return chat(args.model, backend=args.backend, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                greedy=args.greedy, system=args.system, history=not args.no_history, raw=args.raw, seed=args.seed,
                tools=args.tool, tool_parser=args.tool_parser, max_tool_rounds=args.max_tool_rounds,
                tool_timeout_s=args.tool_timeout, environment=args.environment, environment_args=args.environment_args,
                max_turns=args.max_turns, stdin=Utf8Lines(sys.stdin.buffer))


def _number(text: str, kind: type, what: str, fix: str) -> int | float:
    """argparse type: `text` as a finite `kind` (int or float) above 0, else an error naming `what` and `fix`."""
    import math

    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}: {fix}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not {what}: {fix}")
    return value


def _new_tokens(text: str) -> int:
    return _number(text, int, "a number of tokens to generate", "use 1 or more, e.g. 128")


def _temperature(text: str) -> float:
    return _number(text, float, "a sampling temperature", "use a finite number above 0, e.g. 0.7 (lower: more "
                                                           "predictable; --greedy for the most likely token each time)")


def _rounds(text: str) -> int:
    return _number(text, int, "a number of tool rounds", "use 1 or more, e.g. 4")


def _seconds(text: str) -> float:
    return _number(text, float, "a number of seconds", "use a finite number above 0, e.g. 10")


def _turns(text: str) -> int:
    return _number(text, int, "a number of model turns", "use 1 or more, e.g. 4")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is no JSON ({e.msg}); use an object, e.g. '{{\"high\": 50}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is no JSON object; use one, e.g. '{{\"high\": 50}}'")
    return value


def cmd_plan(args: argparse.Namespace) -> int:
    from hpcrlhf.placement import build_node_map, render_text  # start-up: +40 ms

    cfg = build_config("ppo", args.recipe, args.set, None)
    node_map = build_node_map(cfg, args.nodes, args.gpus_per_node, args.cpus_per_node)
    schedule = None
    if args.schedule:
        from hpcrlhf.bench.schedule import HARDWARE, LengthDist, plan_schedules, render_schedules  # start-up: +10 ms

        try:
            schedule = plan_schedules(cfg, node_map, HARDWARE[args.hardware], LengthDist.parse(args.lengths))
        except ValueError as e:
            raise ConfigError(f"--schedule: {e}") from None
    if args.json and schedule is not None:
        print(json.dumps({**json.loads(node_map.to_json()), "schedule": schedule}, indent=2))
        return 0
    if args.json:
        print(node_map.to_json(), end="")
        return 0
    print(render_text(node_map), end="")
    if schedule is not None:
        print("\n" + render_schedules(schedule), end="")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from hpcrlhf.bench.suites import SUITES, get_suite  # start-up: +6 ms

    if args.list or not args.suite:
        for suite in SUITES.values():
            print(f"{suite.name:10s} {suite.about}\n{'':10s} systems: {', '.join(s.name for s in suite.systems)}")
        return 0 if args.list else 2
    suite = get_suite(args.suite).with_model(args.model, args.reward_model)
    if args.steps is not None:
        if args.steps < 1:
            raise ConfigError(f"--steps: {args.steps} measured steps; use at least 1")
        suite = replace(suite, steps=args.steps)
    names = args.systems.split(",") if args.systems else [s.name for s in suite.systems]
    if "dschat" in names and not args.dschat_dir:
        raise ConfigError("--systems: dschat (real DeepSpeed-Chat) needs --dschat-dir, a DeepSpeedExamples checkout")
    systems = [suite.system(n) for n in names if n != "dschat"]
    dschat = None
    if args.dschat_dir:
        from hpcrlhf.bench.dschat import DSChat  # start-up: +105 ms

        dschat = DSChat.from_args(args.dschat_dir, critic=args.dschat_critic, suite=suite)
    from hpcrlhf.bench.runner import run_suite  # start-up: +130 ms

    out = Path(args.output or f"runs/bench-{suite.name}")
    doc = run_suite(suite, out, systems=systems, dschat=dschat)
    print((out / "results.md").read_text(), end="")
    print(f"results: {out / 'results.json'}; plots: {', '.join(str(out / p) for p in doc['plots'])}")
    return 1 if any(s["status"] == "failed" for s in doc["systems"]) else 0  # a skipped system is said, not failed


def cmd_demo(args: argparse.Namespace) -> int:
    from hpcrlhf.demo import run_demo  # torch, transformers

    return run_demo(Path(args.output_dir), fresh=args.fresh)


SLURM_ARGS = ("nodes", "gpus_per_node", "launcher", "partition", "account", "qos", "time", "job_name", "cpus_per_gpu",
              "container", "binds", "cache_dir", "python", "signal_lead_s", "max_requeues")


def _cluster_job(args: argparse.Namespace):
    from hpcrlhf.hpc.job import cluster_job  # start-up: +150 ms

    job = cluster_job(args.kind, args.recipe, args.set, args.output_dir,
                      **{k: getattr(args, k) for k in SLURM_ARGS})
    for note in job.notes:
        print(f"hpcrlhf: note: {note}", file=sys.stderr)
    return job


def cmd_sbatch(args: argparse.Namespace) -> int:
    from hpcrlhf.hpc.sbatch import render_sbatch  # start-up: +25 ms

    job = _cluster_job(args)
    text = render_sbatch(job.argv, job.options)
    if args.print:
        print(text, end="")
        return 0
    from hpcrlhf.run.files import make_folders, replace_file  # start-up: +9 ms

    script = Path(args.script or Path(job.options.run_dir) / f"{args.kind}.sbatch")
    make_folders(script.parent, "--script" if args.script else "--output-dir")
    replace_file(script, text)
    print(f"wrote {script}\nsubmit it with: sbatch {script}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from hpcrlhf.hpc.submit import follow, submit  # start-up: +110 ms

    job = _cluster_job(args)
    handle = submit(job.argv, job.options)
    print(f"submitted job {handle.job_id} (run folder {job.options.run_dir}; Slurm log in its submitit/ folder)")
    return follow(handle, job.options.run_dir, poll_s=args.poll_s) if args.follow else 0


def cmd_image(args: argparse.Namespace) -> int:
    import shutil
    import subprocess

    from hpcrlhf.hpc.image import check_image  # start-up: +6 ms

    if shutil.which("apptainer") is None:
        raise ConfigError("image check: apptainer is not on this host's PATH: run the check where Apptainer is "
                          "installed (a login or compute node)")
    for note in check_image(str(Path(args.image).resolve()), args.python):
        print(f"hpcrlhf: note: {note}", file=sys.stderr)
    print(f"{args.image}: a readable SIF image with hpcrlhf; running its smoke test (apptainer test)", flush=True)
    return subprocess.run(["apptainer", "test", *(["--nv"] if args.nv else []), args.image]).returncode


def _add_slurm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", type=path_text, metavar="RECIPE", nargs="?",
                   help="recipe: a YAML path or a shipped recipe name")
    p.add_argument("--kind", "-k", default="ppo", help="job kind (default: ppo)")
    p.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting of the job (repeatable)")
    p.add_argument("--output-dir", "-o", type=path_text, metavar="DIR",
                   help="run folder on shared storage (default: runs/KIND-RECIPE, made absolute)")
    p.add_argument("--nodes", "-N", type=int, metavar="N",
                   help="nodes (default: the recipe's placement.nodes for Ray jobs, else 1)")
    p.add_argument("--gpus-per-node", type=int, metavar="G",
                   help="GPUs per node (default: the recipe's placement.gpus_per_node for Ray jobs, else 1)")
    p.add_argument("--launcher", choices=["ray", "mpi"],
                   help="ray (PPO with placement.runtime=ray; the default for it) or mpi (one rank per GPU)")
    p.add_argument("--partition", "-p", help="Slurm partition")
    p.add_argument("--account", "-A", help="Slurm account")
    p.add_argument("--qos", help="Slurm QOS")
    p.add_argument("--time", "-t", help="time limit in Slurm's format (default: 24:00:00)")
    p.add_argument("--job-name", "-J", help="Slurm job name (default: hpcrlhf-KIND)")
    p.add_argument("--cpus-per-gpu", type=int, metavar="C", help="CPUs per GPU")
    p.add_argument("--container", type=path_text, metavar="IMAGE.sif",
                   help="run every step inside this Apptainer image (apptainer/build.sh builds one)")
    p.add_argument("--bind", dest="binds", action="append", type=path_text, metavar="SRC[:DST]",
                   help="also bind this folder into the container (repeatable; the run folder, caches and the "
                        "recipe's local model/data folders are bound already)")
    p.add_argument("--cache-dir", type=path_text, metavar="DIR", help="shared cache folder (HF_HOME, HPCRLHF_CACHE)")
    p.add_argument("--python", type=path_text, metavar="PATH",
                   help="Python on the nodes (default: this one; 'python' in a container)")
    p.add_argument("--signal-lead-s", type=int, metavar="S",
                   help="seconds between the time-limit signal and the kill (default: 300)")
    p.add_argument("--max-requeues", type=int, metavar="N",
                   help="requeue from the last checkpoint at most N times (default: 3)")


def build_parser() -> argparse.ArgumentParser:
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
                                   "signal (SIGUSR1/SIGUSR2/SIGTERM, or Ctrl-C once) after checkpointing: run it "
                                   "again to resume. A second Ctrl-C stops at once (exit status 130).")
    add_train_arguments(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("config", help="print a job kind's settings with their documentation",
                       description="Print every setting of a job kind with its default and documentation, "
                                   "or, with --config/--set, the resolved config that `train` would use.")
    p.add_argument("kind", choices=kinds + ["generate", "eval", "serve-reward"], help="job kind")
    add_config_arguments(p)
    p.add_argument("--markdown", action="store_true",
                   help="print a markdown page instead (key, type, default or value, documentation), as in "
                        "docs/settings/")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("generate", help="batch generation over a dataset, optionally scored, to JSONL",
                       description="Answer every prompt of a dataset (data.train_path, or the bundled task's held-out "
                                   "prompts) and write one JSON line per response; with a `reward` section each "
                                   "response is also scored. `hpcrlhf config generate` lists the settings.")
    add_config_arguments(p)
    p.add_argument("--model", "-m", type=path_text, metavar="PATH", help="model folder (same as --set model.path=PATH)")
    p.add_argument("--output", "-o", type=path_text, metavar="FILE",
                   help="JSONL file to write (same as --set output=FILE)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="evaluate a model, or a run's checkpoints, on benchmark prompts (pass@k, maj@n)",
                       description="Answer the held-out prompts (or `datasets`) with a model folder (--model) or with "
                                   "models of a run (--run, --checkpoints), greedily or with eval.samples_per_prompt "
                                   "samples each, and score the answers with the task and eval.metrics: mean@n, pass@k "
                                   "and maj@n per dataset, in OUTPUT_DIR/results.json, results.md and results.png. "
                                   "Interrupted (a signal: exit 3), the same command resumes. `hpcrlhf config eval` "
                                   "lists the settings; `hpcrlhf sbatch --kind eval` runs it on Slurm.")
    add_eval_arguments(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("serve-reward", help="serve reward models and rules over HTTP, for jobs elsewhere to ask",
                       description="Serve `reward.sources` (reward model folders, built-in rules, package.module:"
                                   "function) over the reward-server protocol (docs/rewards.md): on loopback, with a "
                                   "token (written to OUTPUT_DIR/token unless token_file is set), until SIGTERM or "
                                   "Ctrl-C. OUTPUT_DIR/server.json says where. `hpcrlhf config serve-reward` lists "
                                   "the settings.")
    add_config_arguments(p)
    p.add_argument("--output-dir", "-o", type=path_text, metavar="DIR",
                   help="where server.json (and the token) go (same as --set output_dir=DIR)")
    p.set_defaults(func=cmd_serve_reward)

    p = sub.add_parser("chat", help="chat with a model interactively (reads stdin)",
                       description="Type a message, get the model's answer. A message is one line; end a line with "
                                   "a backslash to go on on the next, or put several lines (a pasted text) between "
                                   "two lines of three double quotes (\"\"\"). /reset forgets the conversation, /quit "
                                   "(or Ctrl-D) leaves. Piped input works the same way, a message (or command) per "
                                   "line. Models with a chat template see the whole conversation.")
    p.add_argument("--model", "-m", required=True, type=path_text, metavar="PATH",
                   help="model folder (e.g. runs/ppo/model)")
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="generation engine (default: hf)")
    p.add_argument("--max-new-tokens", type=_new_tokens, default=128, metavar="N", help="longest answer (default: 128)")
    p.add_argument("--temperature", type=_temperature, default=0.7, metavar="T",
                   help="sampling temperature (default: 0.7)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    p.add_argument("--system", metavar="TEXT", help="system message (models with a chat template)")
    p.add_argument("--no-history", action="store_true", help="answer each message on its own")
    p.add_argument("--raw", action="store_true",
                   help="send each message as a plain prompt, without the chat template (models fine-tuned "
                        "without one, such as those trained on the bundled task)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--tool", action="append", default=[], metavar="MODULE:FUNCTION",
                   help="a typed Python function with a docstring the model may call (repeat for several; as "
                        "agent.tools: docs/agents.md); its calls are run and answered, shown as tool lines")
    p.add_argument("--tool-parser", default="hermes", metavar="NAME",
                   help="how tool calls are read from the model's turn: hermes (<tool_call>{json}</tool_call>, "
                        "default) or package.module:function")
    p.add_argument("--max-tool-rounds", type=_rounds, metavar="N",
                   help="tool rounds per message before the model's turn is shown as it is (default: 4)")
    p.add_argument("--tool-timeout", type=_seconds, default=30.0, metavar="S",
                   help="seconds one tool call (with --environment: one environment step) may take; a slower one is "
                        "answered with a timeout error (default: 30)")
    p.add_argument("--environment", metavar="MODULE:CLASS",
                   help="an environment (as agent.environment: docs/agents.md): each message is then a row an episode "
                        "starts from (a JSON object, or the prompt), run to its end and shown with its outcome")
    p.add_argument("--environment-args", type=_json_object, metavar="JSON",
                   help="the environment's keyword arguments, a JSON object (as agent.environment_args)")
    p.add_argument("--max-turns", type=_turns, metavar="N",
                   help="model turns per episode with --environment (default: 4)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("plan", help="print the node map of a PPO recipe on a cluster allocation (no GPUs needed)",
                       description="Place a PPO job's roles (actor, critic, reference, reward models, vLLM engines) "
                                   "on an allocation of nodes x GPUs as the recipe's `placement` section says, check "
                                   "the layout (GPU counts, TP groups, batch splits, memory per GPU) and print it. "
                                   "Exit status 2 lists every problem with its fix.")
    p.add_argument("recipe", type=path_text, metavar="RECIPE",
                   help="PPO recipe: a YAML path, or a shipped recipe name (ppo-7b)")
    p.add_argument("--nodes", type=int, metavar="N", help="nodes of the allocation (default: placement.nodes)")
    p.add_argument("--gpus-per-node", type=int, metavar="G",
                   help="GPUs per node (default: placement.gpus_per_node)")
    p.add_argument("--cpus-per-node", type=int, metavar="C",
                   help="CPU cores per node, checked against the CPU work the map puts on each node: rule servers "
                        "and agent environment threads (default: placement.cpus_per_node; unset: not checked)")
    p.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting, e.g. --set placement.vllm.engines=8 (repeatable)")
    p.add_argument("--json", action="store_true", help="print the node map as JSON")
    p.add_argument("--schedule", action="store_true",
                   help="also predict the step under long-tail response lengths, synchronous and k = 1, 2, 4 steps "
                        "ahead with and without partial rollouts (the step-time model, hpcrlhf/bench/schedule.py)")
    p.add_argument("--hardware", choices=("a800", "h100"), default="a800", help="GPUs of --schedule (default a800)")
    p.add_argument("--lengths", default="lognormal", metavar="DIST",
                   help="response lengths of --schedule: lognormal (median limit/8, sigma 1), "
                        "lognormal:MEDIAN_FRAC,SIGMA or fixed (default lognormal)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("sbatch", help="write the sbatch script of a cluster job (Ray PPO, or MPI ranks)",
                       description="Write a complete sbatch script: #SBATCH header, offline environment, a check "
                                   "that the job fits the allocation, the Ray bootstrap and driver (or MPI ranks), "
                                   "teardown, and requeue from the last checkpoint on a time limit. The job is "
                                   "checked against --nodes/--gpus-per-node before anything is written.")
    _add_slurm_args(p)
    p.add_argument("--script", type=path_text, metavar="FILE",
                   help="where to write the script (default: RUN_DIR/KIND.sbatch)")
    p.add_argument("--print", action="store_true", help="print the script instead of writing it")
    p.set_defaults(func=cmd_sbatch)

    p = sub.add_parser("submit", help="submit a cluster job through submitit and follow it",
                       description="Submit the job `hpcrlhf sbatch` would write through submitit, show its latest "
                                   "metrics line while it runs, and requeue it from its last checkpoint on a time "
                                   "limit or preemption (up to --max-requeues times).")
    _add_slurm_args(p)
    p.add_argument("--no-follow", dest="follow", action="store_false", help="return once the job is queued")
    p.add_argument("--poll-s", type=_seconds, default=10.0, metavar="S",
                   help="seconds between checks of the job's state and latest metrics (default: 10)")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("image", help="check an Apptainer image before using it with --container",
                       description="Check that IMAGE is a readable SIF file whose Python imports hpcrlhf, then run "
                                   "its smoke test (`apptainer test`: the stack imports, a tiny model generates).")
    p.add_argument("action", choices=["check"], help="what to do with the image")
    p.add_argument("image", type=path_text, metavar="IMAGE.sif", help="the image file")
    p.add_argument("--python", default="python", type=path_text, metavar="PATH",
                   help="the image's Python (default: python)")
    p.add_argument("--nv", action="store_true", help="test with the host's NVIDIA GPUs (apptainer --nv)")
    p.set_defaults(func=cmd_image)

    p = sub.add_parser("bench", help="PPO throughput of hpcrlhf, a DeepSpeed-Chat-style baseline and TRL, same run",
                       description="Run every system of a benchmark suite (hpcrlhf distributed and colocated, the "
                                   "DeepSpeed-Chat-style baseline, TRL's GRPOTrainer when trl is installed, real "
                                   "DeepSpeed-Chat with --dschat-dir) on the same "
                                   "models, prompts, fixed lengths and hardware, one after the other, and write "
                                   "results.json, results.md and PNG plots. --list shows the suites.")
    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="the main job on the embedded defaults (tiny bundled model and task)",
                       description="Fine-tune the bundled tiny model on the bundled arithmetic task and "
                                   "print its task score before and after. Needs no network, GPU or cluster.")
    p.add_argument("--output-dir", "-o", default="runs/demo", type=path_text, metavar="DIR",
                   help="demo run folder (default: runs/demo)")
    p.add_argument("--fresh", action="store_true", help="delete the demo folder first instead of resuming it")
    p.set_defaults(func=cmd_demo)
    return parser


RUN_COMMANDS = ("train", "demo", "eval")
"""Commands that write into run folders: the libraries' output goes to the run's third_party.log."""


def main(argv: list[str] | None = None) -> int:
    """The `hpcrlhf` program (argv None: sys.argv), or a call of it in a caller's process (argv given:
    a test, a script), which gets its own logging back when the call returns (hpcrlhf.logs)."""
    code = _main(argv)
    if argv is None and (int(os.environ.get("WORLD_SIZE", "1")) > 1 or code == EXIT_LOST):
        exit_rank(code)  # (EXIT_LOST: what hung, a request to a reward server, say, may hold a thread)
    return code


def exit_rank(code: int) -> None:
    """End a rank of a multi-process job (torchrun, srun: WORLD_SIZE > 1) whose work is over: exit handlers
    run and output flushed, then the process ends without the interpreter's teardown. Destroying library
    objects that still hold C++ threads there aborted finished ranks now and then ("terminate called without
    an active exception", exit -6: two-rank ZeRO-3 runs, even after `leave_process_group`), and torchrun then
    failed a job whose checkpoint, model and summary were all written."""
    import atexit

    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")  # an MPI launcher's rank (hpcrlhf.hpc.mpi): MPI ends at the interpreter's
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():  # exit, which is skipped here
        mpi.Finalize()  # (mpirun and srun fail a rank that ends without it)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone
            pass
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if args.command in ("sbatch", "submit"):
            return _unknown_options(parser, args.command, unknown)
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        route_third_party(run_folder_follows=args.command in RUN_COMMANDS)
        return args.func(args)
    except HpcrlhfError as e:
        print(f"hpcrlhf: error: {e}", file=sys.stderr)
        return EXIT_LOST if isinstance(e, WorkerLost) else 2
    except KeyboardInterrupt:  # Ctrl-C before a run could checkpoint, or twice (hpcrlhf.run.signals)
        rerun = ("; stopped at once, without a new checkpoint: the same command resumes from the last one (if any)"
                 if args.command == "train" else "")
        print(f"\nhpcrlhf: interrupted (Ctrl-C){rerun}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        release_interrupt()
        if argv is not None:
            stop_routing_third_party()


def _unknown_options(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> int:
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    valid = sorted(o for a in sub._actions for o in a.option_strings if o.startswith("--"))
    for opt in [u for u in unknown if u.startswith("-")] or unknown:
        close = difflib.get_close_matches(opt.split("=")[0], valid, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"hpcrlhf {command}: error: unknown argument {opt}{hint}", file=sys.stderr)
    print(f"valid options: {' '.join(valid)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
