"""LoRA on the trainers: a LoRA run learns, and its export is a plain Hugging Face model equal to
base + adapter (checked against peft's own loading of the saved adapter); LoRA reward models
export under ZeRO-3 with two ranks; QLoRA without a GPU is refused with a clear error."""

from __future__ import annotations

import json

import pytest
import torch

from tests.launch_helpers import run_cli

LORA = ["--set", "lora.rank=8", "--set", "lora.alpha=16", "--set", "log.backends=[]"]


@pytest.mark.slow
def test_lora_sft_learns_and_exports_merged_model(sft_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora_sft"
    run_cli(["train", "sft", "-o", str(out), *LORA, "--set", f"model.path={sft_model}", "--set", "optim.lr=5e-3",
             "--set", "train.max_steps=300", "--set", "task.train_size=19200", "--set", "eval.every_steps=0"])
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    assert after["eval/loss"] < 0.85 * before["eval/loss"], (before, after)
    assert after["eval/task_score"] > before["eval/task_score"] + 0.05, (before, after)

    merged = AutoModelForCausalLM.from_pretrained(out / "model")  # plain transformers, no peft
    assert not any("lora" in k for k in merged.state_dict())
    adapter = json.loads((out / "model" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 8
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sft_model), out / "model" / "adapter")
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)
        base = AutoModelForCausalLM.from_pretrained(sft_model)(ids).logits
    assert not torch.allclose(merged(ids).logits, base, atol=1e-3)  # the adapters did change the model
    # hpcrlhf eval merges the last checkpoint's adapters as the run's export did
    run_cli(["eval", "-r", str(out), "--set", "keep_models=true", "--set", "eval.score_prompts=16"])
    made = AutoModelForCausalLM.from_pretrained(out / "eval" / "models" / "step_000300")
    with torch.no_grad():
        torch.testing.assert_close(made(ids).logits, merged(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.distributed
def test_lora_reward_model_exports_under_zero3_with_two_ranks(tmp_path):
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "lora_rm"
    run_cli(["train", "rm", "-o", str(out), *LORA, "--set", "engine.zero_stage=3", "--set", "train.max_steps=8",
             "--set", "train.global_batch_size=16", "--set", "train.micro_batch_size=8", "--set", "task.train_size=256",
             "--set", "task.eval_size=32", "--set", "eval.every_steps=0"], nproc=2)
    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert model.config.reward_std > 0
    assert (out / "model" / "adapter" / "adapter_model.safetensors").exists()
    proc = run_cli(["eval", "-r", str(out)], check=False, timeout=300)  # no answers to score
    assert proc.returncode == 2 and "holds a reward model (a value head)" in proc.stderr, proc.stderr[-2000:]


def test_qlora_without_gpu_is_refused_before_training(tmp_path):
    proc = run_cli(["train", "sft", "-o", str(tmp_path / "q"), "--set", "lora.rank=8", "--set", "lora.load_in_4bit=true"],
                   check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "lora.load_in_4bit" in proc.stderr and "CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "q" / "checkpoints").exists()


def test_unknown_lora_target_is_a_config_error(tmp_path):
    proc = run_cli(["train", "sft", "-o", str(tmp_path / "t"), "--set", "lora.rank=4", "--set", "lora.target_modules=nope_proj"],
                   check=False, timeout=120)
    assert proc.returncode == 2 and "lora.target_modules" in proc.stderr, proc.stderr[-2000:]
