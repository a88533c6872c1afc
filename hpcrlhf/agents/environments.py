"""Loading a job's environment class (`agent.environment`) and its tools, checked before anything runs.

`load_environment` imports the class, checks it has `reset` and accepts `agent.environment_args`,
and reads the schemas of its `@tool` methods; `EnvironmentClass.make()` builds one per trajectory.
Without `agent.environment` the trajectory's environment is `ToolEnvironment`: the row's prompt is
the first message, the model may call `agent.tools`, and its first answer without a call ends it.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hpcrlhf.agents.tools import Tool, environment_tools
from hpcrlhf.errors import AgentEnvError, ConfigError
from hpcrlhf.run.usercode import load_named


class ToolEnvironment:
    """The environment of a model with tools and nothing else: `reset` gives the row's prompt."""

    def __init__(self, prompt_key: str = "prompt") -> None:
        self.prompt_key = prompt_key

    def reset(self, row: Mapping[str, Any], seed: int) -> str:
        prompt = row.get(self.prompt_key)
        if not isinstance(prompt, str):
            raise AgentEnvError(f"the row has no string '{self.prompt_key}' (data.prompt_key) to start the trajectory "
                                f"with (its fields: {', '.join(row) or 'none'})")
        return prompt


@dataclass(frozen=True)
class EnvironmentClass:
    """A loaded environment class: what builds each trajectory's environment."""

    cls: type
    args: Mapping[str, Any]
    label: str
    """"agent.environment 'guess:GuessNumber'", for errors."""
    tools: tuple[Tool, ...]
    """Its `@tool` methods (unbound; `bind_tools` binds them to an instance)."""

    @property
    def has_step(self) -> bool:
        return callable(getattr(self.cls, "step", None))

    def make(self) -> Any:
        """A new environment (one per trajectory); what its constructor raises is an AgentEnvError."""
        try:
            return self.cls(**self.args)
        except Exception as e:
            raise AgentEnvError(f"{self.label}: building it with agent.environment_args raised {type(e).__name__}: "
                                f"{e}; fix the class or its arguments") from e

    def bind_tools(self, environment: Any) -> list[Tool]:
        """Its tools as methods of `environment`."""
        return [dataclasses.replace(t, fn=getattr(environment, t.name)) for t in self.tools]


def load_environment(name: str | None, args: Mapping[str, Any], prompt_key: str = "prompt",
                     field: str = "agent.environment", args_field: str | None = None) -> EnvironmentClass:
    """The class `name` names (`package.module:Class`), or ToolEnvironment for None; a ConfigError
    naming the field (`args_field`, default field + "_args", for the arguments) when it cannot be
    imported, is no class, has no `reset`, does not take `args`, or has a tool whose schema cannot be
    read."""
    args_field = f"{field}_args" if args_field is None else args_field
    if name is None:
        if args:
            raise ConfigError(f"{args_field}: {dict(args)} given without {field}; name the class they are for")
        return EnvironmentClass(ToolEnvironment, {"prompt_key": prompt_key}, "the tool environment (no agent.environment)",
                                ())
    label = f"{field} '{name}'"
    module, sep, attribute = name.partition(":")
    if not sep or not module or not attribute:
        raise ConfigError(f"{field}: '{name}' is no class name; use package.module:Class, e.g. mypkg.envs:GuessNumber")
    cls = load_named(name, label, "class")
    if not inspect.isclass(cls):
        raise ConfigError(f"{label} is no class (a {type(cls).__name__}); name the environment's class")
    if not callable(getattr(cls, "reset", None)):
        raise ConfigError(f"{label} has no reset(row, seed) method; every environment starts its trajectory with one")
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as e:
        raise ConfigError(f"{args_field}: {dict(args)} do not fit {name}'s constructor ({e}); give the keyword "
                          "arguments its __init__ takes") from None
    return EnvironmentClass(cls, dict(args), label, tuple(environment_tools(cls, label)))
