"""Reward sources and their combination: two reward models of known output (checked against
transformers' own sequence-classification pooling in float64), rules, penalties and errors."""

from __future__ import annotations

import pytest
import torch

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import GenerateConfig, RewardConfig, RewardSourceConfig
from hpcrlhf.data.tasks import ArithmeticTask
from hpcrlhf.engines.deepspeed_engine import FrozenModel
from hpcrlhf.errors import ConfigError
from hpcrlhf.models.loading import load_tokenizer
from hpcrlhf.models.value import ValueModel, load_value_model
from hpcrlhf.rewards import Response, RewardSet, adjust_scores

CPU = torch.device("cpu")


def _make_rm(base: str, folder, seed: int, mean: float, std: float) -> str:
    """A reward model with a random head (seeded) and stored normalisation statistics."""
    torch.manual_seed(seed)
    model = load_value_model(base, pad_token_id=0)
    model.config.reward_mean, model.config.reward_std = mean, std
    model.save_pretrained(folder)
    load_tokenizer(base).save_pretrained(folder)
    return str(folder)


def _load(path: str) -> FrozenModel:
    tok = load_tokenizer(path)
    return FrozenModel(ValueModel(load_value_model(path, pad_token_id=tok.pad_token_id)), None, CPU)


def _reference_reward(path: str, ids: list[int]) -> float:
    """transformers' own pooled score of one unpadded sequence, in float64, normalised."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        raw = float(model(input_ids=torch.tensor([ids])).logits[0, 0])
    return (raw - model.config.reward_mean) / model.config.reward_std


def _responses(tokenizer, n: int = 6) -> list[Response]:
    task = ArithmeticTask()
    out = []
    for i, row in enumerate(task.prompt_rows("eval", n)):
        answer = str(task.answer(row["prompt"]) + (i % 2))  # every other answer is off by one
        ids = tokenizer(row["prompt"])["input_ids"] + tokenizer(answer, add_special_tokens=False)["input_ids"]
        out.append(Response(row["prompt"], answer, tuple(ids + [tokenizer.eos_token_id]), row))
    return out


def test_two_reward_models_and_a_rule_are_combined_as_configured(tiny_llama, tmp_path):
    rm_a = _make_rm(tiny_llama, tmp_path / "rm_a", seed=1, mean=0.3, std=2.0)
    rm_b = _make_rm(tiny_llama, tmp_path / "rm_b", seed=2, mean=-1.0, std=0.5)
    tokenizer = load_tokenizer(tiny_llama)
    cfg = RewardConfig(sources=(RewardSourceConfig(model=rm_a, weight=0.7), RewardSourceConfig(model=rm_b, weight=-1.3),
                                RewardSourceConfig(rule="task", weight=2.0)), batch_size=4)
    rewards = RewardSet(cfg, _load, tokenizer, ArithmeticTask(), CPU)
    responses = _responses(tokenizer)
    total, parts = rewards.score(responses)
    assert list(parts) == ["model0_rm_a", "model1_rm_b", "rule_task"]
    for i, r in enumerate(responses):
        a, b = _reference_reward(rm_a, list(r.sequence_ids)), _reference_reward(rm_b, list(r.sequence_ids))
        rule = 1.0 if i % 2 == 0 else 0.0
        assert parts["model0_rm_a"][i].item() == pytest.approx(a, abs=1e-5)
        assert parts["model1_rm_b"][i].item() == pytest.approx(b, abs=1e-5)
        assert parts["rule_task"][i].item() == rule
        assert total[i].item() == pytest.approx(0.7 * a - 1.3 * b + 2.0 * rule, abs=1e-5)
    assert len({round(x, 6) for x in parts["model0_rm_a"].tolist()}) > 1  # the models really differ per response


def test_unnormalized_source_and_user_rule(tiny_llama, tmp_path, monkeypatch):
    rm = _make_rm(tiny_llama, tmp_path / "rm", seed=3, mean=5.0, std=10.0)
    (tmp_path / "myrules.py").write_text("def length(prompt, response, row):\n    return float(len(response)) + row['bonus']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tokenizer = load_tokenizer(tiny_llama)
    cfg = RewardConfig(sources=(RewardSourceConfig(model=rm, normalize=False), RewardSourceConfig(rule="myrules:length")))
    rewards = RewardSet(cfg, _load, tokenizer, None, CPU)
    r = Response("1+2=", "3", tuple(tokenizer("1+2=")["input_ids"] + tokenizer("3", add_special_tokens=False)["input_ids"]),
                 {"bonus": 0.5})
    total, parts = rewards.score([r])
    raw = _reference_reward(rm, list(r.sequence_ids)) * 10.0 + 5.0  # undo the reference's normalisation
    assert parts["model0_rm"].item() == pytest.approx(raw, abs=1e-5)
    assert parts["rule_myrules.length"].item() == 1.5
    assert total.item() == pytest.approx(raw + 1.5, abs=1e-5)


@pytest.mark.parametrize("rule, message", [("nosuch", "not a known rule"), ("nosuchmodule:f", "cannot be imported"),
                                           ("json:dumps", "(prompt, response, row)")])
def test_bad_rules_fail_before_anything_loads(rule, message, tiny_llama):
    loaded = []
    cfg = RewardConfig(sources=(RewardSourceConfig(model="never-loaded"), RewardSourceConfig(rule=rule)))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RewardSet(cfg, loaded.append, load_tokenizer(tiny_llama), ArithmeticTask(), CPU)
    assert loaded == []


def test_task_rule_needs_a_task(tiny_llama):
    with pytest.raises(ConfigError, match="task.name is null"):
        RewardSet(RewardConfig(), _load, load_tokenizer(tiny_llama), None, CPU)


def test_source_needs_exactly_one_kind():
    with pytest.raises(ConfigError, match="exactly one of `model`"):
        RewardSourceConfig(model="x", rule="task")
    with pytest.raises(ConfigError, match="exactly one of `model`"):
        load_config(GenerateConfig, None, ["reward.sources=[{weight: 2}]"])


def test_penalties_by_hand():
    cfg = RewardConfig(length_penalty=0.1, missing_eos_penalty=-1.0)
    out = adjust_scores(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([2, 8, 3]), torch.tensor([True, False, True]), cfg)
    torch.testing.assert_close(out, torch.tensor([0.8, -0.8, -0.3]))
    assert adjust_scores(torch.tensor([1.0]), torch.tensor([5]), torch.tensor([False]), RewardConfig()).tolist() == [1.0]
