"""The PPO driver's side of arrival order (rollout.stream_order: arrival; the rule and its bookkeeping are
`trainers.ppo.stream`): which engine the groups run on, how a step takes and scores them, and with several local
ranks how they reach each rank.

- One local rank: the stream drives this process's engine loop (`StreamingRollout`); with an agent section a
  group is its prompt's trajectories (`AgentRunner.launch`, their turns on the loop), stopped when dropped, and a
  checkpoint waits for those under way.
- Ray: the driver's stream sends each group to the engine actor with the fewest under way (`EngineFleet`); with an
  agent section a group is its prompt's trajectories run in that actor beside its engine, stopped there when
  dropped (`EngineFleet.cancel`), and a checkpoint waits for those under way.
- Several local ranks: rank 0 holds the stream on its engine loop and takes the step's groups for every rank as
  they end -- the first `prompts_per_rank` for rank 0, the next for rank 1, ... -- and sends each rank its share
  as it fills (`Rank0Batch`, one meeting per lot; a group travels with its key, from which each rank knows its
  prompt). The other ranks hold no stream; rank 0's checkpoint holds it. With ppo.dynamic_sampling every rank takes
  part in each round while any misses groups, and rank 0 records the groups every rank used (`_slots`). With an
  agent section a group is its prompt's trajectories on rank 0's loop (their environments in rank 0's process),
  sent to their rank with their episodes; rank 0 logs the scheduling figures of every rank's groups.

A group (t, i) is prompt i of step t's prompts of every prompt rank in rank order, sampled with the seed the plan
gives step t's batch (rank 0's, as `Rank0Rollout.launch` and the Ray driver sample it) at its place i: a group
draws the tokens its plan-order batch would, whichever step trains it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from hpcrlhf.agents.metrics import batch_stats
from hpcrlhf.agents.runner import EpisodeBatch
from hpcrlhf.agents.scheduler import added
from hpcrlhf.cluster.engines import EngineFleet
from hpcrlhf.engines.distributed import all_reduce_sum, gather_objects
from hpcrlhf.engines.rollout import Generation
from hpcrlhf.engines.rollout.contract import Groups
from hpcrlhf.engines.rollout.loop import LOOP_PARTY, StreamingRollout, suspends
from hpcrlhf.engines.rollout.shared import Rank0Batch, Rank0Rollout
from hpcrlhf.errors import ConfigError
from hpcrlhf.run.folder import StepAbandoned
from hpcrlhf.run.stats import Stats, reduce_means
from hpcrlhf.trainers.online import LaunchedRollout, Rollout
from hpcrlhf.trainers.ppo.dynamic_sampling import fill_step
from hpcrlhf.trainers.ppo.staleness import staleness_stats
from hpcrlhf.trainers.ppo.stream import Ledger, RolloutStream, StreamTake
from hpcrlhf.trainers.seeds import sampling_seed


class RankShare:
    """This rank's groups of a step taken on rank 0 (a `Pending`): `Rank0Batch` brings them as (key, generations)
    lots; each key gives its prompt (`prompt_of`), `prompts` filling as they come."""

    def __init__(self, batch: Rank0Batch, prompt_of: Callable[[tuple[int, int]], Any]) -> None:
        self.batch, self.prompt_of = batch, prompt_of
        self.launched = batch.launched
        self.prompts: list[Any] = []

    def _unkeyed(self, groups: list) -> Groups:
        out = []
        for slot, (key, generations) in groups:
            while len(self.prompts) <= slot:
                self.prompts.append(None)
            self.prompts[slot] = self.prompt_of(key)
            out.append((slot, generations))
        return out

    def as_finished(self) -> Iterator[Groups]:
        for groups in self.batch.as_finished():
            yield self._unkeyed(groups)

    def result(self) -> list[list[Generation]]:
        return [generations for _, generations in self._unkeyed(list(enumerate(self.batch.result())))]

    def finished(self) -> float | None:
        return self.batch.finished()


def cancel_episodes(batches: Sequence[EpisodeBatch]) -> None:
    """Stop groups' trajectories under way (too old to train; or the run ended)."""
    for batch in batches:
        batch.cancel()


