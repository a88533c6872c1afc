"""The trainer runs for every bundled model family, in bf16 with gradient checkpointing and
packing, and on user data (a JSONL file with its own keys and the chat template).

These run in-process (a world of one) to keep them fast; multi-rank runs are in test_sft_e2e.
"""

from __future__ import annotations

import json

import pytest

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import SFTConfig
from hpcrlhf.run.metrics import read_metrics
from hpcrlhf.trainers.sft import run_sft

QUICK = ["train.max_steps=12", "train.global_batch_size=16", "train.micro_batch_size=8", "log.every_steps=1",
         "eval.every_steps=0", "eval.score_prompts=16", "task.eval_size=32", "task.train_size=512",
         "log.backends=[]", "log.progress=false", "checkpoint.save_model=false", "optim.lr=3e-3"]


def train(tmp_path, *extra: str) -> list[float]:
    cfg = load_config(SFTConfig, overrides=[*QUICK, f"output_dir={tmp_path / 'run'}", *extra])
    assert run_sft(cfg)["status"] == "done"
    return [m["train/loss"] for m in read_metrics(cfg.output_dir) if "train/loss" in m]


@pytest.mark.parametrize("family", ["mistral", "mixtral", "qwen2", "gpt2"])
def test_every_family_trains(tmp_path, family):
    curve = train(tmp_path, f"model.path=builtin:tiny-{family}")
    assert len(curve) == 12 and curve[-1] < 0.7 * curve[0]


def test_bf16_gradient_checkpointing_and_packing(tmp_path):
    curve = train(tmp_path, "engine.precision=bf16", "engine.zero_stage=2", "engine.gradient_checkpointing=true",
                  "data.packing=true", "data.max_length=64", "train.global_batch_size=4", "train.micro_batch_size=2")
    assert curve[-1] < 0.7 * curve[0]


def test_user_jsonl_with_custom_keys_and_chat_template(tmp_path):
    from hpcrlhf.data.tasks import ArithmeticTask

    rows = ArithmeticTask().sft_rows("train", 256)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": r["prompt"], "answer": r["response"]}) + "\n" for r in rows))
    curve = train(tmp_path, f"data.train_path={data}", "data.prompt_key=question", "data.response_key=answer",
                  "data.apply_chat_template=true", "task.name=null")
    assert curve[-1] < 0.7 * curve[0]
    assert not [m for m in read_metrics(tmp_path / "run") if "eval/task_score" in m]  # no task, no task score


def test_status_line_has_rate_and_eta():
    from hpcrlhf.logs import Progress

    p = Progress(100, initial=0, enabled=False)
    p.done = 25
    line = p.status_line(p._start + 10.0, {"loss": 1.5})
    assert line == "train 25/100 [2.50 step/s, ETA 0:30] loss=1.5"
