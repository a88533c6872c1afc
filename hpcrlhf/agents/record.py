"""What one trajectory was, beyond its tokens: how it ended, its turns, rewards, tool use and
errors. Plain data: it travels with its generations (Ray, checkpoints of the rollout generated
ahead) and feeds the rewards (`reward.sources: [{env: true}]`) and the agent/* metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

STATUSES = ("done", "max_turns", "max_tokens", "timeout", "env_error")
"""How a trajectory ends: its environment said done (or the model answered without a tool call, when
the environment has no `step`); out of model turns (`agent.max_turns`); out of tokens
(`agent.max_tokens`, or a turn cut at `rollout.max_new_tokens`); an environment or tool call past
`agent.step_timeout_s`; the environment raised (`agent.on_env_error: end`)."""


@dataclass
class EpisodeRecord:
    status: str = "running"
    turns: int = 0
    """Model turns."""
    turn_rewards: list[float] = field(default_factory=list)
    """The rewards `step` gave, one per turn it judged."""
    final_reward: float = 0.0
    """What `get_reward()` gave at the end (0 without it)."""
    turn_ends: list[int] = field(default_factory=list)
    """Index in the response tokens of each model turn's last token."""
    reward_turns: list[int] = field(default_factory=list)
    """The model turn (0-based) each of `turn_rewards` judged (turns that called tools are not judged)."""
    tool_calls: dict[str, int] = field(default_factory=dict)
    """Calls per tool name (the answered ones, failed or not)."""
    tool_errors: dict[str, int] = field(default_factory=dict)
    """Failed calls per kind (`tools.ERROR_KINDS`) and per tool name."""
    env_seconds: float = 0.0
    """Seconds its environment and tool calls took."""
    success: bool | None = None
    """What the environment's `info["success"]` said last, if anything."""
    info: dict[str, float] = field(default_factory=dict)
    """The numbers of the environment's last `info`."""
    messages: list[dict] = field(default_factory=list)
    """The conversation as text (the first messages, the model's turns, the answers)."""
    final_text: str = ""
    """The model's last turn, decoded without special tokens: its answer."""
    error: str | None = None
    """Why it ended with timeout or env_error."""

    @property
    def reward(self) -> float:
        return sum(self.turn_rewards) + self.final_reward

    @property
    def ended(self) -> bool:
        return self.status != "running"

    @property
    def truncated(self) -> bool:
        """Cut at agent.max_turns or agent.max_tokens."""
        return self.status in ("max_turns", "max_tokens")

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1
