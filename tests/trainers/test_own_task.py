"""Your own data, reward rules and evaluation metrics through the real CLI: the bundled task stays
out of runs on your data (`task.name: auto`), and `eval.metrics` are reported as `eval/<name>` by
SFT, PPO and `generate` (summary, stop rule, printout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrlhf.run.metrics import read_metrics
from tests.launch_helpers import run_cli

USER_MODULE = '''\
def exact(prompt, response, row):
    """1 when the answer starts with the row's reference answer."""
    return response.strip().startswith(row["answer"])


def length(prompt, response, row):
    return float(len(response))


def short(prompt, response, row):
    return -float(len(response))
'''

QUICK = ["--set", "log.backends=[]", "--set", "log.progress=false", "--set", "checkpoint.save_model=false"]
SFT = [*QUICK, "--set", "train.max_steps=4", "--set", "train.global_batch_size=4", "--set", "train.micro_batch_size=4",
       "--set", "eval.max_new_tokens=3"]
PPO = [*QUICK, "--set", "train.max_steps=1", "--set", "rollout.prompts_per_step=4", "--set", "rollout.samples_per_prompt=2",
       "--set", "train.global_batch_size=8", "--set", "train.micro_batch_size=8", "--set", "rollout.max_new_tokens=3",
       "--set", "eval.max_new_tokens=3", "--set", "ppo.advantage_estimator=grpo", "--set", "eval.every_steps=0"]


def own_data(tmp_path: Path) -> tuple[Path, Path]:
    """A user module on `tmp_path` (PYTHONPATH) and train/eval files of questions that are no arithmetic."""
    (tmp_path / "usermetrics.py").write_text(USER_MODULE)
    rows = [{"prompt": f"Say the word {w}:", "response": w, "answer": w} for w in ("red", "blue", "green", "gold") * 2]
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    return train, evals


def user_env(tmp_path: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(tmp_path)}


def eval_keys(out: Path) -> set[str]:
    return {k for m in read_metrics(out) for k in m if k.startswith("eval/")}


# ---------------------------------------------------------------- item 4: the bundled task stays out of your data
def test_sft_on_own_data_scores_no_arithmetic(tmp_path):
    """Before: task.name defaulted to arithmetic, so this run logged eval/task_score computed on
    arithmetic prompts it never trained on."""
    train, evals = own_data(tmp_path)
    out = tmp_path / "run"
    proc = run_cli(["train", "sft", "-o", str(out), "--set", f"data.train_path={train}", "--set", f"data.eval_path={evals}",
                    *SFT], timeout=300)
    assert "eval/loss" in eval_keys(out) and "eval/task_score" not in eval_keys(out), eval_keys(out)
    assert "task.name=auto: data.train_path is set, so the bundled task is off" in proc.stderr, proc.stderr[-3000:]
    # The start-up log says what decides learning, with the lengths for your data, not the demo's.
    settings = next(line for line in proc.stderr.splitlines() if "key settings: " in line)
    assert f"data {train}" in settings and "lr " in settings and "per optimizer step = 1 rank(s) x" in settings
    assert "eval answers up to 3 tokens" in settings and "data.max_length 1024" in settings, settings


def test_ppo_on_own_prompts_with_the_task_reward_fails_when_the_config_loads(tmp_path):
    """Before: models loaded, then 'cannot parse arithmetic prompt'."""
    train, _ = own_data(tmp_path)
    out = tmp_path / "run"
    proc = run_cli(["train", "ppo", "-o", str(out), "--set", f"data.train_path={train}", *PPO], check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("hpcrlhf: error: --set data.train_path" in proc.stderr or "hpcrlhf: error: reward.sources[0].rule" in proc.stderr), \
        proc.stderr[-3000:]
    assert "reward.sources[0].rule: 'task'" in proc.stderr and "task.name is auto" in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()  # nothing started


def test_explicit_task_on_own_prompts_names_the_row_before_models_load(tmp_path):
    """task.name=arithmetic, set on purpose, is kept; prompts it cannot score are named by file and
    line before any model loads (before: 'cannot parse arithmetic prompt' after loading them)."""
    train, _ = own_data(tmp_path)
    proc = run_cli(["train", "ppo", "-o", str(tmp_path / "run"), "--set", f"data.train_path={train}",
                    "--set", "task.name=arithmetic", "--set", "reward.sources=[{rule: 'usermetrics:short'}]", *PPO],
                   check=False, env=user_env(tmp_path), timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"hpcrlhf: error: {train}:1: task.name is arithmetic, and prompt 'Say the word red:' is no "
                            "arithmetic question"), error
    assert "task.name=auto" in error, error
    assert "rollout backend" not in proc.stderr, proc.stderr[-3000:]  # the line PPO logs once its models are built


# ---------------------------------------------------------------- item 3: your metrics, reported as eval/<name>
def test_sft_reports_your_metrics_and_stops_on_one(tmp_path):
    train, evals = own_data(tmp_path)
    out = tmp_path / "run"
    proc = run_cli(["train", "sft", "-o", str(out), "--set", f"data.train_path={train}", "--set", f"data.eval_path={evals}",
                    "--set", "eval.metrics=[usermetrics:exact, usermetrics:length]", "--set", "eval.every_steps=2",
                    "--set", "eval.stop_when=eval/length>=0", *SFT], env=user_env(tmp_path), timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] == {"rule": "eval/length>=0", "step": 2}, summary
    for when in ("before", "after"):
        assert 0 <= summary[when]["eval/exact"] <= 1 and summary[when]["eval/length"] >= 0, summary
        assert "eval/task_score" not in summary[when]
    assert [m["step"] for m in read_metrics(out) if "eval/exact" in m] == [0, 2]
    after = next(line for line in proc.stderr.splitlines() if "after training: " in line)
    assert f"eval/exact={summary['after']['eval/exact']:.4f}" in after, after


@pytest.mark.parametrize("kind", ["dpo", "kto", "csft"])
def test_policy_jobs_report_your_metrics_on_the_held_out_prompts(kind, tmp_path):
    """On the bundled task's data, whose held-out prompt rows carry the right `answer`; CSFT reports
    each metric conditioned on the top and the bottom bucket, as it does the task score."""
    own_data(tmp_path)
    out = tmp_path / "run"
    run_cli(["train", kind, "-o", str(out), "--set", "eval.metrics=[usermetrics:exact]", "--set", "eval.every_steps=0",
             "--set", "task.train_size=64", "--set", "task.eval_size=8", "--set", "eval.score_prompts=4", *SFT],
            env=user_env(tmp_path), timeout=300)
    after = json.loads((out / "summary.json").read_text())["after"]
    suffixes = ("_top", "_bottom") if kind == "csft" else ("",)
    for suffix in suffixes:
        assert 0 <= after[f"eval/exact{suffix}"] <= 1 and f"eval/task_score{suffix}" in after, after
    if kind == "csft":  # unconditioned prompts are not what a CSFT model is for
        assert not {"eval/exact", "eval/task_score"} & set(after), after


def test_ppo_reports_your_metrics_next_to_the_reward(tmp_path):
    train, evals = own_data(tmp_path)
    out = tmp_path / "run"
    run_cli(["train", "ppo", "-o", str(out), "--set", f"data.train_path={train}", "--set", f"data.eval_path={evals}",
             "--set", "reward.sources=[{rule: 'usermetrics:short'}]", "--set", "eval.metrics=[usermetrics:length]", *PPO],
            env=user_env(tmp_path), timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    for when in ("before", "after"):  # the reward is minus the length
        assert summary[when]["eval/length"] == pytest.approx(-summary[when]["eval/reward"]), summary
        assert "eval/task_score" not in summary[when]


def test_generate_reports_the_mean_of_each_source_and_metric(tmp_path, tiny_llama):
    train, _ = own_data(tmp_path)
    out = tmp_path / "out.jsonl"
    proc = run_cli(["generate", "-m", tiny_llama, "-o", str(out), "--set", f"data.train_path={train}",
                    "--set", "reward={sources: [{rule: 'usermetrics:short'}, {rule: 'usermetrics:length', weight: 0.5}]}",
                    "--set", "metrics=[usermetrics:exact, usermetrics:length]", "--set", "rollout.max_new_tokens=3"],
                   env=user_env(tmp_path), timeout=300)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8 and all(set(r["metrics"]) == {"exact", "length"} and "task_score" not in r for r in rows)
    for r in rows:
        assert r["metrics"]["length"] == len(r["response"]) == -r["scores"]["rule_usermetrics.short"]
        assert r["score"] == pytest.approx(-0.5 * len(r["response"]))
    printed = next(line for line in proc.stderr.splitlines() if "generate: responses=8" in line)
    mean_length = sum(len(r["response"]) for r in rows) / 8
    for key, value in (("mean_scores.rule_usermetrics.short", -mean_length), ("mean_scores.rule_usermetrics.length", mean_length),
                       ("mean_metrics.length", mean_length), ("mean_score", -0.5 * mean_length),
                       ("mean_metrics.exact", sum(r["metrics"]["exact"] for r in rows) / 8)):
        assert f"{key}={value:.4f}" in printed, (key, printed)
