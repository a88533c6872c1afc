"""A rollout's agent/* figures, from its trajectories' records: (sum, count) pairs, so ranks and steps
combine exactly (`hpcrlhf.run.stats`), averaged per trajectory unless said otherwise.

- per trajectory: agent/turns, agent/model_tokens, agent/env_tokens, agent/tool_calls (and
  agent/tool_calls/<tool>), agent/tool_errors (and agent/tool_errors/<kind or tool>),
  agent/episode_reward, agent/env_seconds;
- shares of trajectories: agent/timeouts, agent/env_errors, agent/truncated (and
  agent/truncated/max_turns, agent/truncated/max_tokens);
- agent/success over the trajectories whose environment reported it; agent/info/<key> likewise.
Tool names and error kinds come from what happened, so a key appears once something used it.

A batch's scheduling (`batch_stats`): agent/engine_idle_share (the seconds the engine had nothing to
generate while environments worked, over the batch's seconds: its pair adds up over ranks and steps
as seconds), agent/env_calls and agent/abandoned_calls (hung calls whose threads were given up) per
trajectory.
"""

from __future__ import annotations

from collections.abc import Sequence

from hpcrlhf.agents.record import EpisodeRecord
from hpcrlhf.agents.scheduler import BatchStats
from hpcrlhf.agents.tools import ERROR_KINDS


def episode_stats(records: Sequence[EpisodeRecord], model_tokens: Sequence[int],
                  env_tokens: Sequence[int]) -> dict[str, tuple[float, int]]:
    """The figures of `records` (with each trajectory's model and environment token counts)."""
    n = len(records)
    if not n:
        return {}
    out: dict[str, tuple[float, int]] = {
        "agent/turns": (float(sum(r.turns for r in records)), n),
        "agent/model_tokens": (float(sum(model_tokens)), n),
        "agent/env_tokens": (float(sum(env_tokens)), n),
        "agent/episode_reward": (float(sum(r.reward for r in records)), n),
        "agent/env_seconds": (float(sum(r.env_seconds for r in records)), n),
        "agent/tool_calls": (float(sum(sum(r.tool_calls.values()) for r in records)), n),
        "agent/tool_errors": (float(sum(_errors(r) for r in records)), n),
        "agent/timeouts": (float(sum(r.status == "timeout" for r in records)), n),
        "agent/env_errors": (float(sum(r.status == "env_error" for r in records)), n),
        "agent/truncated": (float(sum(r.truncated for r in records)), n),
        "agent/truncated/max_turns": (float(sum(r.status == "max_turns" for r in records)), n),
        "agent/truncated/max_tokens": (float(sum(r.status == "max_tokens" for r in records)), n),
    }
    for table, prefix in (("tool_calls", "agent/tool_calls/"), ("tool_errors", "agent/tool_errors/")):
        for key in sorted({k for r in records for k in getattr(r, table)}):
            out[prefix + key] = (float(sum(getattr(r, table).get(key, 0) for r in records)), n)
    reported = [r.success for r in records if r.success is not None]
    if reported:
        out["agent/success"] = (float(sum(reported)), len(reported))
    for key in sorted({k for r in records for k in r.info}):
        values = [r.info[key] for r in records if key in r.info]
        out[f"agent/info/{key}"] = (float(sum(values)), len(values))
    return out


def batch_stats(stats: BatchStats, trajectories: int) -> dict[str, tuple[float, float]]:
    """The scheduling figures of one batch of `trajectories` (see the module docstring)."""
    if not trajectories:
        return {}
    return {"agent/engine_idle_share": (stats.engine_idle_s, stats.wall_s),
            "agent/env_calls": (float(stats.env_calls), trajectories),
            "agent/abandoned_calls": (float(stats.abandoned_calls), trajectories)}


def _errors(record: EpisodeRecord) -> int:
    """Failed calls: counted once each (the record also counts them by tool name)."""
    return sum(v for k, v in record.tool_errors.items() if k in ERROR_KINDS)
