"""`reward.sources[i].servers`: sources the job's own reward servers score (ppo on Ray), and every
setting that cannot work refused when the config loads, naming the field, the value and the fix."""

from __future__ import annotations

import pytest

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import GenerateConfig, PPOConfig, RSConfig, ServeRewardConfig
from hpcrlhf.errors import ConfigError
from tests.launch_helpers import run_cli

RAY = ["placement.runtime=ray", "rollout.backend=vllm", "placement.vllm={engines: 1}"]


def test_served_and_in_job_sources_are_told_apart():
    cfg = load_config(PPOConfig, overrides=[*RAY, "reward.sources=[{rule: task, servers: 2}, {model: rm1}, "
                                                  "{model: rm2, servers: 1, weight: 0.5}]"])
    assert [(i, s.rule or s.model, s.servers) for i, s in cfg.served_sources()] == [(0, "task", 2), (2, "rm2", 1)]
    assert cfg.in_job_reward_models() == [("reward.sources[1].model", "rm1")]
    assert cfg.reward_models() == [("reward.sources[1].model", "rm1"), ("reward.sources[2].model", "rm2")]
    assert cfg.placement.reward_server.cpus == 1 and cfg.placement.reward_server.start_timeout_s == 600


@pytest.mark.parametrize("cls, overrides, needle", [
    (PPOConfig, [*RAY, "reward.sources=[{rule: task, servers: -1}]"],
     "servers: -1 is invalid: use 0 (scored in the job) or more servers"),
    (PPOConfig, [*RAY, "reward.sources=[{url: 'http://h:1/score', servers: 2}]"],
     "servers: 2 is invalid: a url source is a server already"),
    (PPOConfig, ["reward.sources=[{rule: task}, {rule: task_partial, servers: 2}]"],
     "reward.sources[1].servers: 2 is invalid: the job starts reward servers where the Ray runtime's node map "
     "places them: set placement.runtime=ray"),
    (RSConfig, ["rs.iterations=1", "reward.sources=[{rule: task, servers: 1}]"],
     "reward.sources[0].servers: 1 is invalid: only ppo on the Ray runtime starts reward servers, not rs"),
    (GenerateConfig, ["reward={sources: [{rule: task, servers: 1}]}"],
     "reward.sources[0].servers: 1 is invalid: only ppo on the Ray runtime starts reward servers, not generate"),
    (ServeRewardConfig, ["reward.sources=[{rule: task, servers: 1}]"],
     "not serve-reward (a server serves its sources itself)"),
    (PPOConfig, [*RAY, "placement.reward_server.cpus=0"],
     "placement.reward_server.cpus: 0 is invalid: use at least 1 CPU per rule server"),
    (PPOConfig, [*RAY, "placement.reward_server.start_timeout_s=0"],
     "placement.reward_server.start_timeout_s: 0.0 is invalid: give a positive number of seconds"),
])
def test_settings_that_cannot_work_are_refused_when_the_config_loads(cls, overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(cls, overrides=overrides)
    assert needle in str(e.value), str(e.value)


def test_the_cli_refuses_servers_on_the_local_runtime_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(["train", "ppo", "-o", str(out), "--set", "reward.sources=[{rule: task, servers: 2}]"], check=False)
    assert proc.returncode == 2, proc.stderr
    assert "reward.sources[0].servers: 2 is invalid" in proc.stderr and "placement.runtime=ray" in proc.stderr
    assert not out.exists()
