"""Several sampled answers per prompt (`eval.samples_per_prompt`): mean@n, pass@k and maj@n of constructed
samples, by hand; which answer the vote reads (`eval.vote`)."""

from __future__ import annotations

import pytest

from hpcrlhf.config.schema.rules import RulesConfig
from hpcrlhf.config.schema.sections import EvalConfig
from hpcrlhf.rewards.rules import EvalMetrics
from hpcrlhf.rewards.response import Response
from hpcrlhf.rewards.sampled import Sampling, sampled_stats, sampling_for
from hpcrlhf.rewards.math_answers import last_number


def test_mean_pass_at_k_and_majority_of_two_prompts_of_four_samples_by_hand():
    # prompt 0: right once ("12"), wrong three times, the majority says 13 (wrong); prompt 1: right twice, the
    # majority (7, twice, before 8 once) is right; scores of 0.5 count as wrong at the threshold 1.0
    texts = ["12", "13", "so 13", "13", "7", "8", "x", "=7"]
    score = [1.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0]
    out = sampled_stats({"task_score": score}, texts, Sampling(4, (1, 2, 4), 1.0, last_number))
    assert out["eval/task_score"] == (3.5, 8.0)  # mean@4 over every sample
    assert out["eval/task_score/pass@1"] == pytest.approx((0.25 + 0.5, 2.0))
    # pass@2: 1 - C(3,2)/C(4,2) = 0.5 for one right; 1 - C(2,2)/C(4,2) = 5/6 for two
    assert out["eval/task_score/pass@2"] == pytest.approx((0.5 + 5 / 6, 2.0))
    assert out["eval/task_score/pass@4"] == (2.0, 2.0)
    assert out["eval/task_score/maj@4"] == (0.0 + 1.0, 2.0)
    # a lower threshold counts the 0.5 as right too
    loose = sampled_stats({"task_score": score}, texts, Sampling(4, (1,), 0.5, None))
    assert loose["eval/task_score/pass@1"] == pytest.approx((0.25 + 0.75, 2.0)) and "eval/task_score/maj@4" not in loose
    with pytest.raises(ValueError, match="7 samples are no whole number of prompts of 4"):
        sampled_stats({"task_score": score[:7]}, texts[:7], Sampling(4, (1,), 1.0, None))


def test_eval_metrics_report_sampled_keys_and_keep_one_samples_keys():
    metrics = EvalMetrics(["tests.rewards.test_sampled:long"], None)
    responses = [Response("p", t, (), {}) for t in ("aaaa", "a", "aaa", "aaaaa")]
    assert metrics.stats(responses) == {"eval/long": (2.0, 4)}
    sampled = metrics.stats(responses, "_x", Sampling(2, (1, 2), 1.0, None))
    assert sampled == {"eval/long_x": (2.0, 4.0), "eval/long_x/pass@1": (1.0, 2.0), "eval/long_x/pass@2": (2.0, 2.0)}


def long(prompt, response, row):
    return float(len(response) >= 4)


@pytest.mark.parametrize("cfg, rules, task, vote", [
    (EvalConfig(), RulesConfig(), object(), None),  # one sample: nothing sampled
    (EvalConfig(samples_per_prompt=4), RulesConfig(), object(), "last_number"),  # the bundled task's numbers
    (EvalConfig(samples_per_prompt=4, metrics=("math",)), RulesConfig(), None, "boxed"),  # rules.math.extract
    (EvalConfig(samples_per_prompt=4), RulesConfig(), None, "none"),  # nothing says what an answer is
    (EvalConfig(samples_per_prompt=4, vote="boxed"), RulesConfig(), object(), "boxed"),
    (EvalConfig(samples_per_prompt=4, vote="none"), RulesConfig(), object(), "none"),
])
def test_the_vote_reads_answers_as_the_metrics_do(cfg, rules, task, vote):
    s = sampling_for(cfg, rules, task)
    if vote is None:
        assert s is None
        return
    assert s.ks == (1, 4) and s.n == 4
    read = None if s.answer is None else s.answer("so \\boxed{41}, not 42")
    assert read == {"last_number": "42", "boxed": "41", "none": None}[vote]


@pytest.mark.parametrize("kind, overrides, message", [
    ("sft", ["eval.pass_k=[2]"], r"eval.pass_k: \[2\] is invalid: pass@k needs several samples per prompt"),
    ("sft", ["eval.samples_per_prompt=4", "eval.pass_k=[1, 8]"], r"each k must be 1..eval.samples_per_prompt \(4\)"),
    ("sft", ["eval.samples_per_prompt=0"], r"eval.samples_per_prompt: 0 is invalid"),
    ("ppo", ["eval.temperature=0"], r"eval.temperature: 0.0 is invalid: use a positive temperature"),
    ("ppo", ["eval.top_p=1.5"], r"eval.top_p: 1.5 is invalid"),
    ("rm", ["eval.samples_per_prompt=4"], r"a reward model generates no answers to sample"),
])
def test_bad_sampling_settings_name_the_key_and_the_fix(kind, overrides, message):
    from hpcrlhf.config.loader import load_config
    from hpcrlhf.config.schema import PPOConfig, RMConfig, SFTConfig
    from hpcrlhf.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config({"sft": SFTConfig, "ppo": PPOConfig, "rm": RMConfig}[kind], overrides=overrides)
