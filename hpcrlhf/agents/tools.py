"""Tools: the functions a model may call in a trajectory, their schemas, and what a call answers.

A tool is a function with type hints and a Google-style docstring that describes every argument
(`agent.tools: [package.module:function]`, or an environment method marked `@tool`). Its JSON
schema is transformers' `get_json_schema` of it: what the chat template shows the model (`tools=`).

A call's answer is the text of a `tool` message. A call that goes wrong is answered too, with an
error the model can read (`error: <kind>: <detail>`), and counted by kind, so a run shows how often
its model botches calls instead of failing on the first one:

- `malformed`: the parser found a call but no valid one (`parsers.BadCall`);
- `unknown`: no tool has that name (the answer lists the names);
- `bad_arguments`: a required argument missing, one the tool does not take, or a value of the
  wrong JSON type (values are never coerced: "37" is no integer);
- `raised`: the tool raised (its type and message; no traceback);
- `bad_return`: the tool's result could not be made text.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpcrlhf.agents.contract import is_tool
from hpcrlhf.agents.parsers import BadCall, ToolCall
from hpcrlhf.errors import ConfigError
from hpcrlhf.run.usercode import load_named

ERROR_KINDS = ("malformed", "unknown", "bad_arguments", "raised", "bad_return")
TRUNCATED = "...(truncated)"
_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                            "boolean": (bool,), "array": (list,), "object": (dict,), "null": (type(None),)}


@dataclass(frozen=True)
class Tool:
    """A callable tool: its name (the function's), the function and its JSON schema."""

    name: str
    fn: Callable
    schema: dict
    label: str
    """Where the config names it, for errors: "agent.tools[0] 'calc:multiply'"."""

    def argument_problem(self, arguments: Mapping[str, Any]) -> str | None:
        """Why `arguments` do not fit the schema (a missing or unknown argument, a value of another JSON
        type), or None."""
        parameters = self.schema["function"].get("parameters", {})
        properties = parameters.get("properties", {})
        missing = [a for a in parameters.get("required", ()) if a not in arguments]
        if missing:
            return f"missing argument(s) {', '.join(missing)}"
        unknown = [a for a in arguments if a not in properties]
        if unknown:
            return f"{self.name} takes no argument(s) {', '.join(unknown)}; it takes {', '.join(properties) or 'none'}"
        for name, value in arguments.items():
            expected = properties[name].get("type")
            if value is None and properties[name].get("nullable"):
                continue
            types = expected if isinstance(expected, list) else [expected]
            if expected is not None and not any(_is_json_type(value, t) for t in types):
                return f"argument {name} must be of type {'/'.join(map(str, types))}, got {json.dumps(value)[:40]}"
        return None


def _is_json_type(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False  # JSON true is no number (Python's bool is an int)
    return isinstance(value, _JSON_TYPES.get(name, (object,)))


def make_tool(fn: Callable, label: str) -> Tool:
    """`fn` as a Tool; a ConfigError starting with `label` when its schema cannot be read."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    if not callable(fn):
        raise ConfigError(f"{label} is no function")
    try:
        schema = get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as e:
        raise ConfigError(f"{label}: {e}; a tool needs a type hint on every argument and a Google-style docstring "
                          "describing each one under 'Args:'") from None
    return Tool(schema["function"]["name"], fn, schema, label)


def load_tools(names: Sequence[str], field: str = "agent.tools") -> list[Tool]:
    """The tools `names` name (`package.module:function` each), imported and their schemas read."""
    tools = []
    for i, name in enumerate(names):
        label = f"{field}[{i}] '{name}'"
        module, sep, attribute = name.partition(":")
        if not sep or not module or not attribute:
            raise ConfigError(f"{label} is no tool name; use package.module:function")
        tools.append(make_tool(load_named(name, label, "function"), label))
    return tools


def environment_tools(environment: Any, label: str) -> list[Tool]:
    """The methods marked `@tool` of `environment`, an instance (bound to it) or a class (unbound:
    their schemas leave `self` out)."""
    return [make_tool(method, f"{label} tool '{name}'") for name, method in inspect.getmembers(environment, callable)
            if is_tool(method)]


def result_text(value: Any, max_chars: int) -> str:
    """A tool's result as the text of its message: a string as it is, JSON values as JSON, any other
    object as str(); longer than `max_chars`: cut, with TRUNCATED appended. Raises what str() raises."""
    if isinstance(value, str):
        text = value
    elif value is None or isinstance(value, (bool, int, float, list, dict)):
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = repr(value)
    else:
        text = str(value)
    return text if len(text) <= max_chars else text[:max_chars] + TRUNCATED


@dataclass(frozen=True)
class ToolAnswer:
    """A call's answer: the tool message's content, and the error kind when the call went wrong."""

    name: str
    content: str
    error: str | None = None

    def message(self) -> dict:
        return {"role": "tool", "name": self.name, "content": self.content}


class ToolBox:
    """A trajectory's tools by name, answering calls (`answer`)."""

    def __init__(self, tools: Sequence[Tool], max_chars: int = 4096) -> None:
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ConfigError(f"{t.label}: a second tool named '{t.name}' (the first: {self.tools[t.name].label}); "
                                  "tool names must differ")
            self.tools[t.name] = t
        self.max_chars = max_chars

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def answer(self, call: ToolCall | BadCall, run: Callable[..., Any] | None = None) -> ToolAnswer:
        """Run `call` here (`run(fn, **arguments)`, e.g. `EnvPool.run` for tools that may be coroutines;
        by default a plain call) and say what it answers; errors become answers (see the module
        docstring)."""
        if isinstance(call, BadCall):
            return ToolAnswer("invalid", f"error: malformed: {call.reason}", "malformed")
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolAnswer(call.name, f"error: unknown: no tool named {call.name!r}; the tools are "
                                         f"{', '.join(self.tools) or 'none'}", "unknown")
        problem = tool.argument_problem(call.arguments)
        if problem is not None:
            return ToolAnswer(call.name, f"error: bad_arguments: {problem}", "bad_arguments")
        try:
            value = run(tool.fn, **call.arguments) if run is not None else tool.fn(**call.arguments)
        except Exception as e:
            return ToolAnswer(call.name, f"error: raised: {type(e).__name__}: {e}", "raised")
        return self.text(call.name, value)

    def text(self, name: str, value: Any) -> ToolAnswer:
        """The answer of tool `name` that returned `value`."""
        try:
            return ToolAnswer(name, result_text(value, self.max_chars))
        except Exception as e:
            return ToolAnswer(name, f"error: bad_return: str() of its {type(value).__name__} result raised "
                                    f"{type(e).__name__}: {e}", "bad_return")
