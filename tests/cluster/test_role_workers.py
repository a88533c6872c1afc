"""PPO role workers on the two-node Ray cluster, one role at a time against a local reference."""

from __future__ import annotations

import pytest
import torch

from hpcrlhf.config.jobspec import resolve_recipe
from hpcrlhf.trainers.ppo.ray.workers import RewardWorker, role_config
from hpcrlhf.cluster.reservation import reserve
from hpcrlhf.cluster.worker_group import WorkerGroup
from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.models.loading import load_tokenizer
from hpcrlhf.placement import Device, build_node_map
from hpcrlhf.trainers.ppo.ray.roles import RemoteRewards
from tests.test_rewards import _make_rm, _reference_reward, _responses


@pytest.mark.slow
def test_reward_workers_under_zero3_score_like_transformers(ray_cluster, tiny_llama, tmp_path):
    """A reward model sharded over two ranks (one per node) plus a rule: uneven batches are padded
    so both ZeRO-3 ranks run the same passes, and the scores come back in order."""
    rm = _make_rm(tiny_llama, tmp_path / "rm", seed=3, mean=0.2, std=1.5)
    cfg = load_config(PPOConfig, overrides=[f"model.path={tiny_llama}", "reward.batch_size=2",
                                            f"reward.sources=[{{model: {rm}, weight: 0.7}}, {{rule: task, weight: 2.0}}]"])
    reservation = reserve(build_node_map(load_config(PPOConfig, resolve_recipe("ppo-tiny-ray"))))
    try:
        group = WorkerGroup("reward", RewardWorker, reservation, [[Device(0, 1)], [Device(1, 1)]],
                            role_config(cfg, 3, False, False, "reward"), None)
        group.call("setup")
        rewards = RemoteRewards(group)
        responses = _responses(load_tokenizer(tiny_llama), n=7)  # 7 rows over 2 ranks: one padded
        total, parts = rewards.score(responses)
        assert rewards.names == ["model0_rm", "rule_task"] and total.shape == (7,)
        for i, r in enumerate(responses):
            expected = _reference_reward(rm, list(r.sequence_ids))
            assert parts["model0_rm"][i].item() == pytest.approx(expected, abs=1e-5)
            assert parts["rule_task"][i].item() == (1.0 if i % 2 == 0 else 0.0)
        assert torch.allclose(total, 0.7 * parts["model0_rm"] + 2.0 * parts["rule_task"])
        group.kill()
    finally:
        reservation.release()
