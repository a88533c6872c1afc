"""Bounded staleness (rollout.max_staleness 1): which steps' rollouts are generated ahead.

With staleness 1, step n's rollout is scored, and while the roles make experience and train on it,
the engines already generate step n+1's -- with the weights step n started from, one update behind
the weights that will learn from it. The new weights go into the engines once that generation is
done (`PPOTrainer.await_ahead`), ready for step n+2's.

A checkpoint holds the rollout generated ahead (`PPOTrainer.save_ahead`; it is done by then), so a
run resumed from it -- after a time limit or a stop signal as well -- scores the samples the
uninterrupted run does.
"""

from __future__ import annotations


def generate_ahead(step: int, total_steps: int, max_staleness: int) -> bool:
    """Whether step `step`'s rollout (0-based) is generated during step `step - 1`: staleness
    allowed and a step that will run."""
    return max_staleness >= 1 and 0 < step < total_steps
