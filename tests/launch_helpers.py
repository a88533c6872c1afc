"""Running the real `hpcrlhf` entry point in subprocesses (plain or under torchrun), and library calls
in a fresh process."""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tests.cli_forks import ROOT, warm_process


def cli_command(args: list[str], nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "hpcrlhf", *args]
    # --standalone: torchrun's store binds a free port itself (no race with a port chosen here)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "hpcrlhf", *args]


DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
"""torch.distributed's rendezvous variables: a test that trained in this process set them (a world
of one, whose store still holds MASTER_PORT); a CLI run inherits none of them unless given."""


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment for a CLI run: offline hub, unbuffered output, no rendezvous
    variables of this process; `extra` overrides any of it (HF_HUB_OFFLINE included)."""
    inherited = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env = {**inherited, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_cli(args: list[str], *, nproc: int = 1, timeout: float = 600, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`hpcrlhf ARGS` (under torchrun with `nproc` ranks), as a finished process. A single process
    is forked from a warm one where it can behave exactly like a fresh one (tests/cli_forks.py)."""
    full_env = cli_env(**(env or {}))
    warm = warm_process(cli_env()) if nproc == 1 else None
    if warm is not None and warm.accepts(full_env):
        with tempfile.TemporaryDirectory(prefix="hpcrlhf-cli-") as folder:
            status, out, err = warm.run(args, full_env, Path(folder), timeout)
        proc = subprocess.CompletedProcess(cli_command(args), status, out, err)
    else:
        proc = subprocess.run(cli_command(args, nproc), cwd=ROOT, env=full_env, capture_output=True, text=True,
                              timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"hpcrlhf {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


HPCRLHF_LINE = re.compile(r"\[\d\d:\d\d:\d\d hpcrlhf\] |hpcrlhf[: ]")
"""How each line hpcrlhf itself writes to the terminal starts: its log lines (the progress too, outside
a terminal), its errors and notes (`hpcrlhf: error: ...`, `hpcrlhf COMMAND: error: ...`)."""


def foreign_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The non-empty lines a CLI run wrote to its terminal (stdout and stderr) that are not hpcrlhf's."""
    return [line for text in (proc.stdout, proc.stderr) for line in text.splitlines()
            if line.strip() and not HPCRLHF_LINE.match(line)]


def stop_after(args: list[str], out: Path, step: int, key: str = "train/loss") -> int:
    """Run `hpcrlhf ARGS`, send it the stop signal (SIGUSR1: what Slurm sends before a time limit)
    once a metrics row of step >= `step` with `key` is logged; the checkpointed step it stopped at."""
    import signal
    import time

    from hpcrlhf.run.metrics import read_metrics

    proc = subprocess.Popen(cli_command(args), cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    def logged() -> bool:
        return (out / "metrics.jsonl").exists() and any(m["step"] >= step for m in read_metrics(out) if key in m)

    deadline = time.monotonic() + 300
    while not logged() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 3, log[-3000:]
    return int((out / "checkpoints" / "latest").read_text().strip().split("_")[1])


def rewind_to(out: Path, step: int) -> None:
    """Make a finished run's folder the one a stop right after the checkpoint of `step` leaves: the later
    checkpoints gone, `latest` naming that step's, no summary.json (a finished run's rerun trains nothing).
    metrics.jsonl is left whole: the resumed run drops its rows past the checkpoint, as after a real stop."""
    import shutil

    checkpoints = out / "checkpoints"
    for later in checkpoints.glob("step_*"):
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    (checkpoints / "latest").write_text(f"step_{step:06d}")
    (out / "summary.json").unlink()


def in_a_fresh_process(fn, *args, timeout: float = 300):
    """fn(*args) in a spawned process, as a user's `hpcrlhf` command would run it (this one may hold a
    Ray driver: one per process). Returns fn's result (picklable) or raises its exception."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result(timeout=timeout)
