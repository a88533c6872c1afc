"""One trajectory: its tokens, its environment, and the rule that decides what follows a model turn.

The tokens after the prompt (`ids`) hold the model's turns exactly as sampled (`action` True, their
log-probs) and what the environment answered in between (`action` False, log-prob 0.0): the loss,
the critic's values and the advantages use the model's tokens only. The scheduler
(`hpcrlhf.agents.scheduler`) runs the environment's side on the pool's threads (`reset`,
`after_turn`, `finish`) and everything else on its own thread.

After each model turn (`after_turn`), in this order:
1. the turn was cut without EOS (`rollout.max_new_tokens`, or no room left): status `max_tokens`;
2. there are tools and the parser finds calls in the turn: each (at most
   `agent.max_tool_calls_per_turn`) is answered as a tool message, and the model goes on;
3. otherwise, when the environment has `step`: its Step judges the turn -- `done` ends the
   trajectory (status `done`), else its observation follows; without `step` the answer ends it;
4. an answer that would follow the last allowed model turn (`agent.max_turns`) ends it instead
   (status `max_turns`), and so does one that leaves no room for a model token under
   `agent.max_tokens` (status `max_tokens`): a trajectory never ends on the environment's tokens.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpcrlhf.agents.contract import checked_reward, checked_step, messages
from hpcrlhf.agents.environments import EnvironmentClass
from hpcrlhf.agents.pool import EnvPool
from hpcrlhf.agents.record import EpisodeRecord
from hpcrlhf.agents.render import ChatRenderer
from hpcrlhf.agents.tools import Tool, ToolBox
from hpcrlhf.engines.rollout.contract import Generation
from hpcrlhf.errors import AgentEnvError
from hpcrlhf.run.usercode import raised_at


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    """Model turns per trajectory."""
    max_tokens: int = 512
    """Tokens after the prompt (the model's and the environment's)."""
    max_tool_calls_per_turn: int = 4
    max_observation_chars: int = 4096
    step_timeout_s: float = 30.0
    """Longest a reset, or the environment's answer to one turn (its tool calls and step together), may take."""
    on_env_error: str = "fail"
    """"fail": an environment that raises ends the run; "end": it ends its trajectory (env_error)."""
    max_prompt_tokens: int | None = None
    """Longest first render (the prompt: `reset`'s messages): `data.max_length`. None: no limit."""


@dataclass(frozen=True)
class Continue:
    """The environment answered: these tokens follow the model's turn."""

    ids: list[int]


@dataclass(frozen=True)
class End:
    status: str
    error: str | None = None


@dataclass(frozen=True)
class Setup:
    """What every trajectory of a job shares: its environment class, tools, renderer, parser, limits."""

    environment: EnvironmentClass
    tools: Sequence[Tool]
    renderer: ChatRenderer
    parser: Callable[[str], list]
    tokenizer: Any
    limits: EpisodeLimits
    pool: EnvPool


