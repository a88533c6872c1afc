"""Tools: typed functions become the schema a chat template shows the model; every call is
answered, the calls that go wrong with an error the model can read and a kind that is counted."""

from __future__ import annotations

import textwrap

import pytest

from hpcrlhf.agents import tool
from hpcrlhf.agents.parsers import BadCall, ToolCall
from hpcrlhf.agents.tools import TRUNCATED, ToolBox, environment_tools, load_tools, make_tool, result_text
from hpcrlhf.errors import ConfigError


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def look(where: str, depth: int | None = None, scale: float = 1.0) -> dict:
    """Look somewhere.

    Args:
        where: The place.
        depth: How deep, if at all.
        scale: A zoom factor.
    """
    if where == "abyss":
        raise ValueError("too deep")
    return {"where": where, "depth": depth, "scale": scale}


class Unprintable:
    def __str__(self):
        raise RuntimeError("no text")


def odd(kind: str) -> object:
    """Return an odd object.

    Args:
        kind: Which one.
    """
    return Unprintable() if kind == "unprintable" else ("a", "tuple")


def test_a_typed_function_becomes_the_schema_the_template_renders():
    """The schema is transformers' own (what `apply_chat_template(tools=[fn])` renders), by hand here."""
    t = make_tool(multiply, "agent.tools[0] 'm:multiply'")
    assert t.name == "multiply"
    assert t.schema == {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first factor."},
                                                        "b": {"type": "integer", "description": "The second factor."}},
                       "required": ["a", "b"]},
        "return": {"type": "integer"}}}


def test_a_tool_without_typed_or_documented_arguments_is_refused_naming_the_field():
    def bare(a: int) -> int:
        """No arguments described."""

    def untyped(a):
        """Untyped.

        Args:
            a: A thing.
        """

    with pytest.raises(ConfigError, match=r"agent.tools\[1\] 'm:bare': .*no description for the argument 'a'.*Args:"):
        make_tool(bare, "agent.tools[1] 'm:bare'")
    with pytest.raises(ConfigError, match=r"agent.tools\[0\] 'm:untyped': Argument a is missing a type hint"):
        make_tool(untyped, "agent.tools[0] 'm:untyped'")
    with pytest.raises(ConfigError, match="agent.tools.0. 'm:x' is no function"):
        make_tool(3, "agent.tools[0] 'm:x'")


def test_tools_load_by_name_with_errors_that_name_the_field(tmp_path, monkeypatch):
    (tmp_path / "calc_tools.py").write_text(textwrap.dedent('''
        def add(a: float, b: float) -> float:
            """Add.

            Args:
                a: One.
                b: Two.
            """
            return a + b

        answer = 42
    '''))
    (tmp_path / "broken_tools.py").write_text("raise RuntimeError('half-written')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (add,) = load_tools(["calc_tools:add"])
    assert add.name == "add" and add.fn(1, 2) == 3 and add.label == "agent.tools[0] 'calc_tools:add'"
    cases = {"calc_tools": r"agent.tools\[0\] 'calc_tools' is no tool name; use package.module:function",
             "calc_tools:sub": r"'calc_tools:sub' cannot be imported \(module 'calc_tools' has no 'sub'\)",
             "broken_tools:add": r"cannot be imported \(RuntimeError: half-written\); check the module is on PYTHONPATH",
             "nowhere_tools:add": r"cannot be imported \(ModuleNotFoundError",
             "calc_tools:answer": r"'calc_tools:answer' is no function"}
    for name, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_tools([name])
    with pytest.raises(ConfigError, match=r"\[1\] 'calc_tools:add': a second tool named 'add' \(the first: agent.tools\[0\]"):
        ToolBox(load_tools(["calc_tools:add", "calc_tools:add"]))


def test_only_an_environments_marked_methods_are_its_tools():
    class Env:
        @tool
        def measure(self, what: str) -> float:
            """Measure a thing.

            Args:
                what: The thing.
            """
            return 2.5 if what == "rod" else 0.0

        def helper(self, x: int) -> int:
            return x

    (measure,) = environment_tools(Env(), "agent.environment 'm:Env'")
    assert measure.name == "measure" and measure.fn("rod") == 2.5  # bound: no self in the schema or the call
    assert list(measure.schema["function"]["parameters"]["properties"]) == ["what"]


def test_every_call_is_answered_and_failures_are_told_to_the_model_by_kind():
    box = ToolBox([make_tool(multiply, "t0"), make_tool(look, "t1"), make_tool(odd, "t2")], max_chars=40)
    answers = {
        "ok": box.answer(ToolCall("multiply", {"a": 37, "b": 59})),
        "json": box.answer(ToolCall("look", {"where": "up", "depth": None})),
        "malformed": box.answer(BadCall("<tool_call>{oops", "not JSON (Expecting property name at character 1)")),
        "unknown": box.answer(ToolCall("divide", {"a": 1})),
        "missing": box.answer(ToolCall("multiply", {"a": 1})),
        "extra": box.answer(ToolCall("multiply", {"a": 1, "b": 2, "c": 3})),
        "string_for_int": box.answer(ToolCall("multiply", {"a": "37", "b": 59})),
        "bool_for_int": box.answer(ToolCall("multiply", {"a": True, "b": 59})),
        "raised": box.answer(ToolCall("look", {"where": "abyss"})),
        "bad_return": box.answer(ToolCall("odd", {"kind": "unprintable"})),
        "other_object": box.answer(ToolCall("odd", {"kind": "tuple"})),
        "int_for_float": box.answer(ToolCall("look", {"where": "", "scale": 2})),
    }
    got = {k: (a.content, a.error) for k, a in answers.items()}
    assert got == {
        "ok": ("2183", None),
        "json": ('{"where": "up", "depth": null, "scale": 1.0}'[:40] + TRUNCATED, None),
        "malformed": ("error: malformed: not JSON (Expecting property name at character 1)", "malformed"),
        "unknown": ("error: unknown: no tool named 'divide'; the tools are multiply, look, odd", "unknown"),
        "missing": ("error: bad_arguments: missing argument(s) b", "bad_arguments"),
        "extra": ("error: bad_arguments: multiply takes no argument(s) c; it takes a, b", "bad_arguments"),
        "string_for_int": ('error: bad_arguments: argument a must be of type integer, got "37"', "bad_arguments"),
        "bool_for_int": ("error: bad_arguments: argument a must be of type integer, got true", "bad_arguments"),
        "raised": ("error: raised: ValueError: too deep", "raised"),
        "bad_return": ("error: bad_return: str() of its Unprintable result raised RuntimeError: no text", "bad_return"),
        "other_object": ("('a', 'tuple')", None),
        "int_for_float": ('{"where": "", "depth": null, "scale": 2}', None),  # 40 characters: whole
    }
    assert answers["ok"].message() == {"role": "tool", "name": "multiply", "content": "2183"}
    assert box.schemas == [t.schema for t in box.tools.values()] and len(box.schemas) == 3


def test_result_text():
    assert result_text("a\nb", 10) == "a\nb"
    assert result_text(None, 10) == "null" and result_text(True, 10) == "true" and result_text(1.5, 10) == "1.5"
    assert result_text({"k": [1, 2]}, 100) == '{"k": [1, 2]}'
    assert result_text({"k": {1, 2}}, 100) == "{'k': {1, 2}}"  # no JSON: its repr
    assert result_text("x" * 20, 16) == "x" * 16 + TRUNCATED
