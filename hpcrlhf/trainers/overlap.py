"""Bounded staleness (rollout.max_staleness 1): which steps' rollouts are generated ahead.

With staleness 1, step n's rollout is scored, and while the roles make experience and train on it,
the engines already generate step n+1's -- with the weights step n started from, one update behind
the weights that will learn from it. The new weights go into the engines once that generation is
done (`PPOTrainer.await_ahead`), ready for step n+2's.

A rollout under way is never checkpointed: none is generated ahead across a checkpoint (the step
after a checkpoint generates its own with the checkpointed weights, in the uninterrupted run as in
the resumed one, so both draw the same samples), nor past the last step.
"""

from __future__ import annotations


def generate_ahead(step: int, total_steps: int, checkpoint_every: int, max_staleness: int) -> bool:
    """Whether step `step`'s rollout (0-based) is generated during step `step - 1`: staleness
    allowed, a step that will run, and no checkpoint between the two (taken after `step` steps)."""
    if max_staleness < 1 or not 0 < step < total_steps:
        return False
    return not (checkpoint_every and step % checkpoint_every == 0)