class Episode:
    def __init__(self, key: str, row: Mapping[str, Any], seed: int, setup: Setup, origin: str = "") -> None:
        self.key, self.row, self.seed, self.setup, self.origin = key, row, seed, setup, origin
        self.record = EpisodeRecord()
        self.prompt_ids: list[int] = []
        self.ids: list[int] = []
        self.action: list[bool] = []
        self.logprobs: list[float] = []
        self.env: Any = None
        self.box: ToolBox | None = None
        self._turn: tuple[list[int], bool] = ([], False)
        self.versions: list[tuple[int, int]] | None = None
        """The policy versions of the trajectory's response (`Generation.versions`), where its turns record them."""

    @property
    def label(self) -> str:
        where = f"row {self.origin}, " if self.origin else ""
        return f"{self.setup.environment.label} ({where}seed {self.seed})"

    def _user(self, method: str, *args: Any) -> Any:
        """The environment's `method(*args)` (awaited when async); what it raises as an AgentEnvError."""
        try:
            return self.setup.pool.run(getattr(self.env, method), *args)
        except AgentEnvError:
            raise
        except Exception as e:
            turn = f" on turn {self.record.turns}" if self.record.turns else ""
            raise AgentEnvError(f"{self.label}.{method} raised {type(e).__name__}: {e}{raised_at(e)}{turn}; fix the "
                                "class") from e

    # -- on the pool's threads ------------------------------------------------------------------

    def reset(self) -> list[int]:
        """Build the environment, start the trajectory: the prompt's tokens."""
        began = time.monotonic()
        s = self.setup
        self.env = s.environment.make()
        first = messages(self._user("reset", copy.deepcopy(dict(self.row)), self.seed), f"{self.label}.reset")
        self.box = ToolBox([*s.tools, *s.environment.bind_tools(self.env)], s.limits.max_observation_chars)
        self.record.messages = list(first)
        ids = s.renderer.prompt(first)
        self.record.env_seconds += time.monotonic() - began
        if s.limits.max_prompt_tokens is not None and len(ids) > s.limits.max_prompt_tokens:
            raise AgentEnvError(f"{self.label}.reset: its first messages render to {len(ids)} tokens, more than "
                                f"data.max_length ({s.limits.max_prompt_tokens}); shorten the row's prompt or raise "
                                "data.max_length")
        return ids

    def after_turn(self) -> Continue | End:
        """What follows the model's last turn (the module docstring's rule, steps 1-3)."""
        began = time.monotonic()
        try:
            return self._after_turn()
        finally:
            self.record.env_seconds += time.monotonic() - began

    def _after_turn(self) -> Continue | End:
        s, record = self.setup, self.record
        tokens, finished = self._turn
        plain = s.tokenizer.decode(tokens, skip_special_tokens=True)
        record.messages.append({"role": "assistant", "content": plain})
        record.final_text = plain
        if not finished:
            return End("max_tokens")
        calls = s.parser(s.tokenizer.decode(tokens, skip_special_tokens=False)) if self.box.tools else []
        if calls:
            answers = [self.box.answer(c, s.pool.run) for c in calls[:s.limits.max_tool_calls_per_turn]]
            for a in answers:
                record.count(record.tool_calls, a.name)
                if a.error is not None:
                    record.count(record.tool_errors, a.error)
                    if a.error not in ("malformed", "unknown"):
                        record.count(record.tool_errors, a.name)
            said = [a.message() for a in answers]
            record.messages += said
            return Continue(s.renderer.observation(said))
        if not s.environment.has_step:
            return End("done")
        step = checked_step(self._user("step", plain), f"{self.label}.step")
        record.turn_rewards.append(step.reward)
        record.reward_turns.append(record.turns - 1)
        if "success" in step.info:
            record.success = bool(step.info["success"])
        record.info.update({k: float(v) for k, v in step.info.items() if k != "success" and _is_number(v)})
        if step.done:
            return End("done")
        record.messages += step.observation
        return Continue(s.renderer.observation(step.observation))

    def finish(self) -> None:
        """The environment's last say (`get_reward`) and its `close`, once the trajectory ended (not
        after a timeout: the hung call may still run)."""
        if self.env is None:
            return
        try:
            if callable(getattr(self.env, "get_reward", None)) and self.record.status != "env_error":
                self.record.final_reward = checked_reward(self._user("get_reward"), f"{self.label}.get_reward")
        finally:
            if callable(getattr(self.env, "close", None)):
                self._user("close")

    # -- on the scheduler's thread --------------------------------------------------------------

    def start(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = list(prompt_ids)

    @property
    def context(self) -> list[int]:
        """What the model reads for its next turn."""
        return self.prompt_ids + self.ids

    @property
    def room(self) -> int:
        """Tokens the trajectory may still take."""
        return self.setup.limits.max_tokens - len(self.ids)

    def add_model(self, tokens: Sequence[int], logprobs: Sequence[float], finished: bool,
                  versions: Sequence[tuple[int, int]] | None = None) -> None:
        """The model's turn, exactly as sampled (`versions`: its spans' policy versions, `TurnOutput.versions`)."""
        if len(tokens) != len(logprobs):
            raise ValueError(f"a model turn of {len(tokens)} tokens came with {len(logprobs)} log-probs")
        if versions:
            self.versions = join_spans(self.versions or [], len(self.ids), versions)
        self.ids += tokens
        self.action += [True] * len(tokens)
        self.logprobs += [float(x) for x in logprobs]
        self.record.turns += 1
        self.record.turn_ends.append(len(self.ids) - 1)
        self._turn = (list(tokens), finished)

    def apply(self, outcome: Continue | End) -> None:
        """The environment's answer, appended when a model turn may follow it (step 4), else the end."""
        if isinstance(outcome, End):
            self.end(outcome.status, outcome.error)
        elif self.record.turns >= self.setup.limits.max_turns:
            self.end("max_turns")
        elif len(self.ids) + len(outcome.ids) + 1 > self.setup.limits.max_tokens:
            self.end("max_tokens")
        else:
            self.ids += outcome.ids
            self.action += [False] * len(outcome.ids)
            self.logprobs += [0.0] * len(outcome.ids)

    def generation(self) -> Generation:
        """The trajectory as a rollout's generation: everything after the prompt, the model's tokens
        marked (`action_mask`), finished when its environment ended it (status done)."""
        return Generation(list(self.prompt_ids), list(self.ids), list(self.logprobs), self.record.status == "done",
                          list(self.action), self.record, None if self.versions is None else list(self.versions))

    def end(self, status: str, error: str | None = None) -> None:
        self.record.status, self.record.error = status, error

    @property
    def ended(self) -> bool:
        return self.record.ended


def join_spans(spans: Sequence[tuple[int, int]], at: int, turn: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """A trajectory's version spans (`Generation.versions`) with those of a turn that starts at response index
    `at` (its spans relative to it) after them: a span that holds the version of the one before it joins it (an
    environment's tokens between turns lie in the span before them)."""
    out = list(spans)
    for start, version in turn:
        if not out or out[-1][1] != version:
            out.append((at + start, version))
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
