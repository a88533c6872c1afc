"""Jobs rendered by `hpcrlhf sbatch` for the local Slurm cluster, and reading their results."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from hpcrlhf.run.metrics import read_metrics
from tests.launch_helpers import run_cli

SFT = ["--set", "train.max_steps=60", "--set", "train.global_batch_size=32", "--set", "train.micro_batch_size=16",
       "--set", "log.every_steps=5", "--set", "eval.every_steps=0", "--set", "eval.score_prompts=32",
       "--set", "task.eval_size=64", "--set", "task.train_size=4000", "--set", "log.backends=[]",
       "--set", "log.progress=false"]

TRACKED = ["--set", "log.backends=[mlflow,wandb]", "--set", "log.wandb.mode=offline"]
"""A requeued job that also logs to MLflow and W&B (what it trains is the same: `log.` only)."""


def render(run: Path, *args: str) -> Path:
    out = run_cli(["sbatch", *args, "-o", str(run), "--time", "30"]).stdout
    script = run / f"{args[args.index('--kind') + 1] if '--kind' in args else 'ppo'}.sbatch"
    assert f"wrote {script}" in out
    return script


def run_rendered(slurm_cluster, run: Path, *args: str, timeout: float = 900) -> tuple[Path, str, int]:
    """Render `hpcrlhf sbatch ARGS` into `run`, submit it, wait for it: (run folder, final state, job id)."""
    job = slurm_cluster.sbatch(render(run, *args))
    return run, slurm_cluster.wait(job, timeout), job


def attempts(run: Path) -> list[dict]:
    """The run's environment.jsonl: where each start of the run ran."""
    return [json.loads(line) for line in (run / "environment.jsonl").read_text().splitlines()]


def wait_for_step(run: Path, step: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not any(m.get("step", 0) >= step for m in (read_metrics(run) if (run / "metrics.jsonl").exists() else [])):
        assert time.monotonic() < deadline, f"{run} did not reach step {step} within {timeout:.0f} s"
        time.sleep(0.5)


def losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["train/loss"] for m in read_metrics(run) if "train/loss" in m}


def slurm_log(run: Path, job: int) -> str:
    return (run / f"slurm-{job}.out").read_text()


def kill_task(job: int, task: int, *argv: str, sig: int = signal.SIGKILL) -> list[int]:
    """Send `sig` (SIGKILL; SIGSTOP: a rank that hangs alive) to the processes of task `task` of the
    job's steps whose command line holds `argv` (default: `-m hpcrlhf.hpc.mpi`; the test cluster's
    nodes share this host, so its /proc shows every node's tasks). Returns their pids."""
    want = {f"SLURM_JOB_ID={job}".encode(), f"SLURM_PROCID={task}".encode()}
    words = "\0".join(argv or ("-m", "hpcrlhf.hpc.mpi")).encode() + b"\0"
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and words in (proc / "cmdline").read_bytes() \
                    and want <= set((proc / "environ").read_bytes().split(b"\0")):
                os.kill(int(proc.name), sig)
                pids.append(int(proc.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    assert pids, f"no process of task {task} of job {job} runs {' '.join(argv)}"
    return pids
