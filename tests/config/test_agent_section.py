"""The `agent` section's own checks: each bad value names the key, the value and the fix."""

from __future__ import annotations

import pytest

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import GenerateConfig, PPOConfig, RSConfig
from hpcrlhf.config.schema.agent import AgentConfig
from hpcrlhf.config.schema.online import source_name
from hpcrlhf.engines.rollout.settings import vllm_engine_args
from hpcrlhf.errors import ConfigError


def test_defaults_and_names_of_user_code():
    a = AgentConfig(environment="guess:GuessNumber", environment_args={"low": 1}, tools=("calc:multiply",),
                    tool_parser="my.parsers:calls")
    assert (a.max_turns, a.max_tokens, a.schedule, a.on_env_error) == (4, 512, None, "fail")
    assert AgentConfig().tool_parser == "hermes"


@pytest.mark.parametrize("kwargs, message", [
    ({"environment": "guess"}, r"agent.environment: 'guess' is invalid: use package.module:Class"),
    ({"tools": ("calc:multiply", "multiply")}, r"agent.tools\[1\]: 'multiply' is invalid: use package.module:function"),
    ({"tool_parser": "json"}, r"agent.tool_parser: 'json' is invalid: use hermes or package.module:function"),
    ({"environment_args": {"low": 1}}, r"agent.environment_args: \{'low': 1\} is invalid: arguments are for "
                                       r"agent.environment"),
    ({"max_turns": 0}, r"agent.max_turns: 0 is invalid: use at least 1"),
    ({"max_observation_chars": 8}, r"agent.max_observation_chars: 8 is invalid: use at least 16"),
    ({"env_workers": 0}, r"agent.env_workers: 0 is invalid"),
    ({"step_timeout_s": 0.0}, r"agent.step_timeout_s: 0.0 is invalid: use a positive number of seconds"),
    ({"step_timeout_s": float("nan")}, r"agent.step_timeout_s: nan is invalid: use a finite number"),
    ({"max_failed_share": 1.5}, r"agent.max_failed_share: 1.5 is invalid: use a share in \[0, 1\]"),
])
def test_bad_values_name_key_value_and_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        AgentConfig(**kwargs)


CALC = ["task.name=calculator", "data.apply_chat_template=true", "agent.environment=hpcrlhf.agents.calculator:Calculator"]


def test_the_section_attaches_to_online_jobs_and_the_environment_is_a_reward_source():
    cfg = load_config(PPOConfig, overrides=[*CALC, "reward.sources=[{env: true}, {rule: task, weight: 0.5}]",
                                            "rollout.max_new_tokens=48", "agent.max_tokens=128"])
    assert cfg.agent.environment == "hpcrlhf.agents.calculator:Calculator" and cfg.agent.max_tokens == 128
    assert [source_name(i, s) for i, s in enumerate(cfg.reward.sources)] == ["env", "rule_task"]
    # a trajectory's tokens after its prompt fit the vLLM engine
    assert vllm_engine_args(cfg)["max_model_len"] == cfg.data.max_length + 128
    assert load_config(PPOConfig).agent is None


@pytest.mark.parametrize("cls, overrides, message", [
    (PPOConfig, ["reward.sources=[{env: true}]"],
     r"reward.sources\[0\].env: True is invalid: the environment's reward needs the agent section"),
    (PPOConfig, [*CALC, "reward.sources=[{env: true, rule: task}]"], r"each source sets exactly one of .*env=True"),
    (PPOConfig, [*CALC, "reward.sources=[{env: true, servers: 1}]"], r"servers: 1 is invalid: the environment's reward"),
    (PPOConfig, [*CALC, "rollout.max_new_tokens=64", "agent.max_tokens=32"],
     r"agent.max_tokens: 32 is invalid: a model turn may use rollout.max_new_tokens \(64\) tokens"),
    (PPOConfig, [*CALC, "rollout.backend=hf", "agent.schedule=trajectory"],
     r"agent.schedule: 'trajectory' is invalid: HF generate runs every trajectory turn by turn"),
    (PPOConfig, [*CALC, "reward.sources=[{env: true}]", "agent.max_tokens=256", "agent.reward_placement=turn",
                 "ppo.advantage_estimator=grpo"],
     r"agent.reward_placement: 'turn' is invalid: ppo.advantage_estimator grpo scores a trajectory as a whole"),
    (PPOConfig, [*CALC, "reward.sources=[{env: true, weight: 0.0}, {rule: task}]", "agent.max_tokens=256",
                 "agent.reward_placement=turn"],
     r"agent.reward_placement: 'turn' is invalid: it places the environment's turn rewards, but no reward source"),
    (RSConfig, ["rs.iterations=1", "reward.sources=[{env: true}]"],
     r"reward.sources\[0\].env: True is invalid: .* which ppo and generate \(with an agent section\) run, not rs"),
    (RSConfig, [*CALC, "rs.iterations=1"], r"unknown key 'agent'"),
    (GenerateConfig, ["agent={environment: 'hpcrlhf.agents.calculator:Calculator', reward_placement: turn}"],
     r"agent.reward_placement: 'turn' is invalid: it says where training credits"),
    (GenerateConfig, ["reward={sources: [{env: true}]}"],
     r"reward.sources\[0\].env: True is invalid: the environment's reward needs the agent section"),
])
def test_what_the_section_cannot_work_with_is_refused_at_load(cls, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(cls, overrides=overrides)