class ArrivalRollouts:
    """Arrival order for a `PPOTrainer` (module docstring): `rollout(step)` is the step's scored rollout and its
    stream metrics; the stream (`stream`: rank 0's, None elsewhere) goes into checkpoints."""

    def __init__(self, trainer) -> None:
        self.trainer = t = trainer
        cfg, engine = t.cfg, t.rollout
        shared = isinstance(engine, Rank0Rollout) and engine.streaming
        loop = engine.engine if shared else engine
        if not (isinstance(loop, StreamingRollout) or shared or isinstance(engine, EngineFleet) and engine.streaming):
            raise ConfigError(f"rollout.stream_order: arrival takes each step's groups as the engine loops end them: "
                              f"it runs with rollout.backend vllm on the local runtime (one rank or several) or on "
                              f"Ray (here: {t.env.world_size} local rank(s), runtime {cfg.placement.runtime}, backend "
                              f"{cfg.rollout.backend}); use rollout.stream_order=plan, or those settings")
        self.shared = shared
        self.ranks = range(t.env.world_size) if shared else t.roles.prompt_ranks
        """The prompt ranks whose prompts make a step's groups, in rank order."""
        self.per_rank = t.plan.prompts_per_rank
        self._planned: dict[int, list] = {}
        self._episodes: dict[tuple[int, int], EpisodeBatch] = {}
        """(agent section) Each group's trajectories under way or not yet taken, for their scheduling figures."""
        self.stream: RolloutStream | None = None
        if t.env.is_main or not shared:
            per_step = self.per_rank * len(self.ranks)
            # trajectories under way are waited for by a checkpoint (an environment's state cannot be kept)
            keeps = cfg.rollout.partial and suspends(engine) and t.agent is None
            ledger = Ledger(per_step, None if cfg.ppo.dynamic_sampling else t.plan.total_steps * per_step)
            cancel = cancel_episodes if t.agent is not None and isinstance(loop, StreamingRollout) else loop.cancel
            self.stream = RolloutStream(ledger, cfg.rollout.max_staleness, self._launch, cancel,
                                        loop.suspend if keeps else None, loop.relaunch if keeps else None,
                                        parties=(lambda: ["the vLLM engine actors"]) if isinstance(loop, EngineFleet)
                                        else lambda: [LOOP_PARTY], keep_stale=cfg.rollout.stale_groups == "keep")
            self.engine = loop
        """Rank 0's (or the only) stream of groups; None on the other local ranks."""

    # -- groups ---------------------------------------------------------------------------------
    def prompt_of(self, key: tuple[int, int]) -> Any:
        """Group (t, i)'s prompt: prompt i of step t's prompts of every prompt rank, in rank order."""
        t, i = key
        if t not in self._planned:
            tr = self.trainer
            self._planned = {t: [tr.prompts[j] for rank in self.ranks
                                 for j in tr.plan.prompts_for_step(len(tr.prompts), t, tr.cfg.seed, rank)]}
        return self._planned[t][i]

    def _launch(self, t: int, i: int, version: int) -> tuple[Any, Any]:
        """Start group (t, i) on the engine: (its prompt, its `Pending`)."""
        tr, rollout = self.trainer, self.trainer.cfg.rollout
        prompt = self.prompt_of((t, i))
        params = tr.with_lengths([prompt], replace(tr.sampling(t, rollout.samples_per_prompt), first_index=i,
                                                   seed=sampling_seed(tr.cfg.seed, t, 0, 0)))
        with tr.run.timed("generate"):
            if tr.agent is None:
                return prompt, self.engine.launch([list(prompt.ids)], params)
            batch, _ = tr._launch_episodes(self.engine, [prompt], params)  # the group's trajectories
            self._episodes[t, i] = batch
            return prompt, batch

    def _figures(self, take: StreamTake | None) -> Stats:
        """(agent section) The scheduling figures of a round's groups (after they ended; each group's once): rank 0's
        are every rank's groups' (their trajectories all ran there), the other ranks' none, each counting its own
        trajectories -- so that the ranks' figures add up to each trajectory once."""
        stats = [self._episodes.pop(g.key).stats() for g in take.groups if g.key in self._episodes] if take else []
        return batch_stats(added(stats), self._own_trajectories(take))

    def _own_trajectories(self, take: StreamTake | None) -> int:
        """How many trajectories of a round this rank trains: its share of rank 0's take with several local ranks
        (`take` None on the other ranks), else the whole take."""
        groups = self.per_rank if self.shared else len(take.groups)  # type: ignore[union-attr]
        return groups * self.trainer.cfg.rollout.samples_per_prompt

    # -- a step ---------------------------------------------------------------------------------
    def rollout(self, step: int) -> tuple[Rollout, dict[str, float]]:
        """The step's scored rollout: the first groups that end (too old ones dropped and requeued first, as many
        started as the rule lets); with ppo.dynamic_sampling each round takes the next that end (one more started
        for each taken beyond the step's quota) and those left out are discarded."""
        tr, stream, cfg = self.trainer, self.stream, self.trainer.cfg
        if not tr.rollout_synced:
            tr.sync_rollout()
        tr.ready_to_generate()
        if stream is not None:
            stream.drop_stale(step)
        takes: list = []
        params = tr.sampling(step, cfg.rollout.samples_per_prompt)

        def take_round(round: int) -> Rollout:
            pending, figures = None, None
            if stream is not None:
                quota = stream.ledger.per_step
                stream.admit(tr.version, beyond=max(0, len(takes) - 1) * quota)  # the step trains `quota` of them
                takes.append(stream.take(quota, keyed=self.shared))
                pending = takes[-1]
            if tr.agent is not None:
                figures = partial(self._figures, pending)
            if self.shared:
                pending = RankShare(Rank0Batch(pending, [self.per_rank] * len(self.ranks), tr.rollout),
                                    self.prompt_of)
            return tr.score_rollout(LaunchedRollout(pending.prompts, params, pending, figures))

        try:
            if not cfg.ppo.dynamic_sampling:
                rollout, metrics, used = take_round(0), {}, None
            else:  # every rank goes on while any misses groups (a round's scoring is collective)
                filled = fill_step(take_round, n=cfg.rollout.samples_per_prompt,
                                   max_rounds=cfg.ppo.dynamic_sampling_max_rounds, what=cfg.ppo.dynamic_sampling_filter,
                                   missing_anywhere=lambda missing: int(all_reduce_sum([missing])[0]))
                rollout, metrics, used = filled.rollout, filled.metrics(), self._slots(filled.picks)
        except StepAbandoned:  # the step is redone on resume: its groups wait in the checkpoint's pool
            if stream is not None:
                stream.untake(takes)
            raise
        if stream is not None:
            metrics.update(stream.commit(takes, step, used))
        return rollout, {**metrics, **reduce_means(staleness_stats(rollout.generations, step,
                                                                   cfg.rollout.max_staleness))}

    def _slots(self, picks: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The groups the step trains as (round, slot in rank 0's take): this rank's (round, group) picks; with
        several local ranks every rank's, gathered -- rank r's share of a take is slots r x G_r onwards."""
        if not self.shared:
            return picks
        return [(r, rank * self.per_rank + g) for rank, part in enumerate(gather_objects(picks)) for r, g in part]

    def overlap(self) -> float:
        return self.stream.overlap() if self.stream is not None else 0.0

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
