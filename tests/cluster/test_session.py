"""Without RAY_ADDRESS a Ray PPO job starts a local Ray cluster on this host, so the node map must fit
the host's own GPUs, and every model path must be loadable, before anything starts. (`ppo-7b` on a
host without its 16 GPUs started a Ray cluster declaring them and failed 82 s later with a hub
traceback.) The tiny recipes simulate their GPUs on purpose (placement.simulated_gpus) and pass."""

from __future__ import annotations

import subprocess
import time

import pytest

from hpcrlhf.config.jobspec import resolve_recipe
from hpcrlhf.cluster.session import host_gpus, local_cluster_problem
from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.placement import build_node_map
from hpcrlhf.trainers.ppo.ray.entry import start_problems
from tests.launch_helpers import ROOT, cli_command, cli_env


@pytest.mark.parametrize("nodes, gpus, here, simulated, fits", [
    (1, 1, 1, False, True),
    (1, 8, 8, False, True),
    (1, 2, 0, True, True),     # ppo-tiny-ray-colocated on a CPU-only host
    (2, 4, 0, True, True),     # ppo-tiny-ray
    (2, 8, 0, False, False),   # ppo-7b on a CPU-only host
    (1, 8, 4, False, False),
    (2, 4, 8, False, False),   # enough GPUs, but both local nodes would use GPUs 0-3
])
def test_local_cluster_must_fit_this_host(nodes, gpus, here, simulated, fits):
    problem = local_cluster_problem(nodes, gpus, gpus_here=here, simulated=simulated)
    assert (problem is None) is fits, problem


def test_the_problem_names_the_layout_the_host_and_the_fixes():
    text = str(local_cluster_problem(2, 8, gpus_here=0, simulated=False))
    assert text.startswith("placement = 2 nodes x 8 GPUs: without RAY_ADDRESS the job starts a local Ray cluster "
                           "on this host, which has no GPU"), text
    for fix in ("`hpcrlhf submit RECIPE`", "`hpcrlhf sbatch RECIPE`", "RAY_ADDRESS=HOST:PORT", "ppo-tiny-ray-colocated"):
        assert fix in text, text
    shared = str(local_cluster_problem(2, 4, gpus_here=8, simulated=False))
    assert "which has 8 GPUs" in shared and "2 nodes would all share its GPUs 0-3" in shared, shared
    assert "1 node x at most 8 GPUs" in shared


@pytest.fixture
def no_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.mark.parametrize("recipe", ["ppo-tiny-ray", "ppo-tiny-ray-colocated"])
def test_tiny_recipes_start_anywhere(no_ray_address, recipe):
    cfg = load_config(PPOConfig, resolve_recipe(recipe))
    assert cfg.placement.simulated_gpus
    assert start_problems(cfg, build_node_map(cfg)) == []


@pytest.mark.parametrize("recipe", ["ppo-7b", "ppo-13b", "ppo-34b", "ppo-70b"])
def test_large_recipes_need_their_gpus_and_their_models(no_ray_address, monkeypatch, recipe):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config(PPOConfig, resolve_recipe(recipe))
    node_map = build_node_map(cfg)
    found = [str(p) for p in start_problems(cfg, node_map)]
    if not (node_map.nodes == 1 and node_map.gpus_per_node <= host_gpus()):
        assert found[0].startswith(f"placement = {node_map.nodes} nodes x {node_map.gpus_per_node} GPUs: "), found
    assert any(p.startswith(f"model.path = {cfg.model.path!r}: is neither a local folder") and "HF_HUB_OFFLINE=1" in p
               for p in found), found  # tests run offline (tests/conftest.py)


def test_a_served_reward_models_path_is_checked_before_ray_starts(no_ray_address, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub model the planner knows the shape of, not downloaded here
    cfg = load_config(PPOConfig, resolve_recipe("ppo-tiny-ray"), [
        "reward.sources=[{rule: task}, {model: Qwen/Qwen2.5-0.5B, servers: 1}]", "critic.path=builtin:tiny-llama",
        "placement.colocate=[[actor, ref], [critic, reward_server]]"])
    found = [str(p) for p in start_problems(cfg, build_node_map(cfg))]
    assert any(p.startswith("reward.sources[1].model = 'Qwen/Qwen2.5-0.5B': ") and "HF_HUB_OFFLINE=1" in p
               for p in found), found


def test_with_ray_address_the_cluster_is_checked_by_ray_not_by_this_host(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    cfg = load_config(PPOConfig, resolve_recipe("ppo-7b"), ["model.path=builtin:tiny-llama",
                                                            "reward.sources=[{model: builtin:tiny-llama}]"])
    assert start_problems(cfg, build_node_map(cfg)) == []


def test_cli_ppo_7b_on_this_host_fails_before_ray_starts(tmp_path):
    env = {k: v for k, v in cli_env().items() if k != "RAY_ADDRESS"}
    start = time.monotonic()
    proc = subprocess.run(cli_command(["train", "ppo", "--config", "ppo-7b", "-o", str(tmp_path / "run")]), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    took, err = time.monotonic() - start, proc.stderr
    assert proc.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert "hpcrlhf: error: ppo on Ray would fail here, so nothing was started (2 problems):" in err, err[-3000:]
    assert "1. placement = 2 nodes x 8 GPUs: without RAY_ADDRESS the job starts a local Ray cluster on this host" in err
    assert "hpcrlhf submit RECIPE" in err and "RAY_ADDRESS=HOST:PORT" in err
    assert "2. model.path = 'meta-llama/Llama-2-7b-hf': is neither a local folder" in err
    assert "starting a local Ray cluster" not in proc.stdout + err
    assert took < 60, took
