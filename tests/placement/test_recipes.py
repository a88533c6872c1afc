"""Every shipped PPO recipe loads as a PPOConfig and plans at the allocation it declares."""

from __future__ import annotations

import pytest

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.placement import build_node_map

from .helpers import RECIPES

SHIPPED = sorted(p.stem for p in RECIPES.glob("ppo-*.yaml"))


def test_the_layouts_are_shipped():
    assert {"ppo-tiny-ray", "ppo-7b", "ppo-13b", "ppo-34b", "ppo-70b"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_recipe_plans_at_its_intended_shape(name):
    cfg = load_config(PPOConfig, RECIPES / f"{name}.yaml")
    node_map = build_node_map(cfg)
    assert (node_map.nodes, node_map.gpus_per_node) == (cfg.placement.nodes, cfg.placement.gpus_per_node)
    assert all(node_map.devices.values())  # every GPU used
    assert (cfg.rollout.backend == "vllm") == bool(node_map.engines)
