"""The per-role halves of a PPO step, shared by the single-machine roles and the Ray role workers:

- `build_role_model`: a role's model as its config section says (actor, critic, reference);
- `token_scores`: a role's forward pass over a rollout batch, token log-probs (actor, reference)
  or values (critic);
- `PPOLearner`: a trained role's PPO epochs over its replay buffer (actor: clipped policy loss,
  entropy bonus, KL loss; critic: clipped value loss).

Every batch statistic inside an update (the loss normaliser) is summed over the process group
this runs in: all ranks on one machine, or one role's ranks on Ray. So N ranks train like one
rank with N times the batch, wherever they run.
"""

from __future__ import annotations

from typing import Literal
from collections.abc import Callable

import torch

from hpcrlhf.algos.kl import kl_estimate
from hpcrlhf.algos.logprobs import IGNORE, token_logprobs
from hpcrlhf.algos.masked import masked_sum
from hpcrlhf.algos.ppo import aggregate_loss, entropy_from_logits, policy_loss, value_loss
from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.engines.distributed import all_reduce_sum
from hpcrlhf.models.factory import ModelFactory
from hpcrlhf.models.moe import router_kwargs
from hpcrlhf.run.guard import SKIPPED_SUFFIX
from hpcrlhf.run.stats import Stats, add_stats, new_stats
from hpcrlhf.trainers.batches import PPOPlan
from hpcrlhf.trainers.ppo.experience import ExperienceBatch, ReplayBuffer, collate_experience
from hpcrlhf.trainers.seeds import minibatch_seed


def build_role_model(models: ModelFactory, cfg: PPOConfig, role: Literal["actor", "critic", "ref"], plan: PPOPlan):
    """The model of a PPO role, built by `models` for a role whose ranks follow
    `plan`: the actor from model.path and the critic from its source (DeepSpeed training engines
    with their own optimizers), the reference from its source (frozen)."""
    if role == "ref":
        field, path = cfg.reference_source()
        return models.build_frozen_model(path, value_head=False, key=field, offload=cfg.reference.offload,
                                         micro_batch_rows=plan.micro_batch_rows)
    (field, path), optim = (("model.path", cfg.model.path), cfg.optim) if role == "actor" else (cfg.critic_source(), cfg.critic.optim)
    return models.build_trained_model(path, value_head=role == "critic", optim=optim, key=field, **plan.engine_args())


SCORE_FIELDS = {"actor": "old_logps", "ref": "ref_logps", "critic": "values"}
"""The batch field each role's forward pass fills (`token_scores`)."""
FORWARD_INPUTS = ("input_ids", "attention_mask", "labels")


@torch.no_grad()
def token_scores(role: Literal["actor", "ref", "critic"], model, batch: ExperienceBatch, chunk_rows: int,
                 device: torch.device) -> ExperienceBatch:
    """`role`'s number for every token of `batch` (B, T) on the CPU, computed in chunks of
    `chunk_rows` sequences: the log-prob of each label token (actor, reference) or the value
    model's estimate at each position (critic), as the batch field `SCORE_FIELDS[role]`."""
    scores = []
    for start in range(0, len(batch), chunk_rows):
        c = {k: batch.tensors[k][start : start + chunk_rows].to(device) for k in FORWARD_INPUTS}
        out = model(input_ids=c["input_ids"], attention_mask=c["attention_mask"])
        scores.append(out.float().cpu() if role == "critic" else token_logprobs(out.logits, c["labels"]).cpu())
    return ExperienceBatch({SCORE_FIELDS[role]: torch.cat(scores)}, batch.lengths)


