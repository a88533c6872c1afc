"""Hangs end as a clear, requeueable exit (issue 41, the watchdog on the local runtime): the real CLI with a
method that never returns (tests/trainers/faults.py `hang`) ends within its deadline with status 4, the
hung phase and the stacks named; a hang before the update keeps the steps done in a checkpoint, and the
same command resumes from it to the end."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from hpcrlhf.run.metrics import read_metrics
from tests.launch_helpers import ROOT, cli_env, run_cli

WATCH = ["--set", "watchdog.floor_s=3", "--set", "watchdog.factor=2", "--set", "watchdog.first_s=120",
         "--set", "watchdog.grace_s=30"]
PPO = ["--set", "train.max_steps=4", "--set", "rollout.prompts_per_step=8", "--set", "rollout.samples_per_prompt=2",
       "--set", "train.global_batch_size=16", "--set", "train.micro_batch_size=16", "--set", "ppo.advantage_estimator=grpo",
       "--set", "eval.every_steps=0", "--set", "eval.score_prompts=8", "--set", "log.every_steps=1",
       "--set", "log.backends=[]", "--set", "checkpoint.every_steps=1", "--set", "checkpoint.keep_last=5"]


def hang(method: str, call: int, args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tests.trainers.faults", "hang", method, str(call), "--", *args],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600)
    return proc, time.monotonic() - started


def test_a_hang_before_the_update_checkpoints_exits_4_and_resumes(policy_model, tmp_path):
    out = tmp_path / "run"
    args = ["train", "ppo", "-o", str(out), "--set", f"model.path={policy_model}", *PPO, *WATCH]
    proc, took = hang("make_experience", 3, args)  # step 3's scoring never returns
    assert proc.returncode == 4, proc.stderr[-4000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("hpcrlhf: error: step 3 hung: make_experience did not finish within "), error
    assert "(watchdog: 2 x median " in error and "of the last 2 + 3 s floor)" in error, error
    assert error.endswith("; checkpointed at step 2; rerun the same command to resume from its checkpoint step_000002"), error
    stacks = error.split("; stacks: ")[1].split(";")[0]
    text = open(stacks).read()
    assert " in hanging" in text and " in train_step" in text, text  # the main thread, where it waited
    assert took < 300, took  # deadline of a few seconds, the start-up, the checkpoint
    assert [m["step"] for m in read_metrics(out) if "train/loss" in m or "train/policy_loss" in m] == [1, 2]
    run_cli(args)  # the same command, no hang: resumes from step 2 to the end
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 4, summary
    assert [m["step"] for m in read_metrics(out) if "train/policy_loss" in m] == [1, 2, 3, 4]


def test_a_hang_in_the_update_ends_with_4_and_no_checkpoint_of_it(tmp_path):
    out = tmp_path / "run"
    args = ["train", "sft", "-o", str(out), "--set", "train.max_steps=6", "--set", "train.global_batch_size=8",
            "--set", "train.micro_batch_size=8", "--set", "task.train_size=64", "--set", "task.eval_size=8",
            "--set", "eval.every_steps=0", "--set", "log.backends=[]", "--set", "checkpoint.every_steps=2", *WATCH]
    proc, _ = hang("train_step", 4, args)
    assert proc.returncode == 4, proc.stderr[-4000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("hpcrlhf: error: step 4 hung: step did not finish within "), error
    assert error.endswith("; no checkpoint: step may have applied part of step 4; rerun the same command to resume "
                          "from its checkpoint step_000002"), error
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"
