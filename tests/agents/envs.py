"""Environments the agent tests name by path (`tests.agents.envs:Class`), as a user's would be."""

from __future__ import annotations

import asyncio
import time

from hpcrlhf.agents import Step, tool


class Countdown:
    """Answers every turn "again" until `turns` turns were judged; each step takes `latency[row id]`
    seconds. Its turn rewards are 0.1 per turn, get_reward 1.0."""

    def __init__(self, turns: int = 3, latency: dict | None = None) -> None:
        self.turns, self.latency, self.judged, self.closed = turns, latency or {}, 0, False

    def reset(self, row, seed):
        self.id = row["id"]
        row["id"] = "changed"  # a copy: the dataset's row stays
        return [{"role": "system", "content": "Count."}, {"role": "user", "content": f"start {seed % 10}"}]

    def step(self, action):
        time.sleep(self.latency.get(self.id, 0.0))
        self.judged += 1
        if self.judged >= self.turns:
            return Step(None, 0.1, True, {"success": action.endswith("ok"), "score": 2})
        return Step("again", 0.1)

    def get_reward(self):
        return 1.0

    def close(self):
        self.closed = True


class Wordy(Countdown):
    """Countdown whose turn rewards depend on what the model wrote: its turn's length mod 4, over 4."""

    def step(self, action):
        answer = super().step(action)
        return Step(answer.observation, (len(action) % 4) / 4, answer.done, answer.info)


class Calculator:
    """A tools-and-step environment: `multiply` as a tool (it hangs for a = 0, raises for a < 0);
    `step` checks the answer against the row's."""

    def reset(self, row, seed):
        self.answer = row["answer"]
        return row["prompt"]

    @tool
    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        if a == 0:
            time.sleep(30)
        if a < 0:
            raise ValueError("negative factor")
        return a * b

    @tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: One.
            b: Two.
        """
        await asyncio.sleep(0.01)
        return a + b

    def step(self, action):
        correct = action.strip() == f"= {self.answer}"
        return Step(None, float(correct), True, {"success": correct})


class Broken:
    """reset raises for row id "bad-reset"; step raises on turn 2."""

    def __init__(self) -> None:
        self.turn = 0

    def reset(self, row, seed):
        if row["id"] == "bad-reset":
            raise KeyError("no such puzzle")
        return "go"

    def step(self, action):
        self.turn += 1
        if self.turn == 2:
            raise RuntimeError("the simulator crashed")
        return Step("more", 0.0)


def by_length(text: str) -> list:
    """A tool-call parser that reads no call from the text: it picks one by the turn's length, so an
    untrained model makes every kind of mistake -- malformed calls, unknown tools, arguments of the
    wrong type, a tool that raises (`multiply` of a negative), one that hangs (`multiply` of 0) --
    and answers without a call on the sixth kind of length."""
    from hpcrlhf.agents.parsers import BadCall, ToolCall

    return [[BadCall(text[:20], "no closing tag")], [ToolCall("nosuch", {"x": 1})], [ToolCall("add", {"a": 1, "b": "two"})],
            [ToolCall("multiply", {"a": -1, "b": 2})], [ToolCall("multiply", {"a": 0, "b": 2})], []][len(text) % 6]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def sleepy(seconds: float) -> str:
    """Wait, then say so.

    Args:
        seconds: How long to wait.
    """
    time.sleep(seconds)
    return "awake"
