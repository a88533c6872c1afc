"""Learning-rate schedules as a pure function of the optimizer step."""

from __future__ import annotations

import math


def lr_multiplier(step: int, *, total_steps: int, warmup_steps: int, kind: str, min_ratio: float) -> float:
    """Factor applied to the peak learning rate before optimizer step `step` (0-based).

    Linear warm-up from 1/(warmup+1) to 1, then constant, cosine or linear decay to `min_ratio`
    at the last step.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if kind == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if kind == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if kind == "linear":
        return 1 - (1 - min_ratio) * progress
    raise ValueError(f"unknown schedule {kind!r}")
