"""The roles interface the PPO driver (`trainers.ppo.driver.PPOTrainer`) runs its steps through, and its
single-machine implementation.

A PPO step needs its models for a handful of things only; `PPORoles` names them, and the driver
keeps everything else (prompts, rollout scheduling, rewards maths, advantages, the KL controller,
metrics, checkpoints' composite, evaluation):

    enter          a phase of the step (`trainers.ppo.phases`): who holds GPU memory, where roles sleep
    score_tokens   actor and reference log-probs and critic values of a rollout batch
    learn          the named trained roles' PPO epochs on an experience (seconds per role)
    push_weights   the actor's weights into the rollout engine
    save / load    the roles' part of a checkpoint
    pop_busy       each role's busy seconds since the last call (where the runtime measures it)
    optimizer_stats, trained_weights, save_model, close

Two implementations: `LocalRoles` (this module: every model in this process, one rank of a
torchrun group) and `trainers.ppo.ray.roles.RayRoles` (every role on its own Ray workers, placed by the
node map). Each builds its roles' models with `ppo_learner.build_role_model` and runs their halves
of a step with `ppo_learner`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

from hpcrlhf.trainers.ppo.experience import ExperienceBatch, ReplayBuffer
from hpcrlhf.trainers.online import push_weights, reward_set
from hpcrlhf.trainers.ppo.phases import PhaseSwitch
from hpcrlhf.trainers.batches import PPOPlan
from hpcrlhf.trainers.ppo.learner import PPOLearner, build_role_model, forward_logps, forward_values
from hpcrlhf.run.stats import Stats, add_stats, new_stats

if TYPE_CHECKING:
    from hpcrlhf.trainers.online import OnlineTrainer

TokenScores = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]
"""(actor log-probs, reference log-probs or None, critic values or None) of a rollout batch."""


def role_plan(trainer: OnlineTrainer, data_parallel_size: int) -> PPOPlan:
    """The batch plan of a trained role with `data_parallel_size` ranks in `trainer`'s PPO job."""
    cfg = trainer.cfg
    return PPOPlan.build(cfg.train, prompts_per_step=cfg.rollout.prompts_per_step,
                         samples_per_prompt=cfg.rollout.samples_per_prompt, ppo_epochs=cfg.ppo.epochs,
                         num_prompts=len(trainer.prompts), data_parallel_size=data_parallel_size)


class PPORoles(Protocol):
    """The models of a PPO job, wherever they run. Built by the driver as `roles(trainer)` once
    its prompts are loaded."""

    plan: PPOPlan
    """The actor's batch plan: its data-parallel ranks, steps, mini-batches."""
    prompt_ranks: Sequence[int]
    """The actor ranks whose prompts this driver generates for (its own rank, or all of them)."""
    trained: tuple[str, ...]
    """The trained roles, actor first."""
    rollout: Any
    """The engine that generates rollouts (`engines.rollout` protocol)."""
    hf_rollout: Any
    """The trained actor module as a generator (always in sync), or None where it runs elsewhere."""
    rewards: Any
    """The reward sources (`RewardSet` protocol: names, score)."""
    where: str
    """Where the roles run, for the start log line."""
    phases: PhaseSwitch
    """Who sleeps between phases, and the phase now; the roles enter `train` to score, train, save
    and load, `weight_sync` to push weights; the driver enters `generate` to generate."""

    def score_tokens(self, batch: dict[str, torch.Tensor]) -> TokenScores: ...

    def learn(self, experience: ExperienceBatch, step: int, roles: Sequence[str],
              push: bool = False) -> tuple[Stats, dict[str, float]]:
        """`roles`' PPO epochs on `experience`: their metric sums and each role's seconds. `push`:
        `push_weights` comes next and the engines have nothing else to do; the runtime may start
        it as soon as the actor has learned."""

    def push_weights(self) -> dict[str, float] | None:
        """The actor's weights into `rollout` (or the rest of a push `learn` started); what was
        sent (`weight_sync/*`) where measured."""

    def save(self, folder: Path, state: dict[str, Any]) -> None:
        """The roles' checkpoint into `folder`, with the driver's `state` (step, controllers)."""

    def load(self, folder: Path) -> dict[str, Any]:
        """The roles' checkpoint from `folder`; the driver's state saved with it."""

    def pop_busy(self) -> dict[str, float]: ...

    def optimizer_stats(self) -> dict[str, float | None]: ...

    def trained_weights(self) -> Any: ...

    def save_model(self) -> None: ...

    def close(self) -> None: ...