class PPOLearner:
    """The actor's or the critic's updates: PPO epochs x mini-batches of optimizer steps on its
    engine, drawn from a replay buffer. Each mini-batch's loss is normalised by its global token
    (or sequence) count, so accumulation over micro-batches and ranks gives the exact mini-batch
    mean."""

    def __init__(self, role: Literal["actor", "critic"], engine, cfg: PPOConfig, plan: PPOPlan, pad_id: int, buffer: ReplayBuffer):
        self.role, self.engine, self.cfg, self.plan, self.pad_id, self.buffer = role, engine, cfg, plan, pad_id, buffer
        self.micro_loss: Callable = self.actor_loss if role == "actor" else self.critic_loss

    def update(self, step: int, rank: int) -> Stats:
        plan, ppo, engine = self.plan, self.cfg.ppo, self.engine
        world = plan.data_parallel_size
        sums: Stats = new_stats()
        skipped_before = engine.skipped_updates
        engine.train()
        generator = torch.Generator().manual_seed(minibatch_seed(self.cfg.seed, step, rank))
        for _ in range(ppo.epochs):
            for minibatch in self.buffer.minibatches(plan.minibatches_per_epoch, plan.minibatch_rows_per_rank, generator):
                normalizer = self._normalizer(minibatch)
                for start in range(0, len(minibatch), plan.micro_batch_rows):
                    batch = collate_experience(minibatch[start : start + plan.micro_batch_rows], self.pad_id, engine.device)
                    loss, stats = self.micro_loss(batch, normalizer)
                    engine.backward(loss * world)
                    engine.step()
                    add_stats(sums, stats)
        norm = engine.grad_norm()  # the same on every rank: the mean over ranks is the norm
        if norm is not None:
            sums[f"train/{self.role}_grad_norm"] = [norm, 1.0]
        sums[f"train/{self.role}_lr"] = [engine.lr(), 1.0]
        sums[f"train/{self.role}_{SKIPPED_SUFFIX}"] = [float(engine.skipped_updates - skipped_before), 1.0]
        return dict(sums)

    def _normalizer(self, minibatch) -> float:
        """The global mini-batch's count for the loss aggregation mode."""
        if self.cfg.ppo.loss_aggregation == "token-mean":
            local = sum(int((e.labels != IGNORE).sum()) for e in minibatch)
        else:
            local = len(minibatch)
        return max(all_reduce_sum([float(local)])[0], 1.0)

    def actor_loss(self, batch: dict[str, torch.Tensor], normalizer: float):
        ppo, mask, coef = self.cfg.ppo, batch["action_mask"], self.cfg.model.router_aux_loss_coef
        out = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **router_kwargs(coef))
        logits = out.logits
        logp = token_logprobs(logits, batch["labels"])
        loss, st = policy_loss(logp, batch["old_logps"], batch["advantages"], mask, clip_eps_low=ppo.clip_eps,
                               clip_eps_high=ppo.clip_eps_high, dual_clip=ppo.dual_clip,
                               aggregation=ppo.loss_aggregation, normalizer=normalizer, ratio_level=ppo.ratio_level,
                               token_weights=batch.get("is_weights"))
        stats = {"train/policy_loss": (float(loss.detach()), 0.0),
                 "train/clipfrac": (float(st["clipfrac_sum"]), float(st["tokens"])),
                 "train/approx_kl": (float(st["approx_kl_sum"]), float(st["tokens"])),
                 "train/ratio": (float(st["ratio_sum"]), float(st["tokens"]))}
        entropy = entropy_from_logits(logits.detach() if not ppo.entropy_coef else logits)
        stats["train/entropy"] = (float(masked_sum(entropy.detach(), mask)), float(mask.sum()))
        if ppo.entropy_coef:
            loss = loss - ppo.entropy_coef * aggregate_loss(entropy, mask, ppo.loss_aggregation, normalizer)
        if ppo.kl_loss_coef:
            kl = kl_estimate(logp, batch["ref_logps"], ppo.kl_estimator, mask)
            kl_loss = aggregate_loss(kl, mask, ppo.loss_aggregation, normalizer)
            loss = loss + ppo.kl_loss_coef * kl_loss
            stats["train/kl_loss"] = (float(kl_loss.detach()), 0.0)
        if coef:  # a mean per forward, weighted by the micro-batch's share of the global mini-batch
            rows = batch["input_ids"].shape[0]
            loss = loss + coef * out.aux_loss * (rows / self.cfg.train.global_batch_size)
            stats["train/router_aux_loss"] = (float(out.aux_loss.detach()) * rows, float(rows))
        return loss, stats

    def critic_loss(self, batch: dict[str, torch.Tensor], normalizer: float):
        values = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss, st = value_loss(values, batch["values"], batch["returns"], batch["action_mask"],
                              clip_eps=self.cfg.ppo.value_clip, aggregation=self.cfg.ppo.loss_aggregation,
                              normalizer=normalizer)
        return loss, {"train/value_loss": (float(loss.detach()), 0.0),
                      "train/value_clipfrac": (float(st["clipfrac_sum"]), float(st["tokens"]))}
