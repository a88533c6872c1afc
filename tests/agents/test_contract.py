"""The environment contract: what `reset`, `step` and `get_reward` return is checked, and a broken
return fails naming the method and the value, with the fix."""

from __future__ import annotations

import math
import re

import pytest
import torch

from hpcrlhf.agents import Step, tool
from hpcrlhf.agents.contract import checked_reward, checked_step, is_tool, messages
from hpcrlhf.errors import AgentEnvError

LABEL = "agent.environment 'guess:Guess'.step"


def test_messages_from_a_string_or_a_list():
    assert messages("37*59=", LABEL) == [{"role": "user", "content": "37*59="}]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "u"}]
    assert messages(chat, LABEL) == chat and messages(chat, LABEL)[0] is not chat[0]  # copies
    for bad, fragment in [(None, "NoneType None"), ([], "list []"), (["hi"], "message 0 str 'hi'"),
                          ([{"role": "robot", "content": "x"}], "message 0 dict"),
                          ([{"role": "user", "content": 3}], "message 0 dict")]:
        with pytest.raises(AgentEnvError, match=f"{re.escape(f'{LABEL} returned {fragment}')}.*(return a string|each "
                                                "message is a dict)"):
            messages(bad, LABEL)
    with pytest.raises(AgentEnvError, match=r"message 0 .*\(system, user, tool\)"):
        messages([{"role": "assistant", "content": "x"}], LABEL, roles=("system", "user", "tool"))


def test_a_step_is_checked_and_normalised():
    assert checked_step(Step("Too low.", 0.0), LABEL) == Step([{"role": "user", "content": "Too low."}], 0.0, False, {})
    done = checked_step(Step(None, torch.tensor(1), True, {"success": True}), LABEL)
    assert done == Step(None, 1.0, True, {"success": True}) and isinstance(done.reward, float)
    assert math.isnan(checked_step(Step(None, float("nan"), True), LABEL).reward)  # the run's guard decides
    cases = [(("obs", 1.0, False, {}), r"returned tuple .* \(a gym-style tuple\); return hpcrlhf.agents.Step"),
             (Step("x", "1.0"), "whose reward is str '1.0'; the reward is a real number"),
             (Step("x", None), "whose reward is NoneType None"),
             (Step("x", 0.0, 1), "whose done is int 1; done is True or False"),
             (Step(None, 0.0, False), "without an observation that does not end the trajectory"),
             (Step("x", 0.0, False, info=[1]), "whose info is list"),
             (Step([{"role": "assistant", "content": "x"}]), r"\(its observation\) returned message 0")]
    for value, message in cases:
        with pytest.raises(AgentEnvError, match=message):
            checked_step(value, LABEL)


def test_get_reward_is_a_real_number():
    assert checked_reward(True, LABEL) == 1.0 and checked_reward(2, LABEL) == 2.0
    with pytest.raises(AgentEnvError, match=r"returned str '1'; return a real number"):
        checked_reward("1", LABEL)


def test_tool_marks_a_method():
    class Env:
        @tool
        def a(self) -> int:
            return 1

        def b(self) -> int:
            return 2

    assert is_tool(Env().a) and not is_tool(Env().b) and Env().a() == 1