class LocalRoles:
    """Every role of a PPO job in this process: the actor and critic DeepSpeed engines, the frozen
    reference, the reward sources and the rollout engine (HF generate with the actor module, or
    vLLM on rank 0 for every rank). Under torchrun, each rank's driver holds one rank of each."""

    def __init__(self, trainer: OnlineTrainer) -> None:
        t = self.t = trainer
        cfg, ppo = t.cfg, t.cfg.ppo
        self.plan = role_plan(t, t.env.world_size)
        self.prompt_ranks = (t.env.rank,)
        self.engine = build_role_model(t.models, cfg, "actor", self.plan)
        self.critic = build_role_model(t.models, cfg, "critic", self.plan) if ppo.uses_critic else None
        self.reference = build_role_model(t.models, cfg, "ref", self.plan) if ppo.uses_reference else None
        self.rewards = reward_set(cfg, t.models, t.task)
        self.rollout, self.hf_rollout = t.rollout_engines(self.engine)
        self.buffer = ReplayBuffer(ppo.buffer_limit)
        self.learners = {role: PPOLearner(role, engine, cfg, self.plan, t.pad_id, self.buffer)
                         for role, engine in (("actor", self.engine), ("critic", self.critic)) if engine is not None}
        self.trained = tuple(self.learners)
        self.phases = PhaseSwitch.for_job(cfg, self.trained, self.rollout,
                                          lambda role, verb: getattr(self.learners[role].engine, verb)(),
                                          lambda: t.run.timed("swap"))
        self.where = (f"{t.env.world_size} rank(s), ZeRO-{cfg.engine.zero_stage}, {cfg.engine.precision} on {t.device}, "
                      f"rollout backend {cfg.rollout.backend}")

    def score_tokens(self, batch: dict[str, torch.Tensor]) -> TokenScores:
        self.phases.enter("train")
        chunk, device = self.t.cfg.eval.batch_size, self.t.device
        self.engine.eval()
        old = forward_logps(self.engine, batch, chunk, device)
        ref = forward_logps(self.reference, batch, chunk, device) if self.reference is not None else None
        values = None
        if self.critic is not None:
            self.critic.eval()
            values = forward_values(self.critic, batch, chunk, device)
        return old, ref, values

    def learn(self, experience: ExperienceBatch, step: int, roles: Sequence[str],
              push: bool = False) -> tuple[Stats, dict[str, float]]:
        """One after the other, both drawing the same mini-batches from one buffer (the push
        waits for `push_weights`: this process does it)."""
        self.phases.enter("train")
        self.buffer.add(experience.rows())
        sums: Stats = new_stats()
        seconds = {}
        for role in roles:
            start = time.perf_counter()
            add_stats(sums, self.learners[role].update(step, self.t.env.rank))
            seconds[role] = time.perf_counter() - start
        return sums, seconds

    def push_weights(self) -> dict[str, float] | None:
        self.phases.enter("weight_sync")
        return push_weights(self.engine, self.rollout, self.t.cfg)

    def save(self, folder: Path, state: dict[str, Any]) -> None:
        self.phases.enter("train")
        self.engine.save_checkpoint(folder, state)
        if self.critic is not None:
            self.critic.save_checkpoint(folder / "critic", {"step": state["step"]})
        self.buffer.save(folder, self.t.env.rank)

    def load(self, folder: Path) -> dict[str, Any]:
        self.phases.enter("train")
        state = self.engine.load_checkpoint(folder)
        if self.critic is not None:
            self.critic.load_checkpoint(folder / "critic")
        self.buffer.load(folder, self.t.env.rank)
        return state

    def pop_busy(self) -> dict[str, float]:
        return {}  # every role shares this process: its busy time is the step's

    def optimizer_stats(self) -> dict[str, float | None]:
        return self.engine.optimizer_stats()

    def trained_weights(self):
        return None if self.engine.zero_stage == 3 else self.engine.module.named_parameters()

    def save_model(self) -> None:
        self.phases.enter("train")
        self.t.models.export(self.engine, value_head=False)

    def close(self) -> None:
        return None
