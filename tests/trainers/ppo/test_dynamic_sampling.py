"""DAPO dynamic sampling (hpcrlhf.trainers.ppo.dynamic_sampling) on scripted rounds: which groups a
step keeps, in which order, when rounds stop (on every rank together), and what is counted.
Expected values are written out by hand from the scripted scores."""

from __future__ import annotations

import pytest
import torch

from hpcrlhf.config.jobspec import build_config
from hpcrlhf.errors import ConfigError
from hpcrlhf.trainers.ppo.dynamic_sampling import fill_step, informative_groups, join_rollouts, take_groups
from hpcrlhf.trainers.online import Rollout


def scripted(name: str, scores: list[float]) -> Rollout:
    """A rollout whose sample i is called f"{name}{i}" (in prompts, generations and responses), with a
    second reward part equal to 10 x the score."""
    labels = [f"{name}{i}" for i in range(len(scores))]
    s = torch.tensor(scores)
    return Rollout(list(labels), list(labels), list(labels), s, {"rule": s * 10})


def test_a_group_is_informative_when_its_scores_differ():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.3, 0.3 + 1e-7, 0.3, 0.0, 0.0, 2e-6])
    assert informative_groups(scores, 3) == [True, True, False, True]
    assert informative_groups(scores, 2) == [False, True, False, False, True, True]
    with pytest.raises(ValueError, match="12 scores do not form groups of 5"):
        informative_groups(scores, 5)


def test_groups_are_taken_and_joined_whole_and_in_order():
    r = scripted("a", [0, 1, 2, 3, 4, 5])
    picked = take_groups(r, [2, 0], 2)
    assert picked.prompts == ["a4", "a5", "a0", "a1"] and picked.scores.tolist() == [4, 5, 0, 1]
    assert picked.parts["rule"].tolist() == [40, 50, 0, 10]
    both = join_rollouts([picked, take_groups(scripted("b", [7, 8]), [0], 2)])
    assert both.generations == ["a4", "a5", "a0", "a1", "b0", "b1"] and both.scores.tolist() == [4, 5, 0, 1, 7, 8]
    assert take_groups(r, [], 2).scores.numel() == 0


def rounds_of(*scores: list[float]):
    calls = []

    def generate(r: int) -> Rollout:
        calls.append(r)
        return scripted("abcdefgh"[r], scores[r])

    return generate, calls


def test_the_first_round_suffices_when_every_group_teaches():
    generate, calls = rounds_of([0, 1, 1, 0, 0, 1])
    filled = fill_step(generate, n=2, max_rounds=4)
    assert calls == [0] and filled.rounds == 1
    assert filled.rollout.prompts == ["a0", "a1", "a2", "a3", "a4", "a5"]
    assert filled.metrics() == {"rollout/generation_rounds": 1.0, "rollout/informative_share": 1.0,
                                "rollout/dropped_groups": 0.0, "rollout/extra_samples": 0.0,
                                "rollout/uninformative_kept": 0.0}


def test_uninformative_groups_are_replaced_by_later_rounds_and_the_surplus_dropped():
    # round a: groups a01 (1,1: no), a23 (0,1: yes), a45 (0,0: no) -> 1 of 3
    # round b: b01 yes, b23 no, b45 yes -> 3 in hand; round c never runs
    generate, calls = rounds_of([1, 1, 0, 1, 0, 0], [1, 0, 1, 1, 0, 1])
    filled = fill_step(generate, n=2, max_rounds=4)
    assert calls == [0, 1]
    assert filled.rollout.prompts == ["a2", "a3", "b0", "b1", "b4", "b5"]
    assert filled.rollout.scores.tolist() == [0, 1, 1, 0, 0, 1]
    assert filled.rollout.parts["rule"].tolist() == [0, 10, 10, 0, 0, 10]
    assert filled.metrics() == {"rollout/generation_rounds": 2.0, "rollout/informative_share": pytest.approx(1 / 3),
                                "rollout/dropped_groups": 3.0, "rollout/extra_samples": 6.0,
                                "rollout/uninformative_kept": 0.0}


def test_informative_groups_beyond_the_quota_are_dropped_in_generation_order():
    generate, _ = rounds_of([1, 1, 0, 1], [0, 1, 1, 0])  # a: 1 of 2; b: 2 of 2 -> b23 is surplus
    filled = fill_step(generate, n=2, max_rounds=4)
    assert filled.rollout.prompts == ["a2", "a3", "b0", "b1"]
    assert filled.dropped_groups == 2 and filled.uninformative_kept == 0  # a01 (uninformative) and b23 (surplus)


