"""Rejection sampling (best-of-n fine-tuning) and iterative DPO.

Each round: sample `rollout.samples_per_prompt` responses to `rs.prompts_per_iteration` prompts
with the current model, score them with the reward sources, select, then train
`rs.steps_per_iteration` optimizer steps on the selection:

- `rs.mode: sft` keeps each prompt's best response (when it reaches `rs.min_score`) and trains
  the SFT loss on them (Touvron et al. 2023, Llama 2's rejection-sampling fine-tuning);
- `rs.mode: dpo` pairs each prompt's best and worst responses (when their scores differ) and
  trains DPO against the frozen reference (iterative / online DPO, Xiong et al. 2024), with an
  NLL term on the chosen responses (`rs.nll_coef`).

A round's selection is written to `rounds/round_NNN.jsonl` (prompt, responses, scores, token
ids): it is what a resumed run trains on, and what a person reads to see what was learned from.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrlhf.algos.preference import dpo_loss
from hpcrlhf.config.schema import RSConfig
from hpcrlhf.data.sft import TokenizedSample
from hpcrlhf.engines.distributed import barrier
from hpcrlhf.errors import ConfigError, DataError
from hpcrlhf.logs import get_logger
from hpcrlhf.run.files import ensure_folder, replace_file
from hpcrlhf.run.stats import Stats, reduce_means
from hpcrlhf.trainers.batches import BatchPlan, rows_for_step
from hpcrlhf.trainers.online import OnlineTrainer, Rollout, reward_set, rollout_engines, stream_weights
from hpcrlhf.trainers.seeds import selection_order_seed
from hpcrlhf.trainers.sequences import response_logps
from hpcrlhf.trainers.sft import nll_step
from hpcrlhf.trainers.single_model import SingleModelTrainer

log = get_logger()


def select_best(rollout: Rollout, n: int, min_score: float | None) -> list[dict]:
    """Each prompt's best response (first of equal scores) if it reaches `min_score`; without
    a threshold, if it beats the prompt's worst (when all score the same, none is better)."""
    out = []
    for g in range(len(rollout.generations) // n):
        scores = rollout.scores[g * n : (g + 1) * n]
        best, top = g * n + int(torch.argmax(scores)), float(scores.max())
        if (top >= min_score) if min_score is not None else (top > float(scores.min())):
            out.append(_record(rollout, best, "chosen"))
    return out


def select_pairs(rollout: Rollout, n: int) -> list[dict]:
    """Each prompt's (best, worst) responses when the best scores strictly higher."""
    out = []
    for g in range(len(rollout.generations) // n):
        scores = rollout.scores[g * n : (g + 1) * n]
        best, worst = g * n + int(torch.argmax(scores)), g * n + int(torch.argmin(scores))
        if float(rollout.scores[best]) > float(rollout.scores[worst]):
            out.append(_record(rollout, best, "chosen") | _record(rollout, worst, "rejected"))
    return out


def _record(rollout: Rollout, i: int, role: str) -> dict:
    p, g, r = rollout.prompts[i], rollout.generations[i], rollout.responses[i]
    return {"prompt": p.text, "prompt_ids": list(p.ids), role: r.text, f"{role}_ids": list(g.response_ids),
            f"{role}_score": float(rollout.scores[i])}


def _sample(rec: dict, role: str) -> TokenizedSample:
    prompt, response = rec["prompt_ids"], rec[f"{role}_ids"]
    return TokenizedSample(tuple(prompt + response), (False,) * len(prompt) + (True,) * len(response), "rs")


class RSTrainer(OnlineTrainer, SingleModelTrainer):
    """Online (it generates its training data), with one trained model and the rollout engine in
    this process."""

    kind = "rs"

    def __init__(self, cfg: RSConfig):
        self.setup(cfg)
        self.setup_online()
        rs, w = cfg.rs, self.env.world_size
        if rs.prompts_per_iteration % w:
            raise ConfigError(f"rs.prompts_per_iteration: {rs.prompts_per_iteration} does not split over {w} ranks; "
                              f"use a multiple of {w}")
        if rs.prompts_per_iteration > len(self.prompts):
            raise ConfigError(f"rs.prompts_per_iteration: {rs.prompts_per_iteration} is more than the "
                              f"{len(self.prompts)} prompts available; use at most {len(self.prompts)}")
        total = rs.iterations * rs.steps_per_iteration
        plan = BatchPlan.build(dataclasses.replace(cfg.train, max_steps=total), num_rows=cfg.train.global_batch_size,
                               data_parallel_size=w)
        self.plan = dataclasses.replace(plan, steps_per_epoch=rs.steps_per_iteration)  # epoch = round
        self.engine = self.models.build_trained_model(cfg.model.path, value_head=False, optim=cfg.optim,
                                                      micro_batch_rows=plan.micro_batch_rows,
                                                      grad_accum_steps=plan.grad_accum_steps, total_steps=total)
        self.reference = None
        if rs.mode == "dpo":
            field, path = cfg.reference_source()
            self.reference = self.models.build_frozen_model(path, value_head=False, key=field,
                                                            offload=cfg.reference.offload,
                                                            micro_batch_rows=plan.micro_batch_rows)
        self.rewards = reward_set(cfg, self.models, self.task)
        self.rollout, self.hf_rollout = rollout_engines(self.engine, self.models, cfg)
        # a vLLM engine starts from model.path: the policy's weights go in before it generates
        self.rollout_synced = self.rollout is self.hf_rollout
        self.round, self.selected = -1, []
        log.info(f"rs ({rs.mode}): {rs.iterations} rounds of {rs.prompts_per_iteration} prompts x "
                 f"{cfg.rollout.samples_per_prompt} samples, {rs.steps_per_iteration} steps each; "
                 f"rewards: {', '.join(self.rewards.names)}")

    def send_policy_weights(self) -> dict[str, float] | None:
        return stream_weights(self.engine, self.rollout, self.cfg.placement.vllm.sync_bucket_mb << 20)

    def round_path(self, k: int) -> Path:
        return self.run.dir / "rounds" / f"round_{k:03d}.jsonl"

    def start_round(self, k: int, step: int) -> dict[str, float]:
        """Generate, score and select this round's data (or reload it when resuming)."""
        path, metrics = self.round_path(k), {}
        if path.exists():
            self.selected = [json.loads(line) for line in path.read_text().splitlines()]
            log.info(f"round {k}: reusing {len(self.selected)} selected rows from {path}")
        else:
            cfg, n = self.cfg, self.cfg.rollout.samples_per_prompt
            per_rank = cfg.rs.prompts_per_iteration // self.env.world_size
            idx = rows_for_step(len(self.prompts), k, cfg.seed, self.env.rank,
                                steps_per_epoch=len(self.prompts) // cfg.rs.prompts_per_iteration,
                                global_rows=cfg.rs.prompts_per_iteration, rows_per_rank=per_rank)
            rollout = self.rollout_step([self.prompts[i] for i in idx], self.sampling(step, n), version=step)
            local = select_pairs(rollout, n) if cfg.rs.mode == "dpo" else select_best(rollout, n, cfg.rs.min_score)
            gathered: list = [None] * self.env.world_size
            dist.all_gather_object(gathered, local)
            self.selected = [rec for part in gathered for rec in part]
            if self.env.is_main:
                replace_file(ensure_folder(path.parent) / path.name, "".join(json.dumps(rec) + "\n" for rec in self.selected))
            barrier()
            stats = self.rollout_stats(rollout)
            stats["rs/selected"] = (float(len(local)), float(per_rank))
            metrics = reduce_means(stats)
        if not self.selected:
            raise DataError(f"round {k}: no prompt produced a usable {'pair' if self.cfg.rs.mode == 'dpo' else 'response'} "
                            f"(rs.min_score={self.cfg.rs.min_score}); lower rs.min_score or raise "
                            "rollout.samples_per_prompt")
        self.round = k
        return metrics

    def train_step(self, step: int) -> dict[str, float]:
        k, within = divmod(step, self.cfg.rs.steps_per_iteration)
        metrics = self.start_round(k, step) if k != self.round else {}
        g = self.plan.global_batch_rows
        # A small selection is cycled through: its indices tiled to at least one global batch.
        order = list(range(len(self.selected))) * max(1, -(-g // len(self.selected)))
        idx = rows_for_step(len(order), within, selection_order_seed(self.cfg.seed, k), self.env.rank,
                            steps_per_epoch=len(order) // g, global_rows=g,
                            rows_per_rank=self.plan.rows_per_rank_per_step)
        records = [self.selected[order[i]] for i in idx]
        if self.cfg.rs.mode == "sft":
            return metrics | nll_step(self, [[_sample(r, "chosen")] for r in records], packed=False)
        return metrics | self.sample_mean_step(within, len(records), lambda part: self.dpo_loss([records[i] for i in part]),
                                               indices=list(range(len(records))))

    def dpo_loss(self, records: list[dict]) -> tuple[torch.Tensor, int, Stats]:
        rs, n = self.cfg.rs, len(records)
        samples = [_sample(r, "chosen") for r in records] + [_sample(r, "rejected") for r in records]
        policy, counts = response_logps(self.engine, samples, self.pad_id, self.engine.device)
        with torch.no_grad():
            ref, _ = response_logps(self.reference, samples, self.pad_id, self.engine.device)
        out = dpo_loss(policy[:n], policy[n:], ref[:n], ref[n:], beta=rs.beta)
        loss = out.loss + rs.nll_coef * (-policy[:n] / counts[:n].clamp(min=1)).mean()
        return loss, int(counts.sum()), {"train/reward_margin": (float(out.margins.sum()), n),
                                         "train/reward_accuracy": (float(out.accuracy) * n, n)}


def run_rs(cfg: RSConfig) -> dict:
    return RSTrainer(cfg).fit()
