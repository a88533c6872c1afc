"""The roles interface the PPO driver (`trainers.ppo.driver.PPOTrainer`) runs its steps through, and its
single-machine implementation.

A PPO step needs its models for a handful of things only; `PPORoles` names them, and the driver
keeps everything else (prompts, rollout scheduling, rewards maths, advantages, the KL controller,
metrics, checkpoints' composite, evaluation):

    score_tokens   actor and reference log-probs and critic values of a rollout batch
    learn          the named trained roles' PPO epochs on an experience (seconds per role)
    push_weights   the actor's weights into the rollout engine
    save / load    the roles' part of a checkpoint
    pop_busy       each role's busy seconds since the last call (where the runtime measures it)
    optimizer_stats, trained_weights, save_model, close

Each method enters the phase it needs (`trainers.ppo.phases`: who holds GPU memory, where roles
sleep). The roles get what they need from the driver once, as a `RoleContext`, and never read its
fields; one batch shape crosses between them (`experience.ExperienceBatch`).

Two implementations: `LocalRoles` (this module: every model in this process, one rank of a
torchrun group) and `trainers.ppo.ray.roles.RayRoles` (every role on its own Ray workers, placed by
the node map). Each builds its roles' models with `learner.build_role_model` and runs their halves
of a step with `learner`.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from collections.abc import Callable, Sequence

from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.models.factory import ModelFactory
from hpcrlhf.run.stats import Stats, add_stats, new_stats
from hpcrlhf.trainers.batches import PPOPlan
from hpcrlhf.trainers.online import reward_set, rollout_engines, stream_weights
from hpcrlhf.trainers.ppo.experience import ExperienceBatch, ReplayBuffer
from hpcrlhf.trainers.ppo.learner import PPOLearner, build_role_model, token_scores
from hpcrlhf.trainers.ppo.phases import PhaseSwitch


@dataclass(frozen=True)
class RoleContext:
    """What the roles take from the driver, once, when they are built."""

    cfg: PPOConfig
    models: ModelFactory
    """This process's rank, tokenizer and pad id, device; builds the models."""
    task: Any
    """The bundled task the `task` reward rule scores against (None without one)."""
    num_prompts: int
    """Training prompts: the length of an epoch in the roles' batch plans."""
    run_dir: Path
    """The run folder (the Ray roles record where their workers run: placement.json)."""
    timed: Callable[[str], AbstractContextManager]
    """The driver's timer: `with timed(name)` adds to the step's `timing/<name>`."""

    def role_plan(self, data_parallel_size: int) -> PPOPlan:
        """The batch plan of a trained role with `data_parallel_size` ranks."""
        cfg = self.cfg
        return PPOPlan.build(cfg.train, prompts_per_step=cfg.rollout.prompts_per_step,
                             samples_per_prompt=cfg.rollout.samples_per_prompt, ppo_epochs=cfg.ppo.epochs,
                             num_prompts=self.num_prompts, data_parallel_size=data_parallel_size)


