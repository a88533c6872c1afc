"""Tool-call parsers: the Hermes format read against hand-written turns, a user's parser loaded by
name and its return checked."""

from __future__ import annotations

import textwrap

import pytest

from hpcrlhf.agents.parsers import BadCall, ToolCall, hermes, load_parser
from hpcrlhf.errors import AgentEnvError, ConfigError


def test_hermes_reads_every_call_in_order_and_reports_the_botched_ones():
    turn = ('Let me compute.<tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 59}}</tool_call>\n'
            '<tool_call>\n{"name":"look","arguments":"{\\"where\\": \\"up\\"}"}\n</tool_call>'
            '<tool_call>{"name": "now"}</tool_call>'
            '<tool_call>{"name": "x", "arguments": {"a": 1}</tool_call>'
            '<tool_call>["multiply", 1]</tool_call>'
            '<tool_call>{"name": "", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "y", "arguments": [1]}</tool_call>'
            '<tool_call>{"name": "z", "arguments": "a=1"}</tool_call>'
            'and then <tool_call>{"name": "multiply", "arguments": {"a": 1')
    calls = hermes(turn)
    assert calls[:3] == [ToolCall("multiply", {"a": 37, "b": 59}), ToolCall("look", {"where": "up"}),
                         ToolCall("now", {})]
    assert [c.reason for c in calls[3:]] == [
        "not JSON (Expecting ',' delimiter at character 35)", 'not an object with a "name" string',
        'not an object with a "name" string', '"arguments" is no object', '"arguments" is a string but no JSON',
        "no closing </tool_call>"]
    assert calls[-1].text == '<tool_call>{"name": "multiply", "arguments": {"a": 1'
    assert all(isinstance(c, BadCall) for c in calls[3:])
    assert hermes("The answer is 2183.") == [] and hermes("") == []


def test_a_users_parser_loads_by_name_and_its_return_is_checked(tmp_path, monkeypatch):
    (tmp_path / "my_parsers.py").write_text(textwrap.dedent('''
        from hpcrlhf.agents.parsers import ToolCall

        def calls(text):
            if text.startswith("CALL "):
                name, _, a = text[5:].partition(" ")
                return [ToolCall(name, {"a": int(a)})]
            return [] if text != "bad" else ["not a call"]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    parse = load_parser("my_parsers:calls")
    assert parse("CALL square 3") == [ToolCall("square", {"a": 3})] and parse("hello") == []
    with pytest.raises(AgentEnvError, match=r"agent.tool_parser 'my_parsers:calls' returned list \"\['not a call'\]\"; "
                                            "a parser returns a list of hpcrlhf.agents.parsers.ToolCall"):
        parse("bad")
    assert load_parser("hermes") is hermes
    with pytest.raises(ConfigError, match="agent.tool_parser: 'json' is no parser; use hermes, or package.module:function"):
        load_parser("json")
    with pytest.raises(ConfigError, match=r"parser 'my_parsers:nothing' cannot be imported \(module 'my_parsers' has no"):
        load_parser("my_parsers:nothing")
