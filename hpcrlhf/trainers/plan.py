"""Derived batch numbers, computed once from the config and the world size, and which rows
each rank works on.

Configs never change after loading; everything that follows from them (accumulation steps,
rows per rank, steps per epoch) lives here with names that carry their unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from hpcrlhf.config.schema import TrainConfig
from hpcrlhf.engines.distributed import DistEnv
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

    def rows_for_step(self, num_rows: int, step: int, seed: int, rank: int) -> list[int]:
        """Indices of the rows `rank` trains on at optimizer step `step` (0-based).

        The order is a pure function of (seed, epoch), so the data position of a resumed run is
        just its step: no sample is lost or repeated across a restart.
        """
        epoch, within = divmod(step, self.steps_per_epoch)
        order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))
        start = within * self.global_batch_rows + rank * self.rows_per_rank_per_step
        return order[start : start + self.rows_per_rank_per_step].tolist()

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


def eval_shards(items: Sequence, env: DistEnv, batch_size: int) -> list[tuple[list, bool]]:
    """This rank's share of `items` in batches; every rank gets the same number of batches (a
    ZeRO-3 requirement), padded with dummy batches flagged True."""
    shard = list(items[env.rank :: env.world_size])
    n_batches = math.ceil(math.ceil(len(items) / env.world_size) / batch_size) if items else 0
    batches = [shard[i * batch_size : (i + 1) * batch_size] for i in range(n_batches)]
    return [(b, False) if b else ([items[0]], True) for b in batches]
