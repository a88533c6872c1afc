"""PPO and its critic-free relatives (GRPO, RLOO, REINFORCE++) on one machine.

One step reads top to bottom, each phase timed under its metric name:

    rollout    this rank's prompts -> n responses each (vLLM or HF generate)   timing/generate
               -> scores from the reward models / rules, penalties              timing/reward
    experience actor log-probs (old), reference log-probs, critic values,
               KL-shaped rewards, advantages and returns                        timing/make_experience
    update     PPO epochs over mini-batches of the replay buffer: the actor's
               clipped policy loss (+ entropy bonus, + KL loss), the critic's
               clipped value loss                                               timing/train_actor, timing/train_critic
    sync       actor weights into the rollout engine                            timing/weight_sync

The maths are pure functions in `algos.ppo` and `algos.advantages`. Every batch statistic
(whitening, the KL controller's measured KL, running reward moments, loss normalisers) is
summed over ranks, so N ranks train like one rank with N times the batch.

The PPO ratio's denominator is the actor's own recomputed log-prob of each response token (fp32,
temperature 1), not the rollout engine's: the two agree to ~1e-5 (logged as
`rollout/logprob_max_diff`), and recomputing keeps the ratio exactly 1 at the first update.

Every role here is a local object (actor and critic engines, frozen reference and reward models,
a rollout engine); the Ray launcher runs the same phases with each role on its own workers.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from hpcrlhf.algos.advantages import compute_advantages
from hpcrlhf.algos.logprobs import IGNORE, token_logprobs
from hpcrlhf.algos.ppo import (RunningMoments, aggregate_loss, build_kl_controller, clip_rewards, entropy_from_logits,
                               kl_estimate, masked_sum, normalize_scores, policy_loss, shape_rewards, value_loss)
from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.data.sft import TokenizedSample
from hpcrlhf.engines.distributed import all_reduce_sum
from hpcrlhf.logs import get_logger
from hpcrlhf.trainers.base import reduce_means
from hpcrlhf.trainers.experience import ReplayBuffer, collate_experience, split_rows
from hpcrlhf.trainers.online import OnlineTrainer, Rollout
from hpcrlhf.trainers.plan import PPOPlan
from hpcrlhf.trainers.sequences import model_batch

log = get_logger()


class PPOTrainer(OnlineTrainer):
    kind = "ppo"
    progress_key = "rollout/score"

    def __init__(self, cfg: PPOConfig):
        self.setup(cfg)
        self.setup_online()
        ppo = cfg.ppo
        self.plan = PPOPlan.build(cfg.train, prompts_per_step=cfg.rollout.prompts_per_step,
                                  samples_per_prompt=cfg.rollout.samples_per_prompt, ppo_epochs=ppo.epochs,
                                  num_prompts=len(self.prompts), data_parallel_size=self.env.world_size)
        plan, updates = self.plan, self.plan.total_steps * self.plan.updates_per_step
        engine_args = dict(micro_batch_rows=plan.micro_batch_rows, grad_accum_steps=plan.grad_accum_steps,
                           total_steps=updates)
        self.engine = self.build_trained_model(cfg.model.path, value_head=False, optim=cfg.optim, **engine_args)
        self.critic = None
        if ppo.uses_critic:
            self.critic = self.build_trained_model(cfg.critic_source()[1], value_head=True, optim=cfg.critic.optim,
                                                   **engine_args)
        self.reference = None
        if ppo.uses_reference:
            self.reference = self.build_frozen_model(cfg.reference_source()[1], value_head=False,
                                                     offload=cfg.reference.offload, micro_batch_rows=plan.micro_batch_rows)
        self.build_rewards()
        self.build_rollout()
        self.kl_ctl = build_kl_controller(ppo.init_kl_coef, ppo.kl_target, ppo.kl_horizon)
        self.moments = RunningMoments()
        self.buffer = ReplayBuffer(ppo.buffer_limit)
        log.info(f"ppo ({ppo.advantage_estimator}): {len(self.prompts)} prompts, {plan.total_steps} rollouts of "
                 f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.samples_per_prompt} samples, "
                 f"{plan.updates_per_step} optimizer step(s) per rollout, {self.env.world_size} rank(s), "
                 f"rollout backend {cfg.rollout.backend}, rewards: {', '.join(self.rewards.names)}")

    @property
    def checkpointable(self):
        return PPOState(self)

    # -- one PPO step ---------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        indices = self.plan.prompts_for_step(len(self.prompts), step, cfg.seed, self.env.rank)
        rollout = self.rollout_step([self.prompts[i] for i in indices], self.sampling(step, cfg.rollout.samples_per_prompt))
        with self.run.timed("make_experience"):
            items, stats = self.make_experience(rollout)
        self.buffer.add(items)
        # The actor and the critic see the same mini-batches (same permutation seed).
        order_seed = cfg.seed * 1_000_003 + step * 31 + self.env.rank
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        if step >= cfg.ppo.freeze_actor_steps:
            with self.run.timed("train_actor"):
                self.update(self.engine, self.actor_loss, order_seed, sums)
        if self.critic is not None:
            with self.run.timed("train_critic"):
                self.update(self.critic, self.critic_loss, order_seed, sums)
        with self.run.timed("weight_sync"):
            self.sync_rollout()
        metrics = reduce_means(stats) | reduce_means(sums, sum_divisor=self.plan.updates_per_step)
        self.kl_ctl.update(metrics.get("rollout/kl", 0.0), n_steps=cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt)
        metrics["train/kl_coef"] = self.kl_ctl.value
        metrics["train/loss"] = metrics.get("train/policy_loss", 0.0)
        if self.critic is not None:
            metrics["train/critic_lr"] = self.critic.lr()
        metrics["train/tokens"] = all_reduce_sum([float(rollout.lengths.sum())])[0]
        return metrics

    @torch.no_grad()
    def make_experience(self, rollout: Rollout) -> tuple[list, dict[str, tuple[float, float]]]:
        """Old log-probs, reference log-probs, values, rewards and advantages of a rollout."""
        cfg, ppo = self.cfg, self.cfg.ppo
        prompt_lens = [len(p.ids) for p in rollout.prompts]
        samples = [TokenizedSample(r.sequence_ids, (False,) * n + (True,) * (len(r.sequence_ids) - n), "rollout")
                   for r, n in zip(rollout.responses, prompt_lens)]
        batch = model_batch(samples, self.pad_id, torch.device("cpu"))
        mask = batch["labels"] != IGNORE
        self.engine.eval()
        old = self._forward_logps(self.engine, batch)
        rollout_logps = torch.zeros_like(old)
        for i, (g, start) in enumerate(zip(rollout.generations, prompt_lens)):
            rollout_logps[i, start - 1 : start - 1 + len(g.logprobs)] = torch.tensor(g.logprobs)
        ref = self._forward_logps(self.reference, batch) if self.reference is not None else None
        values = None
        if self.critic is not None:
            self.critic.eval()
            values = self._forward_values(self.critic, batch) * mask

        scores = rollout.scores.clone()
        if cfg.reward.running_norm:
            self.moments.update(scores, reduce=all_reduce_sum)
            scores = normalize_scores(scores, self.moments)
        scores = clip_rewards(scores, cfg.reward.clip)
        kl = kl_estimate(old, ref, ppo.kl_estimator, mask) if ref is not None else torch.zeros_like(old)
        kl_coef = self.kl_ctl.value if ppo.init_kl_coef > 0 else 0.0
        if ppo.advantage_estimator in ("grpo", "rloo"):
            # Sequence-level estimators: the KL penalty joins the score before the group baseline.
            scores = scores - kl_coef * masked_sum(kl, mask, dim=-1)
            rewards = shape_rewards(scores, torch.zeros_like(kl), mask, 0.0)
        else:
            rewards = shape_rewards(scores, kl, mask, kl_coef)
        advantages, returns = compute_advantages(
            ppo.advantage_estimator, rewards=rewards, mask=mask, scores=scores, values=values,
            group_size=cfg.rollout.samples_per_prompt, gamma=ppo.gamma, lam=ppo.lam,
            whiten=ppo.whiten_advantages, reduce=all_reduce_sum)
        items = split_rows({"input_ids": batch["input_ids"], "labels": batch["labels"], "old_logps": old,
                            "advantages": advantages, "returns": returns, "values": values,
                            "ref_logps": ref if ppo.kl_loss_coef > 0 else None}, [len(s.input_ids) for s in samples])

        n = len(samples)
        stats = self.rollout_stats(rollout)
        stats["rollout/kl"] = (float(masked_sum(kl, mask)), n)
        stats["rollout/logprob_max_diff"] = (float(((rollout_logps - old).abs() * mask).amax(dim=-1).sum()), n)
        stats["rollout/advantage"] = (float(masked_sum(advantages, mask)), float(mask.sum()))
        if values is not None:
            stats["rollout/value"] = (float(masked_sum(values, mask)), float(mask.sum()))
            stats["rollout/return"] = (float(masked_sum(returns, mask)), float(mask.sum()))
        return items, stats

    # -- updates ----------------------------------------------------------------------------
    def update(self, engine, micro_loss, order_seed: int, sums: dict[str, list[float]]) -> None:
        """PPO epochs x mini-batches of optimizer steps on `engine`; each mini-batch's loss is
        normalised by its global token (or sequence) count, so accumulation over micro-batches and
        ranks gives the exact mini-batch mean."""
        plan, ppo, world = self.plan, self.cfg.ppo, self.env.world_size
        engine.train()
        generator = torch.Generator().manual_seed(order_seed)
        for _ in range(ppo.epochs):
            for minibatch in self.buffer.minibatches(plan.minibatches_per_epoch, plan.minibatch_rows_per_rank, generator):
                normalizer = self._normalizer(minibatch)
                for start in range(0, len(minibatch), plan.micro_batch_rows):
                    batch = collate_experience(minibatch[start : start + plan.micro_batch_rows], self.pad_id, engine.device)
                    loss, stats = micro_loss(engine, batch, normalizer)
                    engine.backward(loss * world)
                    engine.step()
                    for key, (total, count) in stats.items():
                        sums[key][0] += total
                        sums[key][1] += count
        norm = engine.grad_norm()  # the same on every rank: the mean over ranks is the norm
        if norm is not None:
            name = "actor" if engine is self.engine else "critic"
            sums[f"train/{name}_grad_norm"][0] += norm
            sums[f"train/{name}_grad_norm"][1] += 1

    def _normalizer(self, minibatch) -> float:
        """The global mini-batch's count for the loss aggregation mode."""
        if self.cfg.ppo.loss_aggregation == "token-mean":
            local = sum(int((e.labels != IGNORE).sum()) for e in minibatch)
        else:
            local = len(minibatch)
        return max(all_reduce_sum([float(local)])[0], 1.0)

    def actor_loss(self, engine, batch: dict[str, torch.Tensor], normalizer: float):
        ppo, mask = self.cfg.ppo, batch["action_mask"]
        logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logp = token_logprobs(logits, batch["labels"])
        loss, st = policy_loss(logp, batch["old_logps"], batch["advantages"], mask, clip_eps_low=ppo.clip_eps,
                               clip_eps_high=ppo.clip_eps_high, dual_clip=ppo.dual_clip,
                               aggregation=ppo.loss_aggregation, normalizer=normalizer)
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
        return loss, stats

    def critic_loss(self, engine, batch: dict[str, torch.Tensor], normalizer: float):
        values = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss, st = value_loss(values, batch["values"], batch["returns"], batch["action_mask"],
                              clip_eps=self.cfg.ppo.value_clip, aggregation=self.cfg.ppo.loss_aggregation,
                              normalizer=normalizer)
        return loss, {"train/value_loss": (float(loss.detach()), 0.0),
                      "train/value_clipfrac": (float(st["clipfrac_sum"]), float(st["tokens"]))}

    # -- forward passes over a whole rollout ---------------------------------------------------
    def _chunks(self, batch: dict[str, torch.Tensor]):
        size, device = self.cfg.eval.batch_size, self.device
        for start in range(0, batch["input_ids"].shape[0], size):
            yield {k: v[start : start + size].to(device) for k, v in batch.items()}

    def _forward_logps(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = [token_logprobs(model(input_ids=c["input_ids"], attention_mask=c["attention_mask"]).logits, c["labels"]).cpu()
               for c in self._chunks(batch)]
        return torch.cat(out)

    def _forward_values(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([model(input_ids=c["input_ids"], attention_mask=c["attention_mask"]).float().cpu()
                          for c in self._chunks(batch)])


class PPOState:
    """Everything a PPO checkpoint holds: actor and critic engines (model, optimizer, schedule),
    the KL controller, the running reward moments and this rank's replay buffer."""

    def __init__(self, trainer: PPOTrainer):
        self.t = trainer

    def save_checkpoint(self, folder: Path, client_state: dict[str, Any]) -> None:
        t = self.t
        state = {**client_state, "kl_controller": t.kl_ctl.state_dict(), "reward_moments": t.moments.state_dict()}
        t.engine.save_checkpoint(folder, state)
        if t.critic is not None:
            t.critic.save_checkpoint(folder / "critic", {"step": client_state["step"]})
        if t.cfg.ppo.buffer_limit:
            torch.save(t.buffer.state_dict(), folder / f"replay_rank{t.env.rank}.pt")

    def load_checkpoint(self, folder: Path) -> dict[str, Any]:
        t = self.t
        state = t.engine.load_checkpoint(folder)
        if t.critic is not None:
            t.critic.load_checkpoint(folder / "critic")
        t.kl_ctl.load_state_dict(state["kl_controller"])
        t.moments.load_state_dict(state["reward_moments"])
        replay = folder / f"replay_rank{t.env.rank}.pt"
        if t.cfg.ppo.buffer_limit and replay.exists():
            t.buffer.load_state_dict(torch.load(replay, weights_only=False))
        t.rollout_synced = t.rollout is t.hf_rollout  # push the resumed weights before generating
        return state


def run_ppo(cfg: PPOConfig) -> dict:
    return PPOTrainer(cfg).fit()
