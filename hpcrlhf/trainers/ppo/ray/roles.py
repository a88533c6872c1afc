"""PPO's roles on Ray: every role on its own workers, placed by the static node map.

The driver is `PPOTrainer` itself (same loop, same step, same maths, same checkpoints); `RayRoles`
is its roles interface (`trainers.ppo.roles.PPORoles`) on Ray workers:

    rollout         the vLLM engine actors (`EngineFleet`), prompts split over engines
    rewards         the rules here; reward models on the reward role's workers; the sources the
                    job's own reward servers serve (`cluster.reward_servers`) asked over HTTP by
                    whichever of the two scores
    score_tokens    actor / reference log-probs and critic values, all roles at once, each
                    role's ranks on equal row shards
    learn           actor and critic updates at once, rank r on the experiences of its prompts
                    (as rank r of a single-machine run); timed per role from the same start;
                    the weight push queued right behind them (`EngineFleet.start_sync`) where
                    nobody sleeps between phases and the engines have nothing else to do
    push_weights    actor ranks gather the weights chunk by chunk, rank 0 broadcasts them to every
                    engine worker in a weight-sync group (`weight_push.WeightPush`; or, as the
                    `placement.vllm.weight_sync=object_store` fallback, hands the whole state dict to
                    every engine through Ray's object store); or waits for the rest of the push
                    `learn` queued
    pop_busy        each role's busy seconds, read from its workers

Data crosses between the driver and the roles as one batch shape, split into row shards over a
role's ranks and joined again (`WorkerGroup.scatter_rows`, `gather_rows`): `ExperienceBatch`
shards for forward passes, updates and back the scores; reward workers get the responses
(`RowList`) and answer with an `ExperienceBatch` of scores.

Before the first step the driver reads back where every worker runs and fails unless it is the
map (`placement.json` in the run folder records both).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import ray
import torch

from hpcrlhf.cluster.engines import LOOP_ACTOR, EngineFleet, EngineWorker
from hpcrlhf.cluster.reservation import Reservation
from hpcrlhf.cluster.reward_servers import RewardServers
from hpcrlhf.cluster.worker_group import WorkerGroup, gather, gather_rows, wait_any, worker_stacks
from hpcrlhf.data.batching import RowList
from hpcrlhf.engines.rollout.settings import vllm_engine_args
from hpcrlhf.errors import PlacementError
from hpcrlhf.logs import get_logger
from hpcrlhf.placement.roles import TRAINED
from hpcrlhf.run.files import make_folders, replace_file
from hpcrlhf.run.stats import Stats, add_stats, new_stats
from hpcrlhf.trainers.online import reward_set
from hpcrlhf.trainers.ppo.experience import ExperienceBatch
from hpcrlhf.trainers.ppo.learner import SCORE_FIELDS
from hpcrlhf.trainers.ppo.phases import PhaseSwitch
from hpcrlhf.trainers.ppo.ray.weight_push import WeightPush
from hpcrlhf.trainers.ppo.ray.workers import ROLE_WORKERS, role_config
from hpcrlhf.trainers.ppo.roles import RoleContext

log = get_logger()

class RemoteRewards:
    """The reward role's workers as a `RewardSet`: responses split evenly over its ranks."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group
        (self.names,) = gather([group.workers[0].names.remote()])

    def score(self, responses: list) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # equal shards: a ZeRO-3 reward model's ranks run the same forward passes; rules may never return
        (scores,) = gather_rows(self.group.scatter_rows("score", RowList(responses), pad_to_equal=True),
                                interruptible=True)
        return scores.tensors["score"], {name: scores.tensors[f"reward/{name}"] for name in self.names}


