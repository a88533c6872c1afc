"""Supervised fine-tuning (SFT).

Loss: mean next-token negative log-likelihood over the response tokens (and EOS) of every sample
in the global batch. Computed as a token sum normalised by the global token count, so the result
does not depend on how the batch is split over ranks, micro-batches or packed rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from hpcrlhf.algos.logprobs import nll_sum
from hpcrlhf.config.schema import SFTConfig
from hpcrlhf.data.batching import collate, pack_rows
from hpcrlhf.data.sft import TokenizedSample, encode_prompts, tokenize_sft
from hpcrlhf.data.sources import Row, read_rows, require_text, rows_from_records
from hpcrlhf.data.tasks import build_task
from hpcrlhf.engines.distributed import DistEnv, all_reduce_sum, init_distributed
from hpcrlhf.engines.hf_generate import generate_greedy
from hpcrlhf.logs import get_logger
from hpcrlhf.trainers.base import Trainer
from hpcrlhf.trainers.plan import BatchPlan
from hpcrlhf.trainers.run import Run

log = get_logger()


@dataclass(frozen=True)
class SFTData:
    train_rows: list[list[TokenizedSample]]
    """Training rows in a fixed order (one sample each, or several when packed)."""
    eval_samples: list[TokenizedSample]
    score_prompts: list[tuple[list[int], str]]
    """(prompt token ids, prompt text) scored by the task after greedy generation."""


def load_sft_rows(cfg: SFTConfig) -> tuple[list[Row], list[Row]]:
    """Train and eval rows from the configured files, or from the bundled task."""
    data, task = cfg.data, build_task(cfg.task)
    origin = f"task:{cfg.task.name}"
    if data.train_path:
        train = read_rows(data.train_path, split=data.split, limit=data.max_samples)
    else:
        train = rows_from_records(task.sft_rows("train", data.max_samples or cfg.task.train_size), f"{origin}[train]")
    if data.eval_path:
        evals = read_rows(data.eval_path, split=data.split)
    elif task is not None and not data.train_path:
        evals = rows_from_records(task.sft_rows("eval", cfg.task.eval_size), f"{origin}[eval]")
    else:
        evals = []
    keys = (data.prompt_key, data.response_key)
    options = {data.prompt_key: "data.prompt_key", data.response_key: "data.response_key"}
    require_text(train, keys, key_option=options)
    require_text(evals, keys, key_option=options)
    return train, evals


def build_sft_data(cfg: SFTConfig, tokenizer) -> SFTData:
    train_rows, eval_rows = load_sft_rows(cfg)
    kw = dict(prompt_key=cfg.data.prompt_key, response_key=cfg.data.response_key,
              max_length=cfg.data.max_length, apply_chat_template=cfg.data.apply_chat_template)
    train, truncated = tokenize_sft(train_rows, tokenizer, **kw)
    evals, _ = tokenize_sft(eval_rows, tokenizer, **kw)
    if truncated:
        log.warning(f"{truncated} of {len(train)} training samples were longer than data.max_length="
                    f"{cfg.data.max_length} tokens and were truncated")
    if cfg.data.packing:
        # Shuffle once before packing so each packed row mixes samples; rows are then reshuffled
        # per epoch like unpacked samples.
        g = torch.Generator().manual_seed(cfg.seed)
        train = [train[i] for i in torch.randperm(len(train), generator=g).tolist()]
        rows = [[train[i] for i in group] for group in pack_rows([len(s.input_ids) for s in train], cfg.data.max_length)]
    else:
        rows = [[s] for s in train]
    score_prompts = []
    task = build_task(cfg.task)
    if task is not None:
        texts = [r["prompt"] for r in task.prompt_rows("eval", cfg.eval.score_prompts)]
        score_prompts = list(zip(encode_prompts(tokenizer, texts, cfg.data.apply_chat_template), texts))
    return SFTData(rows, evals, score_prompts)


def rows_for_step(num_rows: int, step: int, plan: BatchPlan, seed: int, rank: int) -> list[int]:
    """Indices of the rows this rank trains on at optimizer step `step` (0-based).

    The order is a pure function of (seed, epoch), so the data position of a resumed run is
    just its step: no sample is lost or repeated across a restart.
    """
    epoch, within = divmod(step, plan.steps_per_epoch)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))
    start = within * plan.global_batch_rows + rank * plan.rows_per_rank_per_step
    return order[start : start + plan.rows_per_rank_per_step].tolist()


def eval_shards(items: Sequence, env: DistEnv, batch_size: int) -> list[tuple[list, bool]]:
    """This rank's share of `items` in batches; every rank gets the same number of batches (a
    ZeRO-3 requirement), padded with dummy batches flagged True."""
    shard = list(items[env.rank :: env.world_size])
    n_batches = math.ceil(math.ceil(len(items) / env.world_size) / batch_size) if items else 0
    batches = [shard[i * batch_size : (i + 1) * batch_size] for i in range(n_batches)]
    return [(b, False) if b else ([items[0]], True) for b in batches]


class SFTTrainer(Trainer):
    kind = "sft"

    def __init__(self, cfg: SFTConfig):
        from hpcrlhf.engines.deepspeed_engine import (TrainingEngine, build_deepspeed_config,
                                                      maybe_zero3_init_context, set_extension_cache)
        from hpcrlhf.models.loading import load_causal_lm, load_tokenizer

        self.cfg = cfg
        self.env = init_distributed()
        torch.manual_seed(cfg.seed)
        self.run = Run(cfg, self.env)
        self.tokenizer = load_tokenizer(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        self.data = build_sft_data(cfg, self.tokenizer)
        self.plan = BatchPlan.build(cfg.train, num_rows=len(self.data.train_rows), data_parallel_size=self.env.world_size)
        ds_config = build_deepspeed_config(cfg.engine, cfg.optim, micro_batch_size=self.plan.micro_batch_rows,
                                           grad_accum_steps=self.plan.grad_accum_steps, world_size=self.env.world_size)
        set_extension_cache()
        self._zero3_ctx = maybe_zero3_init_context(ds_config)
        model = load_causal_lm(cfg.model.path, attn_implementation=cfg.model.attn_implementation,
                               dtype=cfg.engine.precision, trust_remote_code=cfg.model.trust_remote_code)
        self.engine = TrainingEngine(model, ds_config, optim=cfg.optim, total_steps=self.plan.total_steps,
                                     gradient_checkpointing=cfg.engine.gradient_checkpointing)
        self.pad_id = self.tokenizer.pad_token_id
        log.info(f"SFT: {len(self.data.train_rows)} training rows, {self.plan.total_steps} steps, "
                 f"{self.env.world_size} rank(s) x {self.plan.micro_batch_rows} rows x {self.plan.grad_accum_steps} accumulation, "
                 f"ZeRO-{cfg.engine.zero_stage}")

    # -- one optimizer step -------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        rows = [self.data.train_rows[i] for i in rows_for_step(len(self.data.train_rows), step, self.plan, self.cfg.seed, self.env.rank)]
        micro = [collate(rows[i : i + self.plan.micro_batch_rows], self.pad_id, self.cfg.data.packing)
                 for i in range(0, len(rows), self.plan.micro_batch_rows)]
        local_tokens = sum(int((b["labels"] != -100).sum()) for b in micro)
        (global_tokens,) = all_reduce_sum([local_tokens])
        self.engine.train()
        loss_sum = 0.0
        for batch in micro:
            batch = {k: v.to(self.engine.device) for k, v in batch.items()}
            labels = batch.pop("labels")
            nll, _ = nll_sum(self.engine(**batch).logits, labels)
            self.engine.backward(nll * self.env.world_size / global_tokens)
            self.engine.step()
            loss_sum += float(nll.detach())
        (total_loss,) = all_reduce_sum([loss_sum])
        return {"train/loss": total_loss / global_tokens, "train/tokens": global_tokens}

    # -- evaluation -------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.engine.eval()
        out: dict[str, float] = {}
        if self.data.eval_samples:
            loss, count = 0.0, 0
            for batch_samples, dummy in eval_shards(self.data.eval_samples, self.env, self.cfg.eval.batch_size):
                batch = {k: v.to(self.engine.device) for k, v in collate([[s] for s in batch_samples], self.pad_id, False).items()}
                labels = batch.pop("labels")
                nll, n = nll_sum(self.engine(**batch).logits, labels)
                if not dummy:
                    loss, count = loss + float(nll), count + n
            loss, count = all_reduce_sum([loss, count])
            out["eval/loss"] = loss / count
        if self.data.score_prompts:
            task = build_task(self.cfg.task)
            total, n = 0.0, 0
            for batch, dummy in eval_shards(self.data.score_prompts, self.env, self.cfg.eval.batch_size):
                texts = generate_greedy(self.engine.module, self.tokenizer, [p for p, _ in batch],
                                        max_new_tokens=self.cfg.eval.max_new_tokens, device=self.engine.device,
                                        synced_gpus=self.engine.zero_stage == 3 and self.env.world_size > 1)
                if not dummy:
                    total += sum(task.score(prompt, text) for (_, prompt), text in zip(batch, texts))
                    n += len(batch)
            total, n = all_reduce_sum([total, n])
            out["eval/task_score"] = total / n
        return out


def run_sft(cfg: SFTConfig) -> dict:
    return SFTTrainer(cfg).fit()
