"""PPO's model roles as Ray actors, one actor per rank, each on its device of the node map.

A rank builds its model exactly as the single-machine trainer does (`ModelFactory.build_trained_model`
/ `build_frozen_model`, with its role's ZeRO settings from the map) and runs the same per-role
code (`trainers.ppo.learner`): the only difference is that its process group holds its role's
ranks alone. The driver (`trainers.ppo.ray.roles`) sends each rank its row shard of one batch
(`ExperienceBatch`) and joins their answers.

Weight sync (`placement.vllm.weight_sync`): by default actor rank 0 broadcasts the weights to
every engine worker in a process group made for it (`hpcrlhf.engines.weight_sync`), every actor
rank walking the state dict chunk by chunk (ZeRO-3 gathers); as a fallback rank 0 gathers the
full state dict, puts it in Ray's object store once and every engine loads it from there.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import ray

from hpcrlhf.cluster.worker_group import RoleWorker, busy, gather
from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.data.batching import RowList
from hpcrlhf.data.tasks import build_task
from hpcrlhf.engines import weight_sync
from hpcrlhf.models.export import checkpoint_names, checkpoint_stream
from hpcrlhf.models.factory import ModelFactory
from hpcrlhf.run.stats import Stats
from hpcrlhf.trainers.batches import PPOPlan
from hpcrlhf.trainers.online import reward_set
from hpcrlhf.trainers.ppo.experience import ExperienceBatch, ReplayBuffer
from hpcrlhf.trainers.ppo.learner import PPOLearner, build_role_model, token_scores


class PPOWorker(RoleWorker):
    """One rank of a PPO model role. `setup()` (after the role's process group is joined) builds
    its model; the role's methods then serve the driver."""

    def __init__(self, role: str, rank: int, world_size: int, cfg: PPOConfig, plan: PPOPlan) -> None:
        super().__init__(role, rank, world_size)
        self.cfg, self.plan = cfg, plan

    def setup(self, served: dict[int, tuple[list[str], str]] | None = None) -> None:
        """Build the role's model(s); `served`: the sources the job's own reward servers serve (their
        URLs and token), for the reward role."""
        self.models = ModelFactory(self.cfg)  # the driver owns the run folder, metrics and progress
        self.served = served
        self.build()

    def build(self) -> None:
        raise NotImplementedError

    def scoring_model(self):
        """The model whose numbers `token_scores` returns, ready for a forward pass."""
        raise NotImplementedError

    @busy
    def token_scores(self, batch: ExperienceBatch) -> ExperienceBatch:
        """This rank's row shard of a rollout batch -> the role's numbers for its tokens
        (`learner.token_scores`: log-probs for the actor and reference, values for the critic)."""
        return token_scores(self.role, self.scoring_model(), batch, self.cfg.eval.batch_size, self.models.device)


class TrainedWorker(PPOWorker):
    """A rank of a trained role (actor, critic): its engine, replay buffer and PPO updates."""

    def build(self) -> None:
        cfg, plan = self.cfg, self.plan
        self.engine = build_role_model(self.models, cfg, self.role, plan)
        self.buffer = ReplayBuffer(cfg.ppo.buffer_limit)
        self.learner = PPOLearner(self.role, self.engine, cfg, plan, self.models.pad_id, self.buffer)

    def scoring_model(self):
        self.engine.eval()
        return self.engine

    @busy
    def update(self, experience: ExperienceBatch, step: int) -> Stats:
        """This rank's share of a rollout's experience -> its learner's PPO epochs on it; returns
        metric sums."""
        self.buffer.add(experience.rows())
        return self.learner.update(step, self.rank)

    @busy
    def sleep(self) -> None:
        """The engine's states to CPU memory while vLLM generates (placement.<role>.sleep)."""
        self.engine.sleep()

    @busy
    def wake(self) -> None:
        self.engine.wake()

    def save_checkpoint(self, folder: str, client_state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(Path(folder), client_state)
        self.buffer.save(Path(folder), self.rank)

    def load_checkpoint(self, folder: str) -> dict[str, Any]:
        state = self.engine.load_checkpoint(Path(folder))
        self.buffer.load(Path(folder), self.rank)
        return state


class ActorWorker(TrainedWorker):
    @busy
    def put_weights(self, engines: Sequence[Any], version: int | None = None) -> None:
        """The actor's full weights -- policy `version` -- into every vLLM engine through Ray's object store
        (the `placement.vllm.weight_sync=object_store` path; all actor ranks call: ZeRO-3 gathers)."""
        state = self.engine.full_state_dict()
        if self.rank == 0:
            state = checkpoint_names(self.engine.module, state)
            ref = ray.put({k: v.detach().cpu() for k, v in state.items()})
            gather([engine.load_weights.remote(ref, version) for engine in engines])

    def serve_weight_group(self):
        """Rank 0: a store for a new weight-sync group, on this node's address; its rendezvous (for
        the group's members only); `open_weight_group` next."""
        self._weight_store, at = weight_sync.serve_store(self.node_ip())
        return at

    def open_weight_group(self, spec) -> str:
        """Rank 0 joins the group `spec` as its rank 0 (returns when every engine worker has joined):
        the backend the members chose."""
        group = weight_sync.join(spec, 0, self._weight_store)
        self._weight_sender = weight_sync.WeightSender(group, self.cfg.placement.vllm.sync_bucket_mb << 20)
        return group.backend

    @busy
    def broadcast_weights(self) -> dict[str, float] | None:
        """The actor's weights to the group's engine workers (all actor ranks call: ZeRO-3 gathers
        chunk by chunk); rank 0 returns what it sent."""
        tensors = checkpoint_stream(self.engine, self.cfg.placement.vllm.sync_bucket_mb << 20)
        if self.rank != 0:
            for _ in tensors:
                pass
            return None
        try:
            stats = self._weight_sender.send(tensors)
        except Exception:
            # an engine worker is gone mid-broadcast: close the group so that the others stop waiting
            # in it (their receive fails at once instead of at the group's timeout), and walk the rest
            # of the state dict, whose ZeRO-3 gathers the other actor ranks are in
            self._weight_sender = None
            for _ in tensors:
                pass
            raise
        return dataclasses.asdict(stats)

    def optimizer_stats(self) -> dict[str, float | None]:
        return self.engine.optimizer_stats()

    def save_model(self, folder: str = "model", files: dict[str, str] | None = None) -> None:
        """The trained policy as a Hugging Face folder in `folder` (`model/`, `best/`) of the run, with
        `files` beside it (all ranks call)."""
        self.models.export(self.engine, value_head=False, files=files, folder=folder)


class CriticWorker(TrainedWorker):
    pass


class ReferenceWorker(PPOWorker):
    def build(self) -> None:
        self.model = build_role_model(self.models, self.cfg, "ref", self.plan)

    def scoring_model(self):
        return self.model


class RewardWorker(PPOWorker):
    """The reward sources (every reward model and rule) on one rank."""

    def build(self) -> None:
        self.rewards = reward_set(self.cfg, self.models, build_task(self.cfg.task, self.cfg.data), self.served)

    def names(self) -> list[str]:
        return list(self.rewards.names)

    @busy
    def score(self, responses: RowList) -> ExperienceBatch:
        """This rank's share of the responses -> their scores (`score`) and each source's values
        (`reward/<name>`), (B,) rows."""
        total, parts = self.rewards.score(responses)
        return ExperienceBatch({"score": total, **{f"reward/{name}": v for name, v in parts.items()}},
                               [len(r.sequence_ids) for r in responses])


ROLE_WORKERS: dict[str, type[PPOWorker]] = {"actor": ActorWorker, "critic": CriticWorker, "ref": ReferenceWorker,
                                            "reward": RewardWorker}


def role_config(cfg: PPOConfig, zero_stage: int, offload_optimizer: bool, offload_params: bool, role: str):
    """The job config as one role's ranks run it: the role's effective DeepSpeed settings (from
    the node map) in `engine` (and `reference.offload` for the reference)."""
    engine = dataclasses.replace(cfg.engine, zero_stage=zero_stage, offload_optimizer=offload_optimizer,
                                 offload_params=offload_params if role in ("actor", "critic") else False)
    out = dataclasses.replace(cfg, engine=engine)
    if role == "ref":
        out = dataclasses.replace(out, reference=dataclasses.replace(cfg.reference, offload=offload_params))
    return out
