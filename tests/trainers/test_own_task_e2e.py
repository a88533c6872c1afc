"""A task hpcrlhf has never seen, end to end through the CLI, as a new user would run it.

The task (written here): each prompt is an instruction and 30 random digits (66 tokens), the
answer is the first digit. The user brings JSONL files, a reward rule and an evaluation metric
(`package.module:function`, on PYTHONPATH), and a non-Llama model (tiny Qwen2). SFT learns it up to
a middling score (stopped early on the user's own metric), then GRPO with vLLM rollouts on those
long prompts improves that metric.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from hpcrlhf.run.metrics import read_metrics

from tests.launch_helpers import run_cli
from tests.run.test_trackers import expected_by_step, mlflow_history, wandb_rows

USER_MODULE = '''
def reward(prompt, response, row):
    """1 when the answer starts with the right digit."""
    return 1.0 if response.strip()[:1] == row["answer"] else 0.0


def exact(prompt, response, row):
    return response.strip() == row["answer"]  # a bool: counts as 1 or 0
'''


def write_task(folder: Path) -> tuple[Path, Path]:
    rng = random.Random(0)

    def row() -> dict:
        digits = [str(rng.randrange(10)) for _ in range(30)]
        return {"prompt": "Copy the first digit. " + " ".join(digits) + " =", "response": digits[0],
                "answer": digits[0]}

    paths = folder / "train.jsonl", folder / "eval.jsonl"
    for path, n in zip(paths, (4000, 64)):
        path.write_text("".join(json.dumps(row()) + "\n" for _ in range(n)))
    (folder / "copytask.py").write_text(USER_MODULE)
    return paths


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.timeout(900)
def test_own_task_sft_then_grpo_with_vllm_improves_the_users_metric(tmp_path):
    pytest.importorskip("vllm")
    from hpcrlhf.models.loading import load_tokenizer
    from hpcrlhf.models.tiny import build_tiny_model_dir

    train, evals = write_task(tmp_path)
    first = json.loads(evals.read_text().splitlines()[0])["prompt"]
    assert len(load_tokenizer(str(build_tiny_model_dir("qwen2")))(first)["input_ids"]) >= 64
    env = {"PYTHONPATH": str(tmp_path)}
    data = ["--set", f"data.train_path={train}", "--set", f"data.eval_path={evals}",
            "--set", "eval.metrics=[copytask:exact]", "--set", "eval.max_new_tokens=4", "--set", "log.backends=[]"]

    sft = tmp_path / "sft"
    run_cli(["train", "sft", "-o", str(sft), "--set", "model.path=builtin:tiny-qwen2", *data,
             "--set", "optim.lr=5e-4", "--set", "train.max_steps=600", "--set", "eval.every_steps=5",
             "--set", "eval.stop_when=eval/exact>=0.3"], env=env)
    learned = summary(sft)
    assert learned["before"]["eval/exact"] == 0.0 and learned.get("stopped_early"), learned
    assert 0.3 <= learned["after"]["eval/exact"] < 0.9, learned  # room left for RL

    grpo = tmp_path / "grpo"
    proc = run_cli(["train", "ppo", "-o", str(grpo), "--set", f"model.path={sft / 'model'}", *data,
                    "--set", "reward.sources=[{rule: 'copytask:reward'}]", "--set", "ppo.advantage_estimator=grpo",
                    "--set", "rollout.backend=vllm", "--set", "rollout.vllm_kv_cache_gb=0.25",
                    "--set", "rollout.prompts_per_step=16", "--set", "rollout.samples_per_prompt=4",
                    "--set", "rollout.max_new_tokens=4", "--set", "optim.lr=2e-4", "--set", "train.max_steps=30",
                    "--set", "eval.every_steps=0", "--set", "ppo.dynamic_sampling=true",
                    "--set", "log.backends=[mlflow,wandb]", "--set", "log.wandb.mode=offline"], env=env)
    assert "starting a vLLM engine" in proc.stderr
    result = summary(grpo)
    before, after = result["before"]["eval/exact"], result["after"]["eval/exact"]
    assert before == pytest.approx(learned["after"]["eval/exact"])  # the SFT model, scored the same way
    assert after >= before + 0.1, result
    assert result["after"]["eval/reward"] >= result["before"]["eval/reward"] + 0.1, result
    # with DAPO's dynamic sampling on the user's rule: refill rounds ran through the vLLM engine
    rounds = [m["rollout/generation_rounds"] for m in read_metrics(grpo) if "rollout/generation_rounds" in m]
    assert len(rounds) == 30 and max(rounds) > 1, rounds
    # the trackers hold the user's metric and every step's figures, as metrics.jsonl does
    ledger = json.loads((grpo / "trackers.json").read_text())
    logged = mlflow_history(grpo, ledger)
    for key in ("eval/exact", "eval/reward", "rollout/generation_rounds", "train/policy_loss"):
        want = [(m["step"], m[key]) for m in read_metrics(grpo) if key in m]
        assert logged[key] == [(step, pytest.approx(value, rel=1e-6)) for step, value in want], key
    (rows,) = wandb_rows(grpo, ledger["wandb"]["id"])
    assert [row["_step"] for row in rows] == sorted(expected_by_step(grpo))
