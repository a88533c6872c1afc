"""PPO and its critic-free relatives (GRPO, RLOO, REINFORCE++): the driver of a job, local or on Ray.

One step reads top to bottom, each phase timed under its metric name:

    rollout    this rank's prompts -> n responses each (vLLM or HF generate)   timing/generate
               -> scores from the reward models / rules, penalties              timing/reward
    experience actor log-probs (old), reference log-probs, critic values,
               KL-shaped rewards, advantages and returns                        timing/make_experience
    update     PPO epochs over mini-batches of the replay buffer: the actor's
               clipped policy loss (+ entropy bonus, + KL loss), the critic's
               clipped value loss                                               timing/train (wall time),
                                                                                timing/train_actor, timing/train_critic
    sync       actor weights into the rollout engine (on Ray queued behind the
               actor's epochs: the engines wait in it while the roles train;
               timed from the end of the updates)                                timing/weight_sync

With rollout.max_staleness 1 the next step's rollout is launched as soon as this step's generations
are in, so engines that run elsewhere (Ray) generate it while this step scores and trains; the sync
waits for it first (timing/generate_ahead_wait, timing/overlap; see `trainers.ppo.staleness`).

The maths are pure functions in `algos` (`ppo`, `kl`, `reward_shaping`, `advantages`). Every batch statistic
(whitening, the KL controller's measured KL, running reward moments, loss normalisers) is
summed over ranks, so N ranks train like one rank with N times the batch.

The PPO ratio's denominator is the actor's own recomputed log-prob of each response token (fp32,
temperature 1), not the rollout engine's: the two agree to ~1e-5 (logged as
`rollout/logprob_max_diff`), and recomputing keeps the ratio exactly 1 at the first update.

The models are reached through a roles interface (`trainers.ppo.roles.PPORoles`): `LocalRoles`
holds them in this process (one rank of a torchrun group), `ray.roles.RayRoles` on Ray workers placed
by the node map (`placement.runtime: ray`); the driver, its schedule and its checkpoints are the same.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

from hpcrlhf.algos.advantages import compute_advantages
from hpcrlhf.algos.kl import build_kl_controller, kl_estimate
from hpcrlhf.algos.logprobs import IGNORE
from hpcrlhf.algos.masked import masked_sum
from hpcrlhf.algos.ppo import importance_weights
from hpcrlhf.algos.reward_shaping import (RunningMoments, clip_rewards, normalize_scores, place_turn_rewards,
                                          shape_rewards)
from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.data.prompts import Prompt
from hpcrlhf.engines.distributed import all_reduce_sum
from hpcrlhf.engines.rollout import Done
from hpcrlhf.engines.rollout.loop import engine_loop, streams, suspends
from hpcrlhf.errors import ConfigError
from hpcrlhf.logs import get_logger
from hpcrlhf.run.folder import StepAbandoned
from hpcrlhf.run.stats import Stats, reduce_means
from hpcrlhf.trainers.batches import key_settings
from hpcrlhf.trainers.loop import Checkpointable
from hpcrlhf.trainers.online import LaunchedRollout, OnlineTrainer, Rollout
from hpcrlhf.trainers.ppo.dynamic_sampling import fill_step
from hpcrlhf.trainers.ppo.experience import ExperienceBatch, rollout_batch
from hpcrlhf.trainers.ppo.roles import LocalRoles, PPORoles, RoleContext
from hpcrlhf.trainers.ppo.staleness import Ahead, ahead_steps, load_ahead, save_ahead, staleness_stats
from hpcrlhf.trainers.ppo.arrival import ArrivalRollouts
from hpcrlhf.trainers.ppo.stream import load_stream, save_stream
from hpcrlhf.trainers.seeds import refill_seed

log = get_logger()


class PPOTrainer(OnlineTrainer):
    kind = "ppo"
    progress_key = "rollout/score"

    def __init__(self, cfg: PPOConfig, roles: Callable[[RoleContext], PPORoles] = LocalRoles):
        """`roles(context)` builds the job's models once the prompts are loaded: `LocalRoles` in this
        process, or `ray.roles.RayRoles` on the node map's Ray workers."""
        self.setup(cfg)
        self.setup_online()
        self.roles = roles(RoleContext(cfg, self.models, self.task, len(self.prompts), self.run.dir, self.run.timed))
        # a vLLM engine starts from model.path: the actor's weights go in before it generates
        self.rollout_synced = self.rollout is self.hf_rollout
        self.setup_ppo_state()
        self.log_start(self.roles.where)

    # -- what the roles hold, read from them (the driver keeps no copy) --------------------------
    plan = property(lambda self: self.roles.plan)
    rollout = property(lambda self: self.roles.rollout)
    hf_rollout = property(lambda self: self.roles.hf_rollout)
    rewards = property(lambda self: self.roles.rewards)

    def setup_ppo_state(self) -> None:
        """The KL controller, the running reward moments and the rollout generated ahead."""
        ppo = self.cfg.ppo
        self.kl_ctl = build_kl_controller(ppo.init_kl_coef, ppo.kl_target, ppo.kl_horizon)
        self.moments = RunningMoments()
        self.ahead: dict[int, Ahead] = {}
        """Step -> its rollout generated ahead (rollout.max_staleness k >= 1), to be scored at that step."""
        self.suspended: dict[int, tuple[int, Any]] = {}
        """Step -> (updates done at its launch, its batch as far as it got) of each batch a checkpoint kept under
        way (rollout.partial), until it goes on (`relaunch_ahead`)."""
        self.version = 0
        """The policy version the actor holds: its updates done (steps trained; a resumed run's step)."""
        self.arrival = ArrivalRollouts(self) if self.cfg.rollout.stream_order == "arrival" else None
        """rollout.stream_order arrival: where the run's groups go and how a step takes them
        (`trainers.ppo.arrival`), else None."""

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, folder: Path, client_state: dict[str, Any]) -> None:
        """Everything a PPO checkpoint holds: the roles' (actor and critic engines with their
        optimizers and schedules, their replay buffers), the driver's KL controller and running
        reward moments, and the rollout generated ahead. Workers' random states are not saved:
        PPO's randomness (sampling, mini-batch order) is seeded per step (`trainers.seeds`)."""
        under_way = {**self.suspended, **self.suspend_ahead()}  # first: they go on while the models are saved
        stream = self.arrival.stream.state_dict() if self.arrival is not None and self.arrival.stream else None
        controllers = {"kl_controller": self.kl_ctl.state_dict(), "reward_moments": self.moments.state_dict()}
        self.roles.save(folder, {**client_state, **controllers})
        save_ahead([a for a in self.ahead.values() if a.step not in under_way], folder, self.env.rank, under_way)
        if stream is not None:
            save_stream(stream, folder)

    def load_checkpoint(self, folder: Path) -> dict[str, Any]:
        state = self.roles.load(folder)
        self.kl_ctl.load_state_dict(state["kl_controller"])
        self.moments.load_state_dict(state["reward_moments"])
        self.restore_ahead(folder, self.env.rank)
        self.version = state["step"]
        if self.arrival is not None and self.arrival.stream and not load_stream(self.arrival.stream, folder):
            raise ConfigError(f"rollout.stream_order: arrival, but the checkpoint {folder} holds no stream of groups "
                              "(it was saved in plan order): resume with rollout.stream_order=plan, or start a new run")
        self.rollout_synced = self.rollout is self.hf_rollout  # push the resumed weights before generating
        return state

    def log_start(self, where: str) -> None:
        cfg, plan = self.cfg, self.plan
        log.info(f"ppo ({cfg.ppo.advantage_estimator}): {len(self.prompts)} prompts, {plan.total_steps} rollouts of "
                 f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.samples_per_prompt} samples, "
                 f"{plan.updates_per_step} optimizer step(s) per rollout, {where}, "
                 f"rewards: {', '.join(self.rewards.names)}")
        log.info(key_settings(cfg, ranks=plan.data_parallel_size, micro_batch_rows=plan.micro_batch_rows,
                              grad_accum_steps=plan.grad_accum_steps))

    # -- the loop's questions, answered by the roles --------------------------------------------
    @property
    def checkpointable(self) -> Checkpointable:
        return self  # save_checkpoint / load_checkpoint: the checkpoint of a PPO job

    def trained_weights(self):
        return self.roles.trained_weights()

    def optimizer_stats(self) -> dict[str, float | None]:
        return self.roles.optimizer_stats()

    def skipped_updates(self) -> None:
        return None  # each learner reports its engine's in the step's metrics

    def save_outputs(self, folder: str = "model", files: dict[str, str] | None = None) -> None:
        self.roles.save_model(folder, files)

    def close(self) -> None:
        if self.arrival is not None:
            self.arrival.close()
        self.roles.close()
        if self.agent is not None:
            self.agent.close()

    def send_policy_weights(self) -> dict[str, float] | None:
        return self.roles.push_weights(self.version)

    def greedy_rollout(self):
        """Evaluation generates with the trained module where this process holds it (and keeps it
        on the GPU), else with the rollout engine once it has the actor's weights -- so too for
        multi-turn evaluation where the ranks' trained modules generate in lockstep (ZeRO-3 over
        several ranks), which trajectories of different lengths cannot keep."""
        lockstep = self.agent is not None and getattr(self.hf_rollout, "synced_gpus", False)
        if self.hf_rollout is not None and "actor" not in self.roles.phases.sleepers and not lockstep:
            return self.hf_rollout
        if not self.rollout_synced:
            self.sync_rollout()
        self.ready_to_generate()
        return self.rollout

    def ready_to_generate(self) -> None:
        self.roles.phases.enter("generate")

    # -- one PPO step ---------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        """The PPO step, plus how long each role's workers were busy in it where the roles measure
        it (`timing/busy_<role>`, the mean over its ranks; `util/<role>_idle` in the log is
        1 - busy / step)."""
        self.roles.pop_busy()  # what evaluation used is not this step's
        self.version = step
        rollout, sampling_metrics = self.step_rollout(step)
        with self.run.timed("make_experience"):
            experience, stats = self.make_experience(rollout)
        with self.run.timed("train"):  # wall time of the updates (train_actor/critic may overlap)
            sums = self.train_roles(experience, step)
        self.version = step + 1
        self.await_ahead()
        with self.run.timed("weight_sync"):
            self.sync_rollout()
        for role, seconds in self.roles.pop_busy().items():
            self.run.add_timing(f"busy_{role}", seconds)
        loop = engine_loop(self.rollout)
        if loop is not None:  # the engine loop's (rank 0's, which logs): util/vllm_idle, how full it was kept
            load = loop.pop_load()
            self.run.add_timing("busy_vllm", load.busy_s)
            sampling_metrics["rollout/engine_rows"] = load.rows_per_step
            sampling_metrics["rollout/engine_steps"] = load.steps
            sampling_metrics["rollout/reprefilled_tokens"] = load.reprefilled
        return {**self.step_metrics(rollout, stats, sums), **self.sync_metrics, **sampling_metrics}

    def step_rollout(self, step: int) -> tuple[Rollout, dict[str, float]]:
        """The step's scored rollout: its prompts' groups, or with ppo.dynamic_sampling the step's
        quota of informative groups gathered over rounds (and what that took). With
        rollout.max_staleness k the step's planned batch (its first round) may have been generated up to
        k steps before (`rollout/staleness`: the updates it lags; refill rounds are generated now), and the
        next steps' batches are started here (`launch_ahead`) once this step's generations are in."""
        if self.arrival is not None:
            return self.arrival.rollout(step)
        n = self.cfg.rollout.samples_per_prompt
        self.relaunch_ahead()
        before = dict(self.ahead)
        kept = self.ahead.pop(step, None)
        try:
            launched = kept.rollout if kept is not None else self.launch_rollout(self.step_prompts(step),
                                                                                 self.sampling(step, n), step)
            if not self.cfg.ppo.dynamic_sampling:
                self.launch_ahead(step, launched)  # generated while this one is scored
                rollout, metrics = self.score_rollout(launched), {}
            else:
                first = self.score_rollout(launched)
                filled = fill_step(lambda r: first if r == 0 else self.rollout_step(self.step_prompts(step, r),
                                                                                     self.sampling(step, n, r), step),
                                   n=n, max_rounds=self.cfg.ppo.dynamic_sampling_max_rounds,
                                   missing_anywhere=lambda missing: int(all_reduce_sum([missing])[0]),
                                   what=self.cfg.ppo.dynamic_sampling_filter)
                with self.run.stoppable():  # a stop cuts an HF generation ahead short: the step is redone
                    self.launch_ahead(step, launched)  # after the refills: they need the engines first
                rollout, metrics = filled.rollout, filled.metrics(reduce=all_reduce_sum)
        except StepAbandoned:  # the step is redone on resume: its checkpoint keeps the rollouts it was given
            self.ahead = before
            raise
        if self.cfg.rollout.max_staleness:
            metrics.update(reduce_means(staleness_stats(rollout.generations, step, self.cfg.rollout.max_staleness)))
        return rollout, metrics

    def launch_ahead(self, step: int, launched: LaunchedRollout) -> None:
        """Launch the batches of the steps due ahead (`staleness.ahead_steps`), with the weights this step
        trains: at once on an engine loop (`streams`: the batches share its engine, a straggler of
        this step's beside the next one's), else once this step's batch (`launched`) is generated (an
        engine takes one batch at a time)."""
        n = self.cfg.rollout.samples_per_prompt
        targets = ahead_steps(step, self.plan.total_steps, self.cfg.rollout.max_staleness, self.ahead)
        if targets and not streams(self.rollout):
            with self.run.timed("generate"):
                launched.pending.result()
        for target in targets:
            self.ahead[target] = Ahead(target, self.launch_rollout(self.step_prompts(target), self.sampling(target, n),
                                                                   step))

    def suspend_ahead(self) -> dict[int, tuple[int, Any]]:
        """With rollout.partial on an engine loop, the batches ahead still under way as far as they got (they go
        on: a checkpoint need not wait for their tail): step -> (updates done at its launch, its state). Agent
        batches are not kept so: their environments' states cannot be (`save_ahead` waits for them)."""
        if not (self.cfg.rollout.partial and suspends(self.rollout)) or self.agent is not None:
            return {}
        going = {step: a.rollout for step, a in self.ahead.items() if a.rollout.pending.finished() is None}
        states = self.rollout.suspend([launched.pending for launched in going.values()]) if going else []
        return {step: (launched.version, state) for (step, launched), state in zip(going.items(), states)}

    def restore_ahead(self, folder: Path, rank: int) -> None:
        """The rollouts generated ahead that a checkpoint holds (`staleness.save_ahead`), if any; those it kept
        under way go on at the first step (`relaunch_ahead`)."""
        n = self.cfg.rollout.samples_per_prompt
        self.ahead, self.suspended = {}, {}
        for saved in load_ahead(folder, rank):
            if saved.generations is None:
                self.suspended[saved.step] = (saved.launched_at, saved.under_way)
                continue
            figures = None if saved.agent_batch is None else (lambda batch=saved.agent_batch: batch)
            self.ahead[saved.step] = Ahead(saved.step, LaunchedRollout(
                self.step_prompts(saved.step), self.sampling(saved.step, n), Done(saved.generations), figures,
                saved.launched_at))
        if self.suspended and not (self.cfg.rollout.partial and suspends(self.rollout)):
            raise ConfigError(f"rollout.partial: the checkpoint {folder} holds the batches of steps "
                              f"{sorted(s + 1 for s in self.suspended)} under way on an engine loop, to go on where "
                              "they stopped; resume with the settings that saved it (rollout.partial=true, "
                              "rollout.backend=vllm, rollout.max_staleness >= 1)")

    def relaunch_ahead(self) -> None:
        """The batches a checkpoint kept under way go on, once the engine holds the resumed weights: each sample
        from where it stopped, as it went on in the run that saved them."""
        if not self.suspended:
            return
        if not self.rollout_synced:
            self.sync_rollout()
        self.ready_to_generate()
        n = self.cfg.rollout.samples_per_prompt
        for step, (launched_at, state) in sorted(self.suspended.items()):
            self.ahead[step] = Ahead(step, LaunchedRollout(self.step_prompts(step), self.sampling(step, n),
                                                           self.rollout.relaunch(state), version=launched_at))
        self.suspended = {}

    def await_ahead(self) -> None:
        """Wait for the rollouts generated ahead (before new weights go into their engines; with
        rollout.partial the engine loop pauses them at the sync instead, and they go on) and log
        `timing/overlap`: the seconds the last one launched was generated while this step scored and trained."""
        if not self.ahead:
            if self.cfg.rollout.max_staleness:
                self.run.add_timing("overlap", self.arrival.overlap() if self.arrival is not None else 0.0)
            return
        waited = time.monotonic()
        if not self.cfg.rollout.partial:
            with self.run.timed("generate_ahead_wait"):
                for kept in self.ahead.values():
                    kept.rollout.pending.result()
        pending = self.ahead[max(self.ahead)].rollout.pending
        self.run.add_timing("overlap", max(0.0, min(pending.finished() or waited, waited) - pending.launched))

    def step_prompts(self, step: int, round: int = 0) -> list[Prompt]:
        """The step's prompts of the actor ranks this driver generates for, in rank order (`round`
        > 0: a dynamic-sampling refill, drawn from an order of its own)."""
        seed, n = refill_seed(self.cfg.seed, round), len(self.prompts)
        return [self.prompts[i] for rank in self.roles.prompt_ranks for i in self.plan.prompts_for_step(n, step, seed, rank)]

    @torch.no_grad()
    def make_experience(self, rollout: Rollout) -> tuple[ExperienceBatch, Stats]:
        """Old log-probs, reference log-probs, values, rewards and advantages of a rollout."""
        return self.experience_from(rollout, self.roles.score_tokens(rollout_batch(rollout, self.pad_id)))

    def experience_from(self, rollout: Rollout, scored: ExperienceBatch) -> tuple[ExperienceBatch, Stats]:
        """The maths of an experience: scores (normalised, clipped), the KL penalty, per-token
        rewards, advantages and returns, from the models' numbers for the rollout's tokens
        (`scored`: the rollout's batch with `old_logps`, and `ref_logps`, `values` where there are)."""
        cfg, ppo = self.cfg, self.cfg.ppo
        old, ref, values = (scored.tensors.get(k) for k in ("old_logps", "ref_logps", "values"))
        mask = scored.tensors["labels"] != IGNORE
        if values is not None:
            values = values * mask
        scores = rollout.scores.clone()
        turns = self.turn_rewards(rollout)  # agent.reward_placement turn: moved from the score to their turns
        if turns is not None:
            scores -= torch.tensor([sum(part) for _, part in turns], dtype=scores.dtype)
        if cfg.reward.running_norm:
            self.moments.update(scores, reduce=all_reduce_sum)
            scores = normalize_scores(scores, self.moments)
        scores = clip_rewards(scores, cfg.reward.clip)
        kl = kl_estimate(old, ref, ppo.kl_estimator, mask) if ref is not None else torch.zeros_like(old)
        kl_coef = self.kl_ctl.value if ppo.init_kl_coef > 0 else 0.0
        if ppo.estimator.sequence_level:
            # Sequence-level estimators: the KL penalty joins the score before the group baseline.
            scores = scores - kl_coef * masked_sum(kl, mask, dim=-1)
            rewards = shape_rewards(scores, torch.zeros_like(kl), mask, 0.0)
        else:
            rewards = shape_rewards(scores, kl, mask, kl_coef)
            if turns is not None:
                rewards = place_turn_rewards(rewards, *zip(*turns))
        advantages, returns = compute_advantages(
            ppo.advantage_estimator, rewards=rewards, mask=mask, scores=scores, values=values,
            group_size=cfg.rollout.samples_per_prompt, gamma=ppo.gamma, lam=ppo.lam,
            whiten=ppo.whiten_advantages, reduce=all_reduce_sum)
        rollout_logps = torch.zeros_like(old)
        for i, (g, r) in enumerate(zip(rollout.generations, rollout.responses)):
            start = len(r.sequence_ids) - len(g.response_ids)
            rollout_logps[i, start - 1 : start - 1 + len(g.logprobs)] = torch.tensor(g.logprobs)
        stats = self.rollout_stats(rollout)
        is_weights = None
        if ppo.tis_cap:
            is_weights, w = importance_weights(old, rollout_logps, mask, cap=ppo.tis_cap, floor=ppo.is_floor,
                                               mode=ppo.is_mode)
            tokens = float(w["tokens"])
            stats["rollout/is_weight"] = (float(w["weight_sum"]), tokens)
            stats["rollout/is_truncated"] = (float(w["truncated"]), tokens)
            if ppo.is_mode != "truncate":
                stats["rollout/is_masked"] = (float(w["masked"]), tokens)
            if ppo.is_mode == "seq_mask":
                stats["rollout/is_masked_seq"] = (float(w["masked_seqs"]), float(w["seqs"]))
        experience = scored.with_tensors(advantages=advantages, returns=returns, values=values,
                                         ref_logps=ref if ppo.kl_loss_coef > 0 else None, is_weights=is_weights)
        n = len(experience)
        stats["rollout/kl"] = (float(masked_sum(kl, mask)), n)
        stats["rollout/logprob_max_diff"] = (float(((rollout_logps - old).abs() * mask).amax(dim=-1).sum()), n)
        stats["rollout/advantage"] = (float(masked_sum(advantages, mask)), float(mask.sum()))
        if values is not None:
            stats["rollout/value"] = (float(masked_sum(values, mask)), float(mask.sum()))
            stats["rollout/return"] = (float(masked_sum(returns, mask)), float(mask.sum()))
        return experience, stats

    def turn_rewards(self, rollout: Rollout) -> list[tuple[list[int], list[float]]] | None:
        """With agent.reward_placement turn: each trajectory's turn rewards times the environment's
        weight, with the positions of the actions they follow (their turns' last model tokens, in the
        experience's per-token coordinates); else None."""
        agent = self.cfg.agent
        if agent is None or agent.reward_placement != "turn":
            return None
        weight = sum(s.weight for s in self.cfg.reward.sources if s.env)
        out = []
        for g, r in zip(rollout.generations, rollout.responses):
            record, start = g.episode, len(r.sequence_ids) - len(g.response_ids)
            out.append(([start - 1 + record.turn_ends[k] for k in record.reward_turns],
                        [weight * v for v in record.turn_rewards]))
        return out

    # -- updates ----------------------------------------------------------------------------
    def train_roles(self, experience: ExperienceBatch, step: int) -> Stats:
        """The trained roles' PPO epochs on the new experience (the actor waits out
        `ppo.freeze_actor_steps`), timed per role (`timing/train_<role>`: from the common start
        to the role's end, where roles train at once). The weight sync that follows may start
        as soon as the actor is done, unless the engines are generating the next rollout (batches ahead, or
        arrival order's groups: their sync names the version the engines then hold)."""
        roles = [r for r in self.roles.trained if not (r == "actor" and step < self.cfg.ppo.freeze_actor_steps)]
        push = self.rollout is not self.hf_rollout and not self.ahead and self.arrival is None
        sums, seconds = self.roles.learn(experience, step, roles, push=push)
        for role, s in seconds.items():
            self.run.add_timing(f"train_{role}", s)
        return sums

    def step_metrics(self, rollout: Rollout, stats: Stats, sums: Stats) -> dict[str, float]:
        """The step's means over ranks; updates the KL controller."""
        cfg = self.cfg
        metrics = reduce_means(stats) | reduce_means(sums, sum_divisor=self.plan.updates_per_step)
        self.kl_ctl.update(metrics.get("rollout/kl", 0.0), n_steps=cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt)
        metrics["train/kl_coef"] = self.kl_ctl.value
        metrics["train/loss"] = metrics.get("train/policy_loss", 0.0)
        metrics["train/tokens"], metrics["train/samples"] = all_reduce_sum([float(rollout.lengths.sum()),
                                                                            float(len(rollout.generations))])
        return metrics

