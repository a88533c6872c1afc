"""The `agent` section: multi-turn rollouts in which the model calls tools and an environment answers
(docs/design/agents.md; the code in `hpcrlhf.agents`). Names of the user's code are only checked for
their form here; they are imported when the job starts (the config stays free of user code)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from hpcrlhf.config.schema.checks import require, require_finite, require_timeout

TOOL_PARSERS = ("hermes",)


def _qualified(name: str) -> bool:
    module, sep, attribute = name.partition(":")
    return bool(sep and module and attribute)


@dataclass(frozen=True)
class AgentConfig:
    environment: str | None = None
    """The environment class, `package.module:Class`: built once per trajectory, its `reset(row, seed)`
    gives the first message, `step(action)` judges each answer without tool calls, its `@tool`
    methods are tools (docs/design/agents.md). null: the row's prompt, and the model answers with
    `agent.tools` until it answers without a call."""
    environment_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment class."""
    tools: tuple[str, ...] = ()
    """Tools of every trajectory, `package.module:function` each: typed functions whose Google-style
    docstrings describe every argument (their JSON schemas reach the model through the chat template)."""
    tool_parser: str = "hermes"
    """How tool calls are found in a model turn: hermes (`<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`, as Hermes, Qwen2.5/3 and vLLM's hermes parser), or `package.module:function` of the
    turn's text returning a list of hpcrlhf.agents.parsers.ToolCall."""
    max_turns: int = 4
    """Model turns per trajectory."""
    max_tokens: int = 512
    """Tokens of a trajectory after its prompt: the model's and the environment's."""
    max_tool_calls_per_turn: int = 4
    """Calls answered per model turn (further ones are not)."""
    max_observation_chars: int = 4096
    """A tool result or observation longer than this is cut (and says so)."""
    step_timeout_s: float = 30.0
    """Longest a reset, or the environment's answer to one turn (its tool calls and step together),
    may take; past it the trajectory ends with status timeout (a hung call's thread is abandoned)."""
    env_workers: int = 8
    """Threads per rollout engine for environment and tool calls; the node map counts them as CPU cores
    of the engine's node (`hpcrlhf plan`, placement.cpus_per_node)."""
    on_env_error: Literal["fail", "end"] = "fail"
    """An environment's step, tool or get_reward raising: fail the run (naming the class, row, seed and
    turn), or end that trajectory (status env_error). A reset that raises always fails the run."""
    max_failed_share: float = 0.1
    """A rollout in which more than this share of trajectories ended by a timeout or an environment
    error fails the run (a dead tool server must not train silently)."""
    reward_placement: Literal["end", "turn"] = "end"
    """Where the environment's rewards reach the per-token rewards (ppo): end -- the trajectory's whole
    reward at its last model token, with the other sources' scores; turn -- each turn's `step` reward at
    that turn's last model token (times the env source's weight), `get_reward()` and the other sources
    at the end, so GAE credits a turn's reward to the turns before it alone (token-level estimators
    only: gae, reinforce++). reward.running_norm and reward.clip then apply to the end's part only."""
    schedule: Literal["trajectory", "turn"] | None = None
    """trajectory: each trajectory goes back to the engine the moment its environment answered (vLLM);
    turn: every trajectory waits, each turn, for every environment (the only way for the hf backend).
    null: trajectory on vllm, turn on hf."""

    def __post_init__(self) -> None:
        require_finite(self, "agent")
        if self.environment is not None:
            require(_qualified(self.environment), "agent.environment", self.environment,
                    "use package.module:Class, e.g. mypkg.envs:GuessNumber")
        for i, name in enumerate(self.tools):
            require(_qualified(name), f"agent.tools[{i}]", name, "use package.module:function, e.g. mypkg.tools:multiply")
        require(self.tool_parser in TOOL_PARSERS or _qualified(self.tool_parser), "agent.tool_parser", self.tool_parser,
                f"use {', '.join(TOOL_PARSERS)} or package.module:function")
        require(not self.environment_args or self.environment is not None, "agent.environment_args",
                self.environment_args, "arguments are for agent.environment: name the class, or drop them")
        for key, least in (("max_turns", 1), ("max_tokens", 1), ("max_tool_calls_per_turn", 1),
                           ("max_observation_chars", 16), ("env_workers", 1)):
            require(getattr(self, key) >= least, f"agent.{key}", getattr(self, key), f"use at least {least}")
        require_timeout(self.step_timeout_s, "agent.step_timeout_s")
        require(0 <= self.max_failed_share <= 1, "agent.max_failed_share", self.max_failed_share,
                "use a share in [0, 1], e.g. 0.1")
