"""The `placement` section of PPOConfig: defaults that plan on one GPU, and range checks that name
the field, the value and the fix."""

from __future__ import annotations

import pytest

from hpcrlhf.config.loader import describe, load_config
from hpcrlhf.config.schema import PlacementConfig, PPOConfig, RoleConfig
from hpcrlhf.errors import ConfigError


def test_defaults_fit_one_gpu_with_everything_colocated():
    p = PPOConfig().placement
    assert (p.nodes, p.gpus_per_node) == (1, 1)
    assert p.colocate == (("actor", "critic", "ref", "reward", "vllm", "reward_server"),)
    assert p.reward.num_gpus == 0 and p.vllm.engines == 0  # rule reward and the hf backend by default
    assert "placement:" in describe(PPOConfig) and "Groups of roles that share the same GPUs" in describe(PPOConfig)


def test_recipe_style_mappings_load():
    cfg = load_config(PPOConfig, overrides=["placement.colocate=[[actor, ref], [critic, reward]]",
                                            "placement.actor={nodes: 2, gpus_per_node: 8, zero_stage: 3}"])
    assert cfg.placement.colocate == (("actor", "ref"), ("critic", "reward"))
    assert cfg.placement.actor == RoleConfig(nodes=2, gpus_per_node=8, zero_stage=3)


@pytest.mark.parametrize("overrides, needles", [
    (["placement.nodes=0"], ["placement.nodes: 0", "at least 1 node"]),
    (["placement.gpus_per_node=0"], ["placement.gpus_per_node: 0", "at least 1 GPU"]),
    (["placement.gpu_memory_gb=0"], ["placement.gpu_memory_gb: 0.0", "e.g. 80"]),
    (["placement.critic.nodes=-1"], ["placement.critic.nodes: -1", "0 (no GPUs) or more"]),
    (["placement.reward.gpus_per_node=-2"], ["placement.reward.gpus_per_node: -2"]),
    (["placement.vllm.engines=-1"], ["placement.vllm.engines: -1"]),
    (["placement.vllm.tensor_parallel_size=0"], ["placement.vllm.tensor_parallel_size: 0", "at least 1"]),
    (["placement.vllm.gpu_memory_utilization=1.5"], ["placement.vllm.gpu_memory_utilization: 1.5", "(0, 1]"]),
    (["placement.colocate=[[actor]]"], ["placement.colocate[0]: ['actor']", "two or more different roles"]),
    (["placement.colocate=[[actor, actor]]"], ["placement.colocate[0]", "two or more different roles"]),
    (["placement.colocate=[[actor, ref], [ref, critic]]"], ["placement.colocate[1]", "ref is already in "
                                                            "placement.colocate[0]", "merge the two groups"]),
    (["placement.colocate=[[actor, critc]]"], ["placement.colocate[0][1]", "'critc' is not one of",
                                               "did you mean 'critic'"]),
    (["placement.actor.zero_stage=2", "placement.actor.offload_params=true"],
     ["placement.actor.offload_params", "set placement.actor.zero_stage=3"]),
    (["placement.critic.zero_stage=0", "placement.critic.offload_optimizer=true"],
     ["placement.critic.offload_optimizer", "needs ZeRO"]),
    (["placement.ref.offload_optimizer=true"], ["placement.ref.offload_optimizer: True", "frozen", "leave it null"]),
    (["placement.runtime=ray"], ["rollout.backend: 'hf'", "set rollout.backend=vllm", "placement.runtime=local"]),
    (["placement.runtime=ray", "rollout.backend=vllm", "lora.rank=8"], ["lora.rank: 8", "use lora.rank=0"]),
    (["placement.runtime=slurm"], ["placement.runtime", "'slurm' is not one of"]),
])
def test_invalid_values_name_field_value_and_fix(overrides, needles):
    with pytest.raises(ConfigError) as info:
        load_config(PPOConfig, overrides=overrides)
    for needle in needles:
        assert needle in str(info.value)


def test_direct_construction_is_checked_too():
    with pytest.raises(ConfigError, match=r"placement\.colocate\[0\].*roles are actor, critic, ref, reward, vllm"):
        PlacementConfig(colocate=(("actor", "policy"),))
