"""The `agent` section's own checks: each bad value names the key, the value and the fix."""

from __future__ import annotations

import pytest

from hpcrlhf.config.schema.agent import AgentConfig
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
