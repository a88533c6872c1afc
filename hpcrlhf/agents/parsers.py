"""Finding the tool calls in a model turn (`agent.tool_parser`).

A parser is a function of the turn's text (decoded with its special tokens, which some tokenizers
use for the call tags) that returns a list of `ToolCall`s and `BadCall`s: the calls the model made,
in order, and those it botched (a `BadCall` is answered with an error message, so the model learns
the format). `hermes`, the default, reads `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks: the format of Hermes, Qwen2.5/3 and vLLM's `hermes` tool parser. A user's parser is named
`package.module:function` and its return is checked on every call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpcrlhf.errors import AgentEnvError, ConfigError
from hpcrlhf.run.usercode import load_named

BUILTIN_PARSERS = ("hermes",)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments, as parsed (never coerced)."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BadCall:
    """A call the model tried to make but got wrong: its text and why it is no call."""

    text: str
    reason: str


Parser = Callable[[str], list]

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


def hermes(text: str) -> list[ToolCall | BadCall]:
    """The `<tool_call>{json}</tool_call>` blocks of `text`, in order; an opening tag left unclosed is
    a BadCall, and so is a block whose JSON is no object with a string "name" and "arguments" as an
    object (or a JSON string of one; left out: no arguments)."""
    calls: list[ToolCall | BadCall] = []
    end = 0
    for match in _CALL.finditer(text):
        calls.append(_hermes_call(match.group(1)))
        end = match.end()
    rest = text[end:]
    if _OPEN in rest:
        calls.append(BadCall(rest[rest.index(_OPEN):], "no closing </tool_call>"))
    return calls


def _hermes_call(body: str) -> ToolCall | BadCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return BadCall(body, f"not JSON ({e.msg} at character {e.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return BadCall(body, 'not an object with a "name" string')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return BadCall(body, '"arguments" is a string but no JSON')
    if not isinstance(arguments, dict):
        return BadCall(body, '"arguments" is no object')
    return ToolCall(call["name"], arguments)


def load_parser(name: str, field: str = "agent.tool_parser") -> Parser:
    """The parser `name` names: a built-in one, or `package.module:function`, imported now (a
    ConfigError names the field when it cannot be); a user's parser's return is checked on every
    call (`checked_calls`)."""
    if name == "hermes":
        return hermes
    module, sep, attribute = name.partition(":")
    if not sep or not module or not attribute:
        raise ConfigError(f"{field}: '{name}' is no parser; use {', '.join(BUILTIN_PARSERS)}, or package.module:function "
                          "(a function of the turn's text returning a list of hpcrlhf.agents.parsers.ToolCall)")
    fn = load_named(name, f"{field}: parser '{name}'", "function")
    if not callable(fn):
        raise ConfigError(f"{field}: parser '{name}' is no function")
    label = f"{field} '{name}'"
    return lambda text: checked_calls(fn(text), label)


def checked_calls(value: Any, label: str) -> list[ToolCall | BadCall]:
    """What a parser returned, when it is a list of ToolCall and BadCall."""
    if not isinstance(value, list) or not all(isinstance(c, (ToolCall, BadCall)) for c in value):
        raise AgentEnvError(f"{label} returned {type(value).__name__} {str(value)[:80]!r}; a parser returns a list of "
                            "hpcrlhf.agents.parsers.ToolCall (and BadCall for calls the model got wrong)")
    return value
