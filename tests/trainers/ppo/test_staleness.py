"""The versions a generation records (`Generation.versions`: spans of response tokens and the policy version that
sampled each) and the staleness figures of a step's samples (`staleness_stats`), against ages counted by hand."""

from __future__ import annotations

import pytest

from hpcrlhf.engines.rollout import Generation
from hpcrlhf.engines.rollout.contract import head_version, stamp_version, token_versions
from hpcrlhf.run.stats import add_stats, new_stats
from hpcrlhf.trainers.ppo.staleness import staleness_stats


def generation(tokens: int, versions=None, mask=None) -> Generation:
    return Generation([1, 2], list(range(10, 10 + tokens)), [0.0] * tokens, True, action_mask=mask, versions=versions)


def test_a_generation_paused_across_syncs_has_a_version_per_token_and_its_head_is_its_oldest():
    g = generation(6, versions=[(0, 3), (2, 4), (5, 6)])
    assert token_versions(g) == [3, 3, 4, 4, 4, 6] and head_version(g) == 3
    assert token_versions(generation(3, versions=[(0, 7)])) == [7, 7, 7]
    assert token_versions(generation(0, versions=[(0, 7)])) == []
    for bad in ([(1, 3)], [(0, 3), (4, 4), (2, 5)], [(0, 3), (7, 4)]):
        with pytest.raises(ValueError):
            token_versions(generation(6, versions=bad))
    with pytest.raises(ValueError, match="not recorded"):
        head_version(generation(2))


def test_stamping_records_the_launch_version_where_the_engine_recorded_none():
    recorded, blank = generation(2, versions=[(0, 1), (1, 2)]), generation(2)
    stamp_version([recorded, blank], 5)
    assert recorded.versions == [(0, 1), (1, 2)] and blank.versions == [(0, 5)]


def test_staleness_figures_count_each_sample_by_its_oldest_token_and_each_model_token_by_its_own():
    """At version 10 with k = 2: a sample of version 8 (age 2), one paused at 9 and continued at 10 (age 1;
    its tokens 1, 1, 0, 0), one of 10 (age 0) whose 2 environment tokens (mask) are no model tokens, and one of 9."""
    samples = [generation(3, versions=[(0, 8)]), generation(4, versions=[(0, 9), (2, 10)]),
               generation(4, versions=[(0, 10)], mask=[True, False, False, True]), generation(1, versions=[(0, 9)])]
    stats = staleness_stats(samples, 10, 2)
    # by hand: heads 2, 1, 0, 1 -> mean 1; model tokens: 3 x 2 + (1 + 1 + 0 + 0) + 2 x 0 + 1 x 1 over 3 + 4 + 2 + 1
    assert stats == {"rollout/staleness": (4.0, 4), "rollout/staleness_tokens": (9.0, 10),
                     "rollout/staleness_share/0": (1.0, 4), "rollout/staleness_share/1": (2.0, 4),
                     "rollout/staleness_share/2": (1.0, 4), "rollout/staleness_share/older": (0.0, 4),
                     "rollout/partial_share": (1.0, 4)}
    # (sum, count) pairs: two ranks' figures add up to the mean over both
    both = add_stats(add_stats(new_stats(), stats), staleness_stats(samples[:1], 10, 2))
    assert both["rollout/staleness"] == [6.0, 5] and both["rollout/staleness_share/2"] == [2.0, 5]
    # a smaller k than the samples' (a run resumed with it, or rollout.stale_groups keep): the older ages are counted,
    # not hidden, under one key that every rank sends whatever its samples (the ranks' figures are summed key by key)
    assert staleness_stats(samples, 10, 1)["rollout/staleness_share/older"] == (1.0, 4)
    assert sorted(staleness_stats(samples[1:], 10, 0)) == sorted(staleness_stats(samples[2:3], 10, 0)) == [
        "rollout/partial_share", "rollout/staleness", "rollout/staleness_share/0", "rollout/staleness_share/older",
        "rollout/staleness_tokens"]
    with pytest.raises(ValueError, match=r"samples of versions after 8 cannot be trained at it: \[-2, -1, 0\]"):
        staleness_stats(samples[:3], 8, 2)


def test_a_checkpoint_keeps_done_batches_whole_and_those_under_way_as_their_engine_suspended_them(tmp_path):
    """`save_ahead` / `load_ahead` / `PPOTrainer.restore_ahead`: a done batch comes back as generations, one kept
    under way as its engine's state (continued at the first step); resuming the latter without rollout.partial on
    an engine loop is a clear error naming the steps and the settings, before any step."""
    from types import SimpleNamespace

    from hpcrlhf.config import load_config
    from hpcrlhf.config.schema import PPOConfig
    from hpcrlhf.engines.rollout.contract import Done, SamplingParams
    from hpcrlhf.errors import ConfigError
    from hpcrlhf.trainers.online import LaunchedRollout
    from hpcrlhf.trainers.ppo.driver import PPOTrainer
    from hpcrlhf.trainers.ppo.staleness import Ahead, load_ahead, save_ahead

    done = [[generation(2, versions=[(0, 1)])]]
    save_ahead([Ahead(2, LaunchedRollout([], SamplingParams(), Done(done), version=1))], tmp_path, 0,
               under_way={3: (2, "state of step 3's batch")})
    saved = load_ahead(tmp_path, 0)
    assert [(s.step, s.launched_at, s.generations is not None, s.under_way) for s in saved] == [
        (2, 1, True, None), (3, 2, False, "state of step 3's batch")]
    cfg = load_config(PPOConfig, None, ["rollout.backend=vllm", "rollout.max_staleness=2", "ppo.tis_cap=2"])
    trainer = SimpleNamespace(cfg=cfg, rollout=object(), step_prompts=lambda step: [], sampling=lambda step, n: None)
    with pytest.raises(ConfigError) as e:
        PPOTrainer.restore_ahead(trainer, tmp_path, 0)
    assert str(e.value) == (f"rollout.partial: the checkpoint {tmp_path} holds the batches of steps [4] under way on "
                            "an engine loop, to go on where they stopped; resume with the settings that saved it "
                            "(rollout.partial=true, rollout.backend=vllm, rollout.max_staleness >= 1)")
    assert list(trainer.ahead) == [2] and trainer.suspended == {3: (2, "state of step 3's batch")}
