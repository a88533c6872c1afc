"""Node maps of representative layouts pinned as golden text and JSON (tests/placement/golden/).

Run with HPCRLHF_UPDATE_GOLDEN=1 to rewrite the files after an intended change, then review the
diff: it shows exactly how placements and memory estimates moved.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpcrlhf.placement import render_text

from .helpers import plan
from .test_nodemap import HYBRID_1X8, HYBRID_1X8_SLEEP

GOLDEN = Path(__file__).parent / "golden"
SCALE_70B_16X8 = ["placement.actor.nodes=4", "placement.critic.nodes=4", "placement.ref.nodes=4",
                  "placement.reward.nodes=4", "placement.vllm.engines=16"]

SERVED = ["reward.sources=[{rule: task, servers: 2}, {model: 'builtin:tiny-llama', servers: 1, weight: 0.0}]",
          "placement.colocate=[[actor, ref], [critic, reward_server]]"]

AGENT = ["agent={environment: 'hpcrlhf.agents.calculator:Calculator', max_tokens: 128}", "ppo.advantage_estimator=grpo",
         "reward.sources=[{env: true}, {rule: task, servers: 1}]", "placement.critic.gpus_per_node=0",
         "placement.colocate=[[actor, ref, vllm]]", "placement.cpus_per_node=16"]

CASES = {  # name: (recipe, overrides, nodes, gpus per node)
    "1x8-7b-hybrid": ("ppo-7b", HYBRID_1X8, 1, 8),  # everything colocated on one node
    "1x8-7b-hybrid-sleep": ("ppo-7b", HYBRID_1X8_SLEEP, 1, 8),  # ... taking turns with the memory
    "2x4-tiny-ray": ("ppo-tiny-ray", [], 2, 4),
    "2x4-tiny-ray-reward-servers": ("ppo-tiny-ray", SERVED, 2, 4),  # rule servers on CPU cores, one on the critic's GPU
    "1x2-tiny-ray-colocated": ("ppo-tiny-ray-colocated", [], 1, 2),
    # a rule server and the engine's environment threads on the node's CPU cores
    "1x2-tiny-ray-colocated-agent": ("ppo-tiny-ray-colocated", AGENT, 1, 2),
    "2x8-7b": ("ppo-7b", [], 2, 8),
    "4x8-13b": ("ppo-13b", [], 4, 8),
    "4x8-34b": ("ppo-34b", [], 4, 8),
    "4x8-70b": ("ppo-70b", [], 4, 8),
    "16x8-70b": ("ppo-70b", SCALE_70B_16X8, 16, 8),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_node_map_matches_golden(name):
    recipe, overrides, nodes, gpus = CASES[name]
    node_map = plan(recipe, *overrides, nodes=nodes, gpus=gpus)
    for suffix, text in (("txt", render_text(node_map)), ("json", node_map.to_json())):
        path = GOLDEN / f"{name}.{suffix}"
        if os.environ.get("HPCRLHF_UPDATE_GOLDEN") == "1":
            path.write_text(text)
        assert path.exists(), f"{path} is missing: run with HPCRLHF_UPDATE_GOLDEN=1 to write it"
        assert text == path.read_text(), f"{path} differs: review, then HPCRLHF_UPDATE_GOLDEN=1 to accept"
