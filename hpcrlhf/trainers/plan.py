"""Derived batch numbers, computed once from the config and the world size.

Configs never change after loading; everything that follows from them (accumulation steps,
rows per rank, steps per epoch) lives here with names that carry their unit.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrlhf.config.schema import TrainConfig
from hpcrlhf.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    data_parallel_size: int
    global_batch_rows: int
    """Rows (samples, or packed rows) per optimizer step over all ranks."""
    micro_batch_rows: int
    """Rows per forward/backward on one rank."""
    grad_accum_steps: int
    steps_per_epoch: int
    total_steps: int

    @property
    def rows_per_rank_per_step(self) -> int:
        return self.micro_batch_rows * self.grad_accum_steps

    @classmethod
    def build(cls, train: TrainConfig, *, num_rows: int, data_parallel_size: int) -> "BatchPlan":
        g, m, w = train.global_batch_size, train.micro_batch_size, data_parallel_size
        if g % (m * w):
            options = sorted({m * w * k for k in (max(1, g // (m * w)), g // (m * w) + 1)})
            raise ConfigError(
                f"train.global_batch_size: {g} is not a multiple of train.micro_batch_size ({m}) x "
                f"data-parallel ranks ({w}) = {m * w}; use global_batch_size "
                f"{' or '.join(map(str, options))}, or a micro_batch_size that divides {g // w if g % w == 0 else g}"
            )
        steps_per_epoch = num_rows // g
        if steps_per_epoch == 0:
            raise ConfigError(
                f"train.global_batch_size: {g} is larger than the training data ({num_rows} rows); "
                f"use a global_batch_size of at most {num_rows}, or more data"
            )
        total = train.max_steps if train.max_steps is not None else steps_per_epoch * train.epochs
        return cls(w, g, m, g // (m * w), steps_per_epoch, total)
