"""The built-in rules in real runs through the CLI: GRPO with the `math` rule learns a small
math-style task made here, and GRPO with the `code` rule runs end to end on a few toy programming
prompts, its programs run in the sandbox.

The math task: "What is 7 tens and 6 ones? Answer:" -> " \\boxed{76}", the parts named in either
order. Half the SFT demonstrations swap the digits (" \\boxed{67}"), so the SFT model writes the
format but picks the right order about half the time: what RL must fix. The rows' reference
answers are written as `76`, `76.0` or `\\frac{152}{2}`: only an equivalence check credits the
model's integers. The same SFT run learns four toy programs by heart (30% of its rows).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from hpcrlhf.run.metrics import read_metrics
from tests.launch_helpers import run_cli
from tests.rewards.programs import PYTHON

PROGRAMS = [  # (prompt, program, tests)
    ("Write a program that reads two integers and prints their sum.",
     "a, b = map(int, input().split())\nprint(a + b)",
     [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6\n"}]),
    ("Write a program that reads a line and prints it reversed.",
     "print(input()[::-1])",
     [{"input": "abc\n", "output": "cba\n"}, {"input": "hpc\n", "output": "cph\n"}]),
    ("Write a program that reads integers and prints the largest.",
     "print(max(map(int, input().split())))",
     [{"input": "3 9 2\n", "output": "9\n"}, {"input": "-1 -5\n", "output": "-1\n"}]),
    ("Write a function square(x) that returns x times x.",
     "def square(x):\n    return x * x",
     ["assert square(3) == 9", "assert square(-2) == 4"]),
]
QUIET = ["--set", "log.backends=[]", "--set", "log.progress=false", "--set", "log.every_steps=1"]


def place_value_row(rng: random.Random, noisy: bool) -> dict:
    tens, ones = rng.sample(range(1, 10), 2)
    question = f"What is {tens} tens and {ones} ones?" if rng.random() < 0.5 else f"What is {ones} ones and {tens} tens?"
    n = 10 * tens + ones
    shown = 10 * ones + tens if noisy and rng.random() < 0.5 else n
    reference = rng.choice([str(n), f"{n}.0", f"\\frac{{{2 * n}}}{{2}}"])
    return {"prompt": question + " Answer:", "response": f" \\boxed{{{shown}}}", "answer": reference}


def code_row(prompt: str, program: str, tests: list) -> dict:
    return {"prompt": prompt + "\n", "response": f"```python\n{program}\n```", "tests": tests}


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, Path]:
    """The data files and an SFT model trained on both tasks (200 steps: the format learned)."""
    folder = tmp_path_factory.mktemp("own_rules_task")
    rng = random.Random(0)
    math_train = [place_value_row(rng, noisy=True) for _ in range(3600)]
    code_rows = [code_row(*p) for p in PROGRAMS]
    files = {"sft": jsonl(folder / "sft.jsonl", rng.sample(math_train[:2800] + code_rows * 300, 4000)),
             "math_prompts": jsonl(folder / "math.jsonl", math_train),
             "math_eval": jsonl(folder / "math_eval.jsonl", [place_value_row(rng, noisy=False) for _ in range(64)]),
             "code_prompts": jsonl(folder / "code.jsonl", code_rows)}
    files["model"] = folder / "sft" / "model"
    run_cli(["train", "sft", "-o", str(folder / "sft"), "--set", "model.path=builtin:tiny-llama",
             "--set", f"data.train_path={files['sft']}", "--set", f"data.eval_path={files['math_eval']}",
             "--set", "optim.lr=1e-3", "--set", "train.max_steps=200", "--set", "train.global_batch_size=32",
             "--set", "train.micro_batch_size=32", "--set", "eval.every_steps=0", "--set", "eval.metrics=[math]",
             "--set", "eval.max_new_tokens=12", *QUIET], timeout=900)
    sft = json.loads((folder / "sft" / "summary.json").read_text())
    assert sft["before"]["eval/math"] == 0 and sft["after"]["eval/math"] > 0, sft  # the built-in rule as a metric
    return files


@pytest.mark.slow
def test_grpo_with_the_math_rule_learns_the_task(task, tmp_path):
    out = tmp_path / "grpo"
    run_cli(["train", "ppo", "-o", str(out), "--set", f"model.path={task['model']}",
             "--set", f"data.train_path={task['math_prompts']}", "--set", f"data.eval_path={task['math_eval']}",
             "--set", "reward.sources=[{rule: math}]", "--set", "eval.metrics=[math]", "--set", "eval.max_new_tokens=12",
             "--set", "ppo.advantage_estimator=grpo", "--set", "ppo.init_kl_coef=0", "--set", "rollout.prompts_per_step=16",
             "--set", "rollout.samples_per_prompt=8", "--set", "rollout.max_new_tokens=12", "--set", "optim.lr=3e-4",
             "--set", "train.max_steps=20", "--set", "eval.every_steps=0", *QUIET], timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["before"]["eval/math"], summary["after"]["eval/math"]
    assert 0.2 <= before <= 0.8, summary  # the SFT model: right order about half the time
    assert after >= before + 0.15, summary
    scores = [m["rollout/score"] for m in read_metrics(out) if "rollout/score" in m]
    assert len(scores) == 20 and sum(scores[-5:]) / 5 >= sum(scores[:5]) / 5 + 0.1, scores
    assert all("reward/rule_math" in m and "timing/reward" in m for m in read_metrics(out) if "rollout/score" in m)


@pytest.mark.slow
def test_grpo_with_the_code_rule_runs_end_to_end(task, tmp_path):
    out = tmp_path / "grpo"
    run_cli(["train", "ppo", "-o", str(out), "--set", f"model.path={task['model']}",
             "--set", f"data.train_path={task['code_prompts']}", "--set", f"data.eval_path={task['code_prompts']}",
             "--set", "reward.sources=[{rule: code}, {rule: format, weight: 0.1}]", "--set", "eval.metrics=[code]",
             "--set", "rules.format.pattern='```python\\n.*\\n```'", "--set", "rules.format.timeout_s=1",
             "--set", f"rules.code.python={PYTHON}", "--set", "rules.code.timeout_s=5", "--set", "rules.workers=2",
             "--set", "eval.max_new_tokens=64", "--set", "eval.score_prompts=4",
             "--set", "ppo.advantage_estimator=grpo", "--set", "rollout.prompts_per_step=4",
             "--set", "rollout.samples_per_prompt=4", "--set", "rollout.max_new_tokens=64",
             "--set", "train.max_steps=3", "--set", "eval.every_steps=0", *QUIET], timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert 0 < summary["before"]["eval/code"] <= 1 and 0 <= summary["after"]["eval/code"] <= 1, summary
    rows = [m for m in read_metrics(out) if "rollout/score" in m]
    assert len(rows) == 3 and all(0 <= m["reward/rule_code"] <= 1 for m in rows), rows
    assert max(m["reward/rule_code"] for m in rows) > 0, rows  # programs the model wrote passed tests in the sandbox