def test_when_the_rounds_run_out_dropped_groups_fill_the_step_and_are_counted():
    generate, calls = rounds_of([1, 1, 0, 1], [0, 0, 1, 1])  # 1 informative group in 2 rounds, quota 2
    filled = fill_step(generate, n=2, max_rounds=2)
    assert calls == [0, 1]
    assert filled.rollout.prompts == ["a2", "a3", "a0", "a1"]  # the informative one, then the first dropped
    assert filled.uninformative_kept == 1 and filled.dropped_groups == 2 and filled.extra_samples == 4


def test_every_rank_goes_on_while_any_rank_misses_groups():
    """This rank is full after round a, another rank misses 2 groups after it and none after b:
    this rank generates round b too (its round-b groups are surplus) and then stops with the rest."""
    generate, calls = rounds_of([0, 1, 1, 0], [0, 1, 0, 1], [1, 1, 1, 1])
    others_missing = iter([2, 0])
    filled = fill_step(generate, n=2, max_rounds=4,
                       missing_anywhere=lambda mine: mine + next(others_missing))
    assert calls == [0, 1] and filled.rounds == 2
    assert filled.rollout.prompts == ["a0", "a1", "a2", "a3"] and filled.dropped_groups == 2
    summed = filled.metrics(reduce=lambda values: [2 * v for v in values])  # two ranks alike
    assert summed["rollout/dropped_groups"] == 4 and summed["rollout/informative_share"] == 1.0
    assert summed["rollout/generation_rounds"] == 2


def test_dynamic_sampling_needs_groups_and_at_least_one_round():
    with pytest.raises(ConfigError, match=r"ppo.dynamic_sampling: true drops prompts whose samples all scored the "
                                          r"same, but rollout.samples_per_prompt is 1: use at least 2"):
        build_config("ppo", None, ["ppo.dynamic_sampling=true", "rollout.samples_per_prompt=1"], None)
    with pytest.raises(ConfigError, match=r"ppo.dynamic_sampling_max_rounds"):
        build_config("ppo", None, ["ppo.dynamic_sampling=true", "ppo.dynamic_sampling_max_rounds=0"], None)
    cfg = build_config("ppo", None, ["ppo.dynamic_sampling=true", "ppo.advantage_estimator=grpo"], None)
    assert cfg.ppo.dynamic_sampling and cfg.ppo.dynamic_sampling_max_rounds == 4


def test_groups_are_compared_on_the_sources_before_the_penalties_by_default():
    """DAPO compares accuracy: two wrong answers whose overlong penalties differ teach nothing about the
    task. Round a: group a01 is wrong twice (sources 0, 0) with different penalties (shaped -0.3,
    -0.1), group a23 has one right answer. Scripted by hand."""
    def generate(r: int) -> Rollout:
        rollout = scripted("ab"[r], [-0.3, -0.1, 0.0, 1.0] if r == 0 else [1.0, 0.0, 1.0, 1.0])
        rollout.sources = torch.tensor([0.0, 0.0, 0.0, 1.0] if r == 0 else [1.0, 0.0, 1.0, 1.0])
        rollout.parts["rule"] = rollout.sources.clone()
        return rollout

    by_score = fill_step(generate, n=2, max_rounds=4)
    assert by_score.rollout.prompts == ["a2", "a3", "b0", "b1"] and by_score.rounds == 2
    assert by_score.rollout.sources.tolist() == [0.0, 1.0, 1.0, 0.0]
    shaped = fill_step(generate, n=2, max_rounds=4, what="shaped")
    assert shaped.rollout.prompts == ["a0", "a1", "a2", "a3"] and shaped.rounds == 1  # today's choice, kept as a setting
    by_rule = fill_step(generate, n=2, max_rounds=4, what="rule")
    assert by_rule.rollout.prompts == by_score.rollout.prompts


def test_the_filter_is_score_shaped_or_a_reward_source():
    assert build_config("ppo", None, ["ppo.dynamic_sampling=true"], None).ppo.dynamic_sampling_filter == "score"
    cfg = build_config("ppo", None, ["ppo.dynamic_sampling=true", "task.name=arithmetic", "ppo.advantage_estimator=grpo",
                                     "reward.sources=[{rule: task}]", "ppo.dynamic_sampling_filter=rule_task"], None)
    assert cfg.ppo.dynamic_sampling_filter == "rule_task"
    with pytest.raises(ConfigError, match=r"ppo.dynamic_sampling_filter: 'accuracy' .*use score, shaped or a reward "
                                          r"source's name \(rule_task\)"):
        build_config("ppo", None, ["ppo.dynamic_sampling=true", "task.name=arithmetic", "reward.sources=[{rule: task}]",
                                   "ppo.dynamic_sampling_filter=accuracy"], None)
