"""SFT on conversations (`data.messages_key`): rows of chat messages with tool calls and tool results,
their assistant turns learned in the tokens a multi-turn rollout holds; bad rows and settings refused
before anything trains."""

from __future__ import annotations

import json
import random

import pytest

from hpcrlhf.config.jobspec import build_config
from hpcrlhf.errors import ConfigError
from tests.launch_helpers import run_cli

SCHEMA = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "A factor."},
                                                    "b": {"type": "integer", "description": "The other."}},
                   "required": ["a", "b"]}}}


def conversations(path, n: int, seed: int) -> None:
    """`n` rows: "a*b=" answered by a multiply call, its result, and "= a*b" (a user's own chat data)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
            messages = [{"role": "user", "content": f"{a}*{b}="}, {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "name": "multiply", "content": str(a * b)},
                        {"role": "assistant", "content": f"= {a * b}"}]
            f.write(json.dumps({"messages": messages, "tools": [SCHEMA]}) + "\n")


CONVERSATIONS = ["data.messages_key=messages", "data.tools_key=tools", "data.apply_chat_template=true"]


def test_sft_learns_the_assistant_turns_of_conversations_with_tool_calls(tmp_path):
    conversations(tmp_path / "train.jsonl", 400, 0)
    conversations(tmp_path / "eval.jsonl", 32, 1)
    out = tmp_path / "run"
    run_cli(["train", "sft", "-o", str(out), "--set", f"data.train_path={tmp_path / 'train.jsonl'}",
             "--set", f"data.eval_path={tmp_path / 'eval.jsonl'}", *[a for s in CONVERSATIONS for a in ("--set", s)],
             "--set", "data.max_length=128", "--set", "train.max_steps=60", "--set", "log.backends=[]"])
    s = json.loads((out / "summary.json").read_text())
    # the call's format and the answer's copy of the result are all there is to learn: from chance to little
    assert s["before"]["eval/loss"] > 5 and s["after"]["eval/loss"] < 0.5, s


def test_bad_conversation_rows_and_settings_are_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
                   + "\n" + json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    proc = run_cli(["train", "sft", "-o", str(tmp_path / "run"), "--set", f"data.train_path={bad}",
                    *[a for s in CONVERSATIONS[::2] for a in ("--set", s)]], check=False)
    assert proc.returncode == 2 and (f"{bad}:2: the row's 'messages' (data.messages_key) is no conversation: it has no "
                                     "assistant turn to learn") in proc.stderr, proc.stderr[-2000:]
    with pytest.raises(ConfigError, match="conversations \\(data.messages_key\\) are rendered by the chat template"):
        build_config("sft", None, ["data.messages_key=messages"], None)
    with pytest.raises(ConfigError, match="data.tools_key: 'tools' is invalid: tools belong to conversations"):
        build_config("sft", None, ["data.tools_key=tools"], None)
    with pytest.raises(ConfigError, match="eval.metrics: \\['mine.rules:right'\\] score greedy answers to held-out "):
        build_config("sft", None, [*CONVERSATIONS, "eval.metrics=[mine.rules:right]"], None)
    with pytest.raises(ConfigError, match="data.messages_key: conditional SFT .* use `train sft` for conversations"):
        build_config("csft", None, CONVERSATIONS, None)
