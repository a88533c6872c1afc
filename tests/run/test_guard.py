"""NaN/Inf in a training step (issue 9): the guard's decisions, an engine's skipped step at every
ZeRO stage checked against an engine that never met the NaN, and NaN injected into real runs
through the CLI — logits (so loss and gradients) in SFT, a reward function in PPO — under
`train.on_nonfinite=skip` and `stop`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hpcrlhf.errors import TrainingError
from hpcrlhf.run.metrics import read_metrics
from hpcrlhf.run.guard import NonFiniteGuard, SkipStep, describe_nonfinite
from tests.launch_helpers import ROOT, cli_env, run_cli

QUIET = ["--set", "eval.every_steps=0", "--set", "log.every_steps=1", "--set", "log.backends=[]",
         "--set", "task.eval_size=64", "--set", "eval.score_prompts=16"]


# -- the guard's decisions -----------------------------------------------------------------------
def test_describe_counts_nan_and_inf():
    assert describe_nonfinite(torch.tensor([1.0, float("nan"), float("inf"), float("-inf")])) == "1 NaN and 2 Inf of 4 values"
    assert describe_nonfinite(torch.tensor([1.0, 2.0])) is None
    assert describe_nonfinite(torch.tensor([1, 2])) is None  # integers are always finite


def test_stop_names_the_step_and_the_tensor():
    guard = NonFiniteGuard("stop", 5)
    guard.begin(7)
    with pytest.raises(TrainingError, match=r"step 7: reward/rule_x has 1 NaN of 3 values; stopped \(train.on_nonfinite=stop\)"):
        guard.check_inputs({"reward/rule_x": torch.tensor([0.0, float("nan"), 1.0])})
    with pytest.raises(TrainingError, match=r"step 7: non-finite gradients \(2 optimizer step\(s\) not applied\); "
                                             r"non-finite train/loss.*rerun the same command to resume"):
        guard.after_step({"train/loss": float("nan"), "train/actor_skipped_updates": 2.0, "train/actor_grad_norm": float("inf")})


def test_skip_counts_and_stops_after_too_many_in_a_row():
    guard = NonFiniteGuard("skip", 2)
    ok = {"train/loss": 1.0, "train/skipped_updates": 0.0}
    bad = {"train/loss": float("nan"), "train/skipped_updates": 1.0}
    for step, metrics in enumerate([bad, bad, ok, bad], start=1):
        guard.begin(step)
        assert guard.after_step(metrics) == (metrics is bad)
    guard.begin(5)
    with pytest.raises(SkipStep):  # bad inputs: the second in a row is still allowed
        guard.check_inputs({"rollout/score": torch.tensor([float("inf")])})
    assert guard.after_step(None, "rollout/score has 1 Inf of 1 values")
    guard.begin(6)
    with pytest.raises(TrainingError, match=r"step 6: .*3 skipped steps in a row > train.max_consecutive_skips=2"):
        guard.after_step(bad)
    assert guard.skipped == 4


def test_a_nonfinite_metric_after_an_applied_update_is_only_reported_when_skipping():
    guard = NonFiniteGuard("skip", 0)
    guard.begin(1)
    assert guard.after_step({"train/loss": 1.0, "rollout/kl": float("nan")}) is False  # nothing to undo
    stopping = NonFiniteGuard("stop", 0)
    stopping.begin(1)
    with pytest.raises(TrainingError, match="step 1: non-finite rollout/kl; stopped .*The step was applied"):
        stopping.after_step({"train/loss": 1.0, "rollout/kl": float("nan")})


def test_inputs_bad_on_another_rank_skip_this_rank_too():
    guard = NonFiniteGuard("skip", 5)
    with pytest.raises(SkipStep, match="another rank"):
        guard.check_inputs({"rollout/score": torch.tensor([1.0])}, all_ranks=lambda flag: flag + 1.0)


# -- an engine's skipped step --------------------------------------------------------------------
@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16")])
def test_engine_skips_a_nan_step_exactly(stage, precision):
    """A NaN step changes nothing: afterwards the engine equals one that never met it (weights, Adam
    moments and schedule), at every ZeRO stage — at ZeRO-0 fp32 DeepSpeed alone would write NaN
    into every weight."""
    proc = subprocess.run([sys.executable, "-m", "tests.trainers.faults", "engine-skip", str(stage), precision],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(line[len("REPORT "):])
    assert report["unchanged_by_nan_step"] and report["skipped_updates"] == 1, report
    assert report["same_as_never_nan"] and report["finite"], report
    assert report["lr_a"] == report["lr_b"], report


# -- real runs -----------------------------------------------------------------------------------
def faulty_cli(steps: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.trainers.faults", "nan-logits", steps, "--", *args], cwd=ROOT,
                          env=cli_env(), capture_output=True, text=True, timeout=600)


def test_sft_skips_nan_steps_and_learns_on(tmp_path):
    out = tmp_path / "run"
    proc = faulty_cli("3,4", ["train", "sft", "-o", str(out), "--set", "train.max_steps=12", *QUIET])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step 3: non-finite gradients (1 optimizer step(s) not applied); non-finite train/loss; skipped" in proc.stderr
    rows = {m["step"]: m for m in read_metrics(out) if "train/lr" in m}
    assert "train/loss" not in rows[3] and "train/loss" not in rows[4]  # skipped steps stay out of the means
    assert rows[4]["train/skipped_steps"] == rows[12]["train/skipped_steps"] == 2
    assert rows[2]["train/lr"] == rows[3]["train/lr"] == rows[4]["train/lr"]  # the schedule waited
    summary = json.loads((out / "summary.json").read_text())
    assert summary["after"]["eval/loss"] < summary["before"]["eval/loss"] - 1.0  # and the run learned on


def test_sft_stop_ends_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = faulty_cli("3", ["train", "sft", "-o", str(out), "--set", "train.max_steps=6", "--set",
                            "train.on_nonfinite=stop", "--set", "checkpoint.every_steps=1", *QUIET])
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "hpcrlhf: error: step 3: non-finite gradients (1 optimizer step(s) not applied); non-finite train/loss; " \
           "stopped (train.on_nonfinite=stop)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"
    # resuming without the fault finishes the run from there
    run_cli(["train", "sft", "-o", str(out), "--set", "train.max_steps=6", "--set", "checkpoint.every_steps=1", *QUIET])
    assert json.loads((out / "summary.json").read_text())["step"] == 6


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_ppo_nan_reward_skips_the_steps_that_use_it_or_stops(backend, tiny_llama, tmp_path):
    """A reward function returning NaN for one training prompt (4 samples of it in each step that
    draws it): with 64 prompts and 32 per step that is one step in each epoch of 2. With vLLM the
    weight syncs around the skipped steps keep the engine on the actor's weights."""
    args = ["train", "ppo", "--set", f"model.path={tiny_llama}", "--set", "train.max_steps=4",
            "--set", f"rollout.backend={backend}", "--set", "rollout.vllm_kv_cache_gb=0.25", "--set", "optim.lr=1e-3",
            "--set", "reward.sources=[{rule: 'tests.trainers.faults:nan_for_first_prompt'}]",
            "--set", "task.train_size=64", "--set", "rollout.prompts_per_step=32", "--set", "rollout.samples_per_prompt=4",
            "--set", "rollout.max_new_tokens=4", "--set", "ppo.advantage_estimator=grpo", *QUIET]
    skip = run_cli([*args, "-o", str(tmp_path / "skip")])
    warned = [line for line in skip.stderr.splitlines() if "has 4 NaN of 128 values; skipped the step" in line]
    assert len(warned) == 2, skip.stderr[-4000:]
    assert "reward/rule_tests.trainers.faults.nan_for_first_prompt has 4 NaN" in warned[0]
    rows = [m for m in read_metrics(tmp_path / "skip") if "train/lr" in m]
    assert rows[-1]["train/skipped_steps"] == 2
    trained = [m["step"] for m in rows if "rollout/score" in m]
    assert len(trained) == 2 and all(torch.isfinite(torch.tensor(m["rollout/score"])) for m in rows if "rollout/score" in m)
    first_bad = min({1, 2, 3, 4} - set(trained))

    if backend == "vllm":  # the engine stays in sync across the skipped steps (a large lr: a stale one would show)
        assert max(m["rollout/logprob_max_diff"] for m in rows if "rollout/score" in m) < 1e-4
        return
    stop = run_cli([*args, "-o", str(tmp_path / "stop"), "--set", "train.on_nonfinite=stop"], check=False)
    assert stop.returncode == 2
    assert f"hpcrlhf: error: step {first_bad}: reward/rule_tests.trainers.faults.nan_for_first_prompt has 4 NaN of " \
           "128 values; rollout/score has 4 NaN of 128 values; stopped (train.on_nonfinite=stop)" in stop.stderr, stop.stderr[-3000:]


