"""Batch arithmetic: the derived batch numbers (`BatchPlan`, `PPOPlan`), computed once from the config
and the world size, and which rows each rank works on. (`hpcrlhf plan` is something else: the
placement of a job's roles on nodes and GPUs, `hpcrlhf.placement`.)

Configs never change after loading; everything that follows from them (accumulation steps,
rows per rank, steps per epoch) lives here with names that carry their unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence

import torch

from hpcrlhf.config.schema import TrainConfig, TrainJobConfig
from hpcrlhf.data.batching import shard_rows
from hpcrlhf.engines.distributed import DistEnv
from hpcrlhf.errors import ConfigError
from hpcrlhf.trainers.seeds import epoch_order_seed


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
        """Indices of the rows `rank` trains on at optimizer step `step` (0-based)."""
        return rows_for_step(num_rows, step, seed, rank, steps_per_epoch=self.steps_per_epoch,
                             global_rows=self.global_batch_rows, rows_per_rank=self.rows_per_rank_per_step)

    @classmethod
    def build(cls, train: TrainConfig, *, num_rows: int, data_parallel_size: int) -> BatchPlan:
        g, m, w = train.global_batch_size, train.micro_batch_for(data_parallel_size), data_parallel_size
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


def rows_for_step(num_rows: int, step: int, seed: int, rank: int, *, steps_per_epoch: int, global_rows: int,
                  rows_per_rank: int) -> list[int]:
    """Indices of the rows `rank` works on at step `step` (0-based), `global_rows` per step.

    The order is a pure function of (seed, epoch), so the data position of a resumed run is
    just its step: no sample is lost or repeated across a restart.
    """
    epoch, within = divmod(step, steps_per_epoch)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(epoch_order_seed(seed, epoch)))
    start = within * global_rows + rank * rows_per_rank
    return order[start : start + rows_per_rank].tolist()


@dataclass(frozen=True)
class PPOPlan:
    """Derived numbers of an online job: prompts per rollout, sequences per rollout and per
    mini-batch on each rank, accumulation, optimizer steps per rollout, and the run length in
    rollouts (PPO steps)."""

    data_parallel_size: int
    prompts_per_rank: int
    """Prompts each rank generates for in one rollout."""
    samples_per_prompt: int
    minibatch_rows_per_rank: int
    """Sequences per optimizer step on one rank."""
    micro_batch_rows: int
    grad_accum_steps: int
    updates_per_step: int
    """Optimizer steps per rollout (PPO epochs x mini-batches)."""
    steps_per_epoch: int
    """Rollouts per pass over the prompts."""
    total_steps: int
    """Rollouts in the run."""

    @property
    def sequences_per_rank(self) -> int:
        return self.prompts_per_rank * self.samples_per_prompt

    @property
    def minibatches_per_epoch(self) -> int:
        return self.sequences_per_rank // self.minibatch_rows_per_rank

    def engine_args(self) -> dict[str, int]:
        """Batch shape and schedule length of a trained role's engine under this plan."""
        return dict(micro_batch_rows=self.micro_batch_rows, grad_accum_steps=self.grad_accum_steps,
                    total_steps=self.total_steps * self.updates_per_step)

    def prompts_for_step(self, num_prompts: int, step: int, seed: int, rank: int) -> list[int]:
        return rows_for_step(num_prompts, step, seed, rank, steps_per_epoch=self.steps_per_epoch,
                             global_rows=self.prompts_per_rank * self.data_parallel_size,
                             rows_per_rank=self.prompts_per_rank)

    @classmethod
    def build(cls, train: TrainConfig, *, prompts_per_step: int, samples_per_prompt: int, ppo_epochs: int,
              num_prompts: int, data_parallel_size: int) -> PPOPlan:
        w, g, m = data_parallel_size, train.global_batch_size, train.micro_batch_for(data_parallel_size)
        if prompts_per_step % w:
            raise ConfigError(f"rollout.prompts_per_step: {prompts_per_step} does not split over {w} ranks; "
                              f"use a multiple of {w}")
        if g % (m * w):
            raise ConfigError(f"train.global_batch_size: {g} sequences per optimizer step is not a multiple of "
                              f"train.micro_batch_size ({m}) x ranks ({w}) = {m * w}; use a multiple of {m * w}, or a "
                              f"smaller micro_batch_size")
        sequences = prompts_per_step * samples_per_prompt
        if sequences % g:
            raise ConfigError(f"train.global_batch_size: {g} does not divide the {sequences} sequences of a rollout "
                              f"(rollout.prompts_per_step x samples_per_prompt); use a divisor of {sequences}")
        steps_per_epoch = num_prompts // prompts_per_step
        if steps_per_epoch == 0:
            raise ConfigError(f"rollout.prompts_per_step: {prompts_per_step} is more than the {num_prompts} prompts "
                              f"available; use at most {num_prompts}, or more prompts")
        total = train.max_steps if train.max_steps is not None else steps_per_epoch * train.epochs
        return cls(w, prompts_per_step // w, samples_per_prompt, g // w, m, g // (m * w), ppo_epochs * (sequences // g),
                   steps_per_epoch, total)


def key_settings(cfg: TrainJobConfig, *, ranks: int, micro_batch_rows: int, grad_accum_steps: int) -> str:
    """The settings that decide whether a run on new data learns, in one line for the start-up log
    (docs/own-task.md: "Choosing the key settings"): model, data, learning rate, batch arithmetic and lengths."""
    data = cfg.data
    task = cfg.task.resolve(data)
    source = f"data {data.train_path}" + (f" (eval {data.eval_path})" if data.eval_path else "") if data.train_path \
        else f"the bundled {task} task"
    micro = f"{micro_batch_rows} (micro batch{', derived' if cfg.train.micro_batch_size is None else ''})"
    parts = [f"model {cfg.model.path}", source,
             f"lr {cfg.optim.lr:g} ({cfg.optim.scheduler}, warm-up {cfg.optim.warmup_ratio:g})",
             f"{cfg.train.global_batch_size} per optimizer step = {ranks} rank(s) x {micro} x {grad_accum_steps} "
             "accumulation", f"data.max_length {data.max_length}"]
    rollout = getattr(cfg, "rollout", None)
    if rollout is not None:
        parts.append(f"rollout {rollout.prompts_per_step} prompts x {rollout.samples_per_prompt} samples of up to "
                     f"{rollout.max_new_tokens} tokens")
    parts.append(f"eval answers up to {cfg.eval.max_new_tokens} tokens")
    return "key settings: " + "; ".join(parts)


def eval_shards(items: Sequence, env: DistEnv, batch_size: int) -> list[tuple[list, bool]]:
    """This rank's share of `items` (`shard_rows`) in batches; every rank gets the same number of
    batches (a ZeRO-3 requirement), padded with dummy batches flagged True."""
    shard = [items[i] for i in shard_rows(len(items), env.world_size)[env.rank]]
    n_batches = math.ceil(math.ceil(len(items) / env.world_size) / batch_size) if items else 0
    batches = [shard[i * batch_size : (i + 1) * batch_size] for i in range(n_batches)]
    return [(b, False) if b else ([items[0]], True) for b in batches]