class RayRoles:
    """PPO's roles on the workers of `reservation`'s node map (`PPORoles`): one worker group per
    role, the vLLM engines, and the weight push between them. The driver holds no model."""

    def __init__(self, ctx: RoleContext, reservation: Reservation):
        cfg, node_map = ctx.cfg, reservation.node_map
        self.reservation, self.run_dir, self.is_main = reservation, ctx.run_dir, ctx.models.env.is_main
        # the reward servers load while the roles' workers start; healthy before any role loads a model
        self.servers = RewardServers(cfg, reservation, ctx.run_dir) if node_map.reward_servers else None
        self.plan = ctx.role_plan(len(node_map.role_ranks("actor")))
        self.prompt_ranks = range(self.plan.data_parallel_size)
        self.groups: dict[str, WorkerGroup] = {}
        for role, worker in ROLE_WORKERS.items():
            if not node_map.role_ranks(role):
                continue
            r = node_map.roles[role]
            plan = ctx.role_plan(r.ranks) if role in TRAINED else self.plan
            self.groups[role] = WorkerGroup.for_role(
                role, worker, reservation, role_config(cfg, r.zero_stage, r.offload_optimizer, r.offload_params, role),
                plan)
        self.trained = tuple(role for role in TRAINED if role in self.groups)
        tp = node_map.vllm.tensor_parallel_size
        partial = cfg.rollout.partial  # each engine on an engine loop: a sync pauses what runs
        loop = partial or cfg.rollout.stream_order == "arrival"  # (arrival: one group per call, many at once)
        engines = WorkerGroup.for_engines(EngineWorker, reservation, tensor_parallel_size=tp, loop=loop,
                                          partial=partial, min_step_s=cfg.rollout.min_engine_step_s,
                                          remote_options=LOOP_ACTOR if loop else None,
                                          **vllm_engine_args(cfg))
        self.weight_push = WeightPush(self.groups["actor"], tp, cfg.placement.vllm.weight_sync)
        self.rollout = EngineFleet(engines, self.weight_push, max_restarts=cfg.placement.vllm.max_restarts,
                                   streaming=loop, partial=partial)
        self.hf_rollout = None  # the actor module lives on its workers
        setups = [ref for role, g in self.groups.items() if role != "reward" for ref in g.call_async("setup")]
        served = None
        if self.servers is not None:  # while the other roles load their models
            self.servers.wait_healthy()
            served = self.servers.served()
        if "reward" in self.groups:
            setups += self.groups["reward"].call_async("setup", served)
        gather(setups)
        # rules only without a reward role (the plan gives the reward role GPUs whenever the job scores a reward model)
        self.rewards = (RemoteRewards(self.groups["reward"]) if "reward" in self.groups
                        else reward_set(cfg, ctx.models, ctx.task, served))
        self.phases = PhaseSwitch.for_job(cfg, self.trained, self.rollout,
                                          lambda role, verb: self.groups[role].call(verb), lambda: ctx.timed("swap"))
        self.check_placement()
        self.where = (f"on Ray: {', '.join(f'{r} {len(g)} rank(s)' for r, g in self.groups.items())}, "
                      f"{len(engines)} vLLM engine(s) x TP {tp}")

    @property
    def all_groups(self) -> list[WorkerGroup]:
        """Every role's workers, the engines and the job's reward servers."""
        return [*self.groups.values(), self.rollout.group, *([self.servers] if self.servers is not None else [])]

    def check_placement(self) -> None:
        """Every worker's node and visible GPUs, read back from the worker, must be the map's."""
        groups = self.all_groups
        found = [w for g in groups for w in g.locate()]
        expected = {}
        for g in groups:
            for rank, devices in enumerate(g.placements):
                if not devices:  # a reward server on its node's CPU cores: no GPU
                    expected[(g.role, rank)] = (self.reservation.nodes[g.plans[rank].node].ip, "")
                    continue
                expected[(g.role, rank)] = (self.reservation.ip_of(devices[0]), ",".join(str(d.gpu) for d in devices))
        rows, wrong = [], []
        for w in found:
            want = expected[(w.role, w.rank)]
            rows.append({"role": w.role, "rank": w.rank, "node_ip": w.node_ip, "visible_devices": w.visible_devices,
                         "pid": w.pid, "map_node_ip": want[0], "map_devices": want[1]})
            if (w.node_ip, w.visible_devices) != want:
                wrong.append(f"{w.role}[{w.rank}] runs on {w.node_ip} GPUs {w.visible_devices!r}, the map says "
                             f"{want[0]} GPUs {want[1]!r}")
        if self.is_main:
            replace_file(self.run_dir / "placement.json", json.dumps(
                {"node_map": json.loads(self.reservation.node_map.to_json()), "workers": rows}, indent=2) + "\n")
        if wrong:
            raise PlacementError("workers are not where the node map puts them:\n" + "\n".join(f"- {x}" for x in wrong))

    # -- PPORoles --------------------------------------------------------------------------------
    def score_tokens(self, batch: ExperienceBatch) -> ExperienceBatch:
        """Every scoring role at once, each rank on an equal row shard (ZeRO-3 ranks run the same
        forward passes)."""
        self.phases.enter("train")
        scattered = [self.groups[role].scatter_rows("token_scores", batch, pad_to_equal=True)
                     for role in SCORE_FIELDS if role in self.groups]
        return batch.with_tensors(**{k: v for scores in gather_rows(*scattered) for k, v in scores.tensors.items()})

    def learn(self, experience: ExperienceBatch, step: int, roles: Sequence[str],
              push: bool = False) -> tuple[Stats, dict[str, float]]:
        """Every role at once, each rank on its share of the experience. With `push`, the weight
        sync is queued behind the actor's epochs (`EngineFleet.start_sync`) where no role sleeps
        between the phases: the engines wait in it while the roles train, the actor sends as soon
        as it is done (while the critic may still train), and `push_weights` waits for the rest."""
        self.phases.enter("train")
        pending = {role: self.groups[role].scatter_rows("update", experience, step).refs for role in roles}
        if push and not self.phases.sleepers:
            self.rollout.start_sync()
        start, left, seconds = time.perf_counter(), {role: set(refs) for role, refs in pending.items()}, {}
        waiting = [ref for refs in pending.values() for ref in refs]
        while waiting:  # each role's time from the common start to its last rank's end
            (ready,), waiting = wait_any(waiting)
            ray.get(ready)  # a failed rank raises now, not after its peers' collective timeout
            for role, refs in left.items():
                if ready in refs:
                    refs.discard(ready)
                    if not refs:
                        seconds[role] = time.perf_counter() - start
        sums: Stats = new_stats()
        for refs in pending.values():
            for part in ray.get(refs):
                add_stats(sums, part)
        return sums, seconds

    def push_weights(self, version: int) -> dict[str, float] | None:
        self.phases.enter("weight_sync")
        self.rollout.sync(version)
        return self.weight_push.last or None

    def save(self, folder: Path, state: dict[str, Any]) -> None:
        """Each trained role's ranks write into the same folders as a single-machine run's."""
        self.phases.enter("train")
        gather([ref for group, sub in self._trained_folders()
                for ref in group.call_async("save_checkpoint", str(folder / sub), {"step": state["step"]} if sub else state)])

    def load(self, folder: Path) -> dict[str, Any]:
        self.phases.enter("train")
        refs = [group.call_async("load_checkpoint", str(folder / sub)) for group, sub in self._trained_folders()]
        return gather([ref for more in refs for ref in more])[0]

    def _trained_folders(self) -> list[tuple[WorkerGroup, str]]:
        """(group, its checkpoint folder under the step's) of the trained roles, actor first."""
        return [(self.groups[role], "" if role == "actor" else role) for role in self.trained]

    def pop_busy(self) -> dict[str, float]:
        """Each role's (and the engines', `vllm`) busy seconds since the last call, mean over ranks."""
        groups = [g for g in self.all_groups if g is not self.rollout.group]
        seconds = iter(gather([w.pop_busy.remote() for g in groups for w in g.workers]))
        busy = {g.role: sum(next(seconds) for _ in g.workers) / max(len(g.workers), 1) for g in groups}
        engines = self.rollout.call_every("pop_busy")  # an engine that died since the last step is restarted here
        return {**busy, self.rollout.group.role: sum(engines) / max(len(engines), 1)}

    def optimizer_stats(self) -> dict[str, float | None]:
        (stats,) = gather([self.groups["actor"].workers[0].optimizer_stats.remote()])
        return stats

    def trained_weights(self) -> None:
        return None  # on the actor's workers

    def save_model(self, folder: str = "model", files: dict[str, str] | None = None) -> None:
        self.phases.enter("train")
        self.groups["actor"].call("save_model", folder, files)

    def stuck_stacks(self, parties: Sequence[str], folder: Path) -> list[str]:
        """Write the stacks of the workers among `parties` (a hung wait's, by their placed names) into
        `folder`, each read where it runs; a line per worker naming its file."""
        lines, stuck = [], [(group, rank) for group in self.all_groups for rank in group.stuck(parties)]
        for (group, rank), text in zip(stuck, worker_stacks([group.located[rank] for group, rank in stuck])):
            w = group.located[rank]
            make_folders(folder, "the watchdog's stacks folder")
            name = group.name(rank).split(" (")[0].replace(" ", "_")
            path = folder / f"stacks-{time.strftime('%Y%m%d-%H%M%S')}-{name}-{w.pid}.txt"
            replace_file(path, f"# {group.placed_name(rank)}: process {w.pid} on {w.node_ip}\n{text}")
            lines.append(f"stacks of {group.placed_name(rank)}, process {w.pid} on {w.node_ip}: {path}")
        return lines

    def abandon(self) -> None:
        """After a hang: `close` kills every worker without asking the engines to close (a stuck one never answers)."""
        self.rollout.graceful = False

    def close(self) -> None:
        """Stop the engines, the reward servers and every worker (also after one of them died)."""
        self.rollout.close()
        if self.servers is not None:
            self.servers.close()
        for group in self.groups.values():
            group.kill()