# -- a model that is broken before training --------------------------------------------------------
@pytest.mark.parametrize("damage, expected", [
    ("nan", "the weights loaded from model.path={path} hold NaN/Inf (model.norm.weight has 1 NaN of "),
    ("huge", "the weights of model.path={path} hold no NaN/Inf; likely causes: weights damaged into huge values"),
])
def test_damaged_model_weights_fail_before_the_first_step(tiny_llama, tmp_path, damage, expected):
    """Weights damaged in place (same file size): one NaN, or finite values so large the forward
    pass overflows. Before: the run trained to eval/loss=nan and exited 0."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    weights = load_file(model / "model.safetensors")
    norm = weights["model.norm.weight"].clone()
    if damage == "nan":
        norm[0] = float("nan")
    else:
        norm[:] = 3e38
    save_file({**weights, "model.norm.weight": norm}, model / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "run"
    proc = run_cli(["train", "sft", "-o", str(out), "--set", f"model.path={model}", "--set", "train.max_steps=4",
                    "--set", "checkpoint.save_model=false", *QUIET], check=False, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "hpcrlhf: error: the first evaluation, before any training step, gave eval/loss=nan: " in proc.stderr, \
        proc.stderr[-3000:]
    assert expected.format(path=model) in proc.stderr, proc.stderr[-3000:]
    assert "so the run stops before its first step" in proc.stderr
    assert not read_metrics(out)  # nothing logged, nothing trained