class PPORoles(Protocol):
    """The models of a PPO job, wherever they run. Built by the driver as `roles(context)` once
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

    def score_tokens(self, batch: ExperienceBatch) -> ExperienceBatch:
        """The rollout batch (forward inputs) with the roles' numbers for its tokens: `old_logps`
        (actor), `ref_logps` (reference, where there is one), `values` (critic, where there is one)."""

    def learn(self, experience: ExperienceBatch, step: int, roles: Sequence[str],
              push: bool = False) -> tuple[Stats, dict[str, float]]:
        """`roles`' PPO epochs on `experience`: their metric sums and each role's seconds. `push`:
        `push_weights` comes next and the engines have nothing else to do; the runtime may start
        it as soon as the actor has learned."""

    def push_weights(self, version: int) -> dict[str, float] | None:
        """The actor's weights -- policy `version`, the updates done -- into `rollout` (or the rest of a
        push `learn` started); what was sent (`weight_sync/*`) where measured."""

    def save(self, folder: Path, state: dict[str, Any]) -> None:
        """The roles' checkpoint into `folder`, with the driver's `state` (step, controllers)."""

    def load(self, folder: Path) -> dict[str, Any]:
        """The roles' checkpoint from `folder`; the driver's state saved with it."""

    def pop_busy(self) -> dict[str, float]: ...

    def optimizer_stats(self) -> dict[str, float | None]: ...

    def trained_weights(self) -> Any: ...

    def save_model(self, folder: str = "model", files: dict[str, str] | None = None) -> None: ...

    def close(self) -> None: ...


class LocalRoles:
    """Every role of a PPO job in this process: the actor and critic DeepSpeed engines, the frozen
    reference, the reward sources and the rollout engine (HF generate with the actor module, or
    vLLM on rank 0 for every rank). Under torchrun, each rank's driver holds one rank of each."""

    def __init__(self, ctx: RoleContext) -> None:
        cfg, ppo, models = ctx.cfg, ctx.cfg.ppo, ctx.models
        self.cfg, self.models, self.rank = cfg, models, models.env.rank
        self.plan = ctx.role_plan(models.env.world_size)
        self.prompt_ranks = (self.rank,)
        self.engine = build_role_model(models, cfg, "actor", self.plan)
        self.critic = build_role_model(models, cfg, "critic", self.plan) if ppo.uses_critic else None
        self.reference = build_role_model(models, cfg, "ref", self.plan) if ppo.uses_reference else None
        self.rewards = reward_set(cfg, models, ctx.task)
        self.rollout, self.hf_rollout = rollout_engines(self.engine, models, cfg)
        self.buffer = ReplayBuffer(ppo.buffer_limit)
        self.learners = {role: PPOLearner(role, engine, cfg, self.plan, models.pad_id, self.buffer)
                         for role, engine in (("actor", self.engine), ("critic", self.critic)) if engine is not None}
        self.trained = tuple(self.learners)
        self.phases = PhaseSwitch.for_job(cfg, self.trained, self.rollout,
                                          lambda role, verb: getattr(self.learners[role].engine, verb)(),
                                          lambda: ctx.timed("swap"))
        self.where = (f"{models.env.world_size} rank(s), ZeRO-{cfg.engine.zero_stage}, {cfg.engine.precision} on "
                      f"{models.device}, rollout backend {cfg.rollout.backend}")

    def score_tokens(self, batch: ExperienceBatch) -> ExperienceBatch:
        self.phases.enter("train")
        chunk, device = self.cfg.eval.batch_size, self.models.device
        self.engine.eval()
        scores = [token_scores("actor", self.engine, batch, chunk, device)]
        if self.reference is not None:
            scores.append(token_scores("ref", self.reference, batch, chunk, device))
        if self.critic is not None:
            self.critic.eval()
            scores.append(token_scores("critic", self.critic, batch, chunk, device))
        return batch.with_tensors(**{k: v for part in scores for k, v in part.tensors.items()})

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
            add_stats(sums, self.learners[role].update(step, self.rank))
            seconds[role] = time.perf_counter() - start
        return sums, seconds

    def push_weights(self, version: int) -> dict[str, float] | None:
        self.phases.enter("weight_sync")
        return stream_weights(self.engine, self.rollout, self.cfg.placement.vllm.sync_bucket_mb << 20, version)

    def save(self, folder: Path, state: dict[str, Any]) -> None:
        self.phases.enter("train")
        self.engine.save_checkpoint(folder, state)
        if self.critic is not None:
            self.critic.save_checkpoint(folder / "critic", {"step": state["step"]})
        self.buffer.save(folder, self.rank)

    def load(self, folder: Path) -> dict[str, Any]:
        self.phases.enter("train")
        state = self.engine.load_checkpoint(folder)
        if self.critic is not None:
            self.critic.load_checkpoint(folder / "critic")
        self.buffer.load(folder, self.rank)
        return state

    def pop_busy(self) -> dict[str, float]:
        return {}  # every role shares this process: its busy time is the step's

    def optimizer_stats(self) -> dict[str, float | None]:
        return self.engine.optimizer_stats()

    def trained_weights(self):
        return None if self.engine.zero_stage == 3 else self.engine.module.named_parameters()

    def save_model(self, folder: str = "model", files: dict[str, str] | None = None) -> None:
        self.phases.enter("train")
        self.models.export(self.engine, value_head=False, files=files, folder=folder)

    def close(self) -> None:
        """Stop an engine loop (its thread may be generating batches ahead) and close the engine. A plain vLLM
        engine is closed here too, not left to vLLM's exit hook: that one dies on a process that ended while it
        walked the engine's tree (psutil.NoSuchProcess, a traceback at the end of a run stopped by a signal);
        `engines.rollout.vllm.shut_down` finishes the walk."""
        self.rollout.close()
