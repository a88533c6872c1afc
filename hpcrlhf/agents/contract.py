"""What an agent environment is and returns, checked on every call.

An environment is a plain class (`agent.environment: package.module:Class`, built with
`agent.environment_args` once per trajectory):

- `reset(row, seed)` (required): the first message(s) of the trajectory, from a copy of the prompt's
  dataset row: a string (one user message) or a list of chat messages (`{"role", "content"}`, which
  may start with a system message). Its randomness must come from `seed` (a resumed run draws the
  same trajectories).
- `step(action)` (optional): called after each model turn that calls no tool, with the turn's
  text; returns a `Step`. Without it, the model's first answer without tool calls ends the
  trajectory (a model with tools, nothing else).
- methods marked `@tool`: tools of this environment, called when the model asks for them.
- `get_reward()` (optional): a number added to the turns' rewards when the trajectory ends;
  `close()` (optional): called once at the end.

Any of them may be `async def`. What they return is checked here, so a broken environment fails
with a message naming the class, the method and what came back, instead of training on garbage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpcrlhf.errors import AgentEnvError
from hpcrlhf.run.usercode import real_number

ROLES = ("system", "user", "assistant", "tool")
"""Roles an environment's messages may have."""
TOOL_MARK = "__hpcrlhf_tool__"


@dataclass(frozen=True)
class Step:
    """What an environment's `step(action)` returns: the environment's answer to one model turn."""

    observation: str | list[dict] | None = None
    """The next message(s) the model reads: a string is one user message; a list holds chat messages
    (user, tool or system). None only with `done=True`."""
    reward: float = 0.0
    """This turn's reward (a real number)."""
    done: bool = False
    """True ends the trajectory."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """Extra facts: `"success": bool` is logged as agent/success, other numbers as agent/info/<key>."""


def tool(fn: Callable) -> Callable:
    """Marks an environment method as a tool the model may call (only marked methods are tools: the
    class's helpers stay out of the prompt). Plain functions in `agent.tools` need no mark."""
    setattr(fn, TOOL_MARK, True)
    return fn


def is_tool(fn: Any) -> bool:
    return bool(getattr(fn, TOOL_MARK, False))


def messages(value: Any, label: str, *, roles: tuple[str, ...] = ROLES) -> list[dict]:
    """`value` (what `reset` or a `Step` gave) as chat messages: a string is one user message; a list
    must hold `{"role", "content"}` dicts with string content and a role of `roles`."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise AgentEnvError(f"{label} returned {_brief(value)}; return a string (one user message) or a non-empty list "
                            "of chat messages like {'role': 'user', 'content': '...'}")
    out = []
    for i, message in enumerate(value):
        role = message.get("role") if isinstance(message, Mapping) else None
        content = message.get("content") if isinstance(message, Mapping) else None
        if role not in roles or not isinstance(content, str):
            raise AgentEnvError(f"{label} returned message {i} {_brief(message)}; each message is a dict with 'role' "
                                f"({', '.join(roles)}) and 'content' (a string)")
        out.append(dict(message))
    return out


def checked_step(value: Any, label: str) -> Step:
    """`value` (what `step` returned) when it is a well-formed `Step`, else an AgentEnvError."""
    if not isinstance(value, Step):
        hint = " (a gym-style tuple)" if isinstance(value, tuple) else ""
        raise AgentEnvError(f"{label} returned {_brief(value)}{hint}; return hpcrlhf.agents.Step(observation, reward, "
                            "done, info)")
    reward = real_number(value.reward)
    if reward is None:
        raise AgentEnvError(f"{label} returned a Step whose reward is {_brief(value.reward)}; the reward is a real "
                            "number (int, float or bool)")
    if not isinstance(value.done, bool):
        raise AgentEnvError(f"{label} returned a Step whose done is {_brief(value.done)}; done is True or False")
    if value.observation is None and not value.done:
        raise AgentEnvError(f"{label} returned a Step without an observation that does not end the trajectory; give "
                            "the next message, or done=True")
    if not isinstance(value.info, Mapping):
        raise AgentEnvError(f"{label} returned a Step whose info is {_brief(value.info)}; info is a dict")
    observation = None if value.observation is None else messages(value.observation, f"{label} (its observation)",
                                                                  roles=("system", "user", "tool"))
    return Step(observation, reward, value.done, dict(value.info))


def checked_reward(value: Any, label: str) -> float:
    """What `get_reward` returned, as a float (NaN and Inf pass: the run's guard decides)."""
    reward = real_number(value)
    if reward is None:
        raise AgentEnvError(f"{label} returned {_brief(value)}; return a real number (int, float or bool)")
    return reward


def _brief(value: Any, limit: int = 80) -> str:
    text = repr(value)
    if isinstance(value, float) and not math.isfinite(value):
        text = str(value)
    return f"{type(value).__name__} {text[:limit]}{'...' if len(text) > limit else ''}"
