"""The router load-balancing loss of mixture-of-experts models (`model.router_aux_loss_coef`).

transformers computes the loss; the test re-derives it in float64 from the router logits
(Switch Transformer: experts x sum_i share_of_tokens_i x mean_router_probability_i, top-k
routing, padding left out), then checks the jobs use it: reported, trained on, refused where it
cannot apply.
"""

from __future__ import annotations

import json

import pytest
import torch

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import DPOConfig, SFTConfig
from hpcrlhf.errors import ConfigError
from hpcrlhf.models.loading import load_causal_lm
from hpcrlhf.models.moe import has_router, router_kwargs
from hpcrlhf.models.tiny import build_tiny_model_dir
from hpcrlhf.run.metrics import read_metrics
from tests.launch_helpers import run_cli


def switch_loss(router_logits: tuple[torch.Tensor, ...], top_k: int, mask: torch.Tensor) -> float:
    """Float64 reference: per layer (tokens, experts) logits, concatenated over layers."""
    logits = torch.cat([layer.detach().double() for layer in router_logits])
    keep = mask.reshape(-1).bool().repeat(len(router_logits))
    probs = logits.softmax(-1)[keep]
    chosen = torch.zeros_like(probs).scatter_(-1, probs.topk(top_k, dim=-1).indices, 1.0)
    experts = probs.shape[-1]
    return float(experts * (chosen.mean(0) * probs.mean(0)).sum())


def test_the_router_loss_is_switch_transformers():
    model = load_causal_lm(str(build_tiny_model_dir("mixtral")), attn_implementation="sdpa")
    assert has_router(model.config) and not has_router(load_causal_lm(str(build_tiny_model_dir("llama"))).config)
    ids = torch.randint(3, 400, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # padding is left out
    out = model(input_ids=ids, attention_mask=mask, **router_kwargs(0.02))
    expected = switch_loss(out.router_logits, model.config.num_experts_per_tok, mask)
    assert float(out.aux_loss) == pytest.approx(expected, rel=1e-5)
    assert router_kwargs(0.0) == {} and model(input_ids=ids).aux_loss is None  # off: not computed


def test_jobs_that_cannot_use_it_refuse_it():
    with pytest.raises(ConfigError, match="model.router_aux_loss_coef: 0.02 is used by sft and the ppo actor only"):
        load_config(DPOConfig, overrides=["model.router_aux_loss_coef=0.02"])
    with pytest.raises(ConfigError, match="model.router_aux_loss_coef: -1.0 is invalid"):
        load_config(SFTConfig, overrides=["model.router_aux_loss_coef=-1"])


QUICK = ["--set", "eval.every_steps=0", "--set", "log.backends=[]", "--set", "eval.score_prompts=8",
         "--set", "log.every_steps=1", "--set", "checkpoint.save_model=false"]


def test_sft_on_a_dense_model_refuses_it(tmp_path):
    proc = run_cli(["train", "sft", "-o", str(tmp_path / "run"), *QUICK, "--set", "train.max_steps=2",
                    "--set", "model.router_aux_loss_coef=0.02"], check=False)
    assert proc.returncode == 2 and "is no mixture-of-experts model: it has no router" in proc.stderr


def assert_sft_steers_the_router_towards_balance(tmp_path, *overrides: str) -> None:
    """Reported every step; a large weight lowers the loss towards its balanced value (top_k)
    while a run without it is not steered. `overrides` (--set pairs) run it under another engine
    setting (tests/gpu: ZeRO-3 in bf16)."""
    runs = {}
    for coef in (0.0, 5.0):
        out = tmp_path / f"coef{coef}"
        run_cli(["train", "sft", "-o", str(out), *QUICK, "--set", "model.path=builtin:tiny-mixtral",
                 "--set", "train.max_steps=30", "--set", f"model.router_aux_loss_coef={coef}", *overrides])
        runs[coef] = [m.get("train/router_aux_loss") for m in read_metrics(out) if "train/loss" in m]
    assert all(v is None for v in runs[0.0])  # off: not computed
    aux = runs[5.0]
    assert all(v is not None and v == v for v in aux)
    top_k = json.loads((build_tiny_model_dir("mixtral") / "config.json").read_text())["num_experts_per_tok"]
    assert min(aux[-5:]) < aux[0] and aux[-1] - top_k < 0.5 * (aux[0] - top_k), aux


def test_sft_trains_the_router_towards_balance(tmp_path):
    assert_sft_steers_the_router_towards_balance(tmp_path)


def test_the_ppo_actor_adds_and_reports_it(tmp_path):
    out = tmp_path / "ppo"
    run_cli(["train", "ppo", "-o", str(out), *QUICK, "--set", "model.path=builtin:tiny-mixtral",
             "--set", "train.max_steps=2", "--set", "rollout.prompts_per_step=8", "--set", "ppo.advantage_estimator=grpo",
             "--set", "model.router_aux_loss_coef=0.02"])
    values = [m["train/router_aux_loss"] for m in read_metrics(out) if "train/router_aux_loss" in m]
    assert len(values) == 2 and all(1.0 < v < 4.0 for v in values), values  # top_k 2 at balance, 4 experts
