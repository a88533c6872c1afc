"""Bounded staleness (rollout.max_staleness 1): which steps' rollouts are generated ahead, and the
rollout generated ahead in a checkpoint.

With staleness 1, step n's rollout is scored, and while the roles make experience and train on it,
the engines already generate step n+1's -- with the weights step n started from, one update behind
the weights that will learn from it. The new weights go into the engines once that generation is
done (`PPOTrainer.await_ahead`), ready for step n+2's.

A checkpoint holds the rollout generated ahead (`save_ahead`; it is done by then), so a run resumed
from it -- after a time limit or a stop signal as well -- scores the samples the uninterrupted run
does.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hpcrlhf.engines.rollout import Generation
from hpcrlhf.trainers.online import LaunchedRollout


def generate_ahead(step: int, total_steps: int, max_staleness: int) -> bool:
    """Whether step `step`'s rollout (0-based) is generated during step `step - 1`: staleness
    allowed and a step that will run."""
    return max_staleness >= 1 and 0 < step < total_steps


def ahead_file(folder: Path, rank: int) -> Path:
    return folder / f"ahead_rank{rank}.pt"


def save_ahead(ahead: tuple[int, LaunchedRollout] | None, folder: Path, rank: int) -> None:
    """Into a checkpoint folder: (step, rollout) generated ahead for the next step (done by now: the
    step's sync waited for it), so that a run resumed there scores the samples an uninterrupted one does."""
    if ahead is not None:
        step, launched = ahead
        torch.save({"step": step, "generations": launched.pending.result(), "agent_batch": launched.agent_batch()},
                   ahead_file(folder, rank))


def load_ahead(folder: Path, rank: int) -> tuple[int, list[list[Generation]], dict | None] | None:
    """(step, its generations, a multi-turn batch's scheduling figures) that `save_ahead` kept in a
    checkpoint folder, else None."""
    path = ahead_file(folder, rank)
    if not path.exists():
        return None
    state = torch.load(path, weights_only=False)
    return state["step"], state["generations"], state.get("agent_batch")
