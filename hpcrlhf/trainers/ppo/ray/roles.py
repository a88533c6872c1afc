"""PPO's roles on Ray: every role on its own workers, placed by the static node map.

The driver is `PPOTrainer` itself (same loop, same step, same maths, same checkpoints); `RayRoles`
is its roles interface (`trainers.ppo.roles.PPORoles`) on Ray workers:

    rollout         the vLLM engine actors (`EngineFleet`), prompts split over engines
    rewards         the rules here; reward models on the reward role's workers
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

Data crosses between the driver and the roles as typed batches: padded tensors for forward
passes, `ExperienceBatch` shards for updates, `Response`s for reward models.

Before the first step the driver reads back where every worker runs and fails unless it is the
map (`placement.json` in the run folder records both).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from hpcrlhf.cluster.engines import EngineFleet, EngineWorker
from hpcrlhf.cluster.reservation import Reservation
from hpcrlhf.cluster.worker_group import WorkerGroup, even_bounds, gather
from hpcrlhf.errors import PlacementError
from hpcrlhf.logs import get_logger
from hpcrlhf.placement.roles import TRAINED
from hpcrlhf.run.files import replace_file
from hpcrlhf.run.stats import Stats, add_stats, new_stats
from hpcrlhf.trainers.online import reward_set, vllm_engine_args
from hpcrlhf.trainers.ppo.driver import PPOTrainer
from hpcrlhf.trainers.ppo.experience import ExperienceBatch
from hpcrlhf.trainers.ppo.phases import PhaseSwitch
from hpcrlhf.trainers.ppo.ray.weight_push import WeightPush
from hpcrlhf.trainers.ppo.ray.workers import ROLE_WORKERS, role_config
from hpcrlhf.trainers.ppo.roles import TokenScores, role_plan

log = get_logger()

def equal_shards(n: int, parts: int) -> list[list[int]]:
    """Row indices of `parts` equal shards of n rows, the last row repeated to fill: every rank of
    a ZeRO-3 role must run the same number of forward passes."""
    size = -(-n // parts)
    rows = list(range(n)) + [n - 1] * (size * parts - n)
    return [rows[i * size : (i + 1) * size] for i in range(parts)]


def pad_rows(batch: dict[str, torch.Tensor], parts: int) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Equal row shards of a batch for `parts` ranks, and the real row count."""
    n = batch["input_ids"].shape[0]
    return [{k: v[rows] for k, v in batch.items()} for rows in equal_shards(n, parts)], n


class RemoteRewards:
    """The reward role's workers as a `RewardSet`: responses split evenly over its ranks."""

    def __init__(self, group: WorkerGroup) -> None:
        import ray

        self.group = group
        self.names = ray.get(group.workers[0].names.remote())

    def score(self, responses: list) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        n = len(responses)
        shards = [[responses[i] for i in rows] for rows in equal_shards(n, len(self.group))]
        results = gather(self.group.scatter_async("score", shards), interruptible=True)  # rules may never return
        total = torch.cat([t for t, _ in results])[:n]
        return total, {name: torch.cat([p[name] for _, p in results])[:n] for name in self.names}


class RayRoles:
    """PPO's roles on the workers of `reservation`'s node map (`PPORoles`): one worker group per
    role, the vLLM engines, and the weight push between them. The driver holds no model."""

    def __init__(self, trainer: PPOTrainer, reservation: Reservation):
        t, cfg = trainer, trainer.cfg
        self.t, self.reservation, node_map = t, reservation, reservation.node_map
        self.plan = role_plan(t, len(node_map.role_ranks("actor")))
        self.prompt_ranks = range(self.plan.data_parallel_size)
        self.groups: dict[str, WorkerGroup] = {}
        for role, worker in ROLE_WORKERS.items():
            if not node_map.role_ranks(role):
                continue
            r = node_map.roles[role]
            plan = role_plan(t, r.ranks) if role in TRAINED else self.plan
            self.groups[role] = WorkerGroup.for_role(
                role, worker, reservation, role_config(cfg, r.zero_stage, r.offload_optimizer, r.offload_params, role),
                plan)
        self.trained = tuple(role for role in TRAINED if role in self.groups)
        tp = node_map.vllm.tensor_parallel_size
        engines = WorkerGroup.for_engines(EngineWorker, reservation, tensor_parallel_size=tp, **vllm_engine_args(cfg))
        self.weight_push = WeightPush(self.groups["actor"], tp, cfg.placement.vllm.weight_sync)
        self.rollout = EngineFleet(engines, self.weight_push, max_restarts=cfg.placement.vllm.max_restarts)
        self.hf_rollout = None  # the actor module lives on its workers
        gather([ref for g in self.groups.values() for ref in g.call_async("setup")])
        # rules only without a reward role (the plan gives the reward role GPUs whenever there is a reward model)
        self.rewards = RemoteRewards(self.groups["reward"]) if "reward" in self.groups else reward_set(cfg, t.models, t.task)
        self.phases = PhaseSwitch.for_job(cfg, self.trained, self.rollout,
                                          lambda role, verb: self.groups[role].call(verb), lambda: t.run.timed("swap"))
        self.check_placement()
        self.where = (f"on Ray: {', '.join(f'{r} {len(g)} rank(s)' for r, g in self.groups.items())}, "
                      f"{len(engines)} vLLM engine(s) x TP {tp}")

    @property
    def all_groups(self) -> list[WorkerGroup]:
        """Every role's workers and the engines."""
        return [*self.groups.values(), self.rollout.group]

    def check_placement(self) -> None:
        """Every worker's node and visible GPUs, read back from the worker, must be the map's."""
        groups = self.all_groups
        found = [w for g in groups for w in gather(g.call_async("whereabouts"))]
        expected = {}
        for g in groups:
            for rank, devices in enumerate(g.placements):
                expected[(g.role, rank)] = (self.reservation.ip_of(devices[0]), ",".join(str(d.gpu) for d in devices))
        rows, wrong = [], []
        for w in found:
            want = expected[(w.role, w.rank)]
            rows.append({"role": w.role, "rank": w.rank, "node_ip": w.node_ip, "visible_devices": w.visible_devices,
                         "pid": w.pid, "map_node_ip": want[0], "map_devices": want[1]})
            if (w.node_ip, w.visible_devices) != want:
                wrong.append(f"{w.role}[{w.rank}] runs on {w.node_ip} GPUs {w.visible_devices!r}, the map says "
                             f"{want[0]} GPUs {want[1]!r}")
        if self.t.env.is_main:
            replace_file(self.t.run.dir / "placement.json", json.dumps(
                {"node_map": json.loads(self.reservation.node_map.to_json()), "workers": rows}, indent=2) + "\n")
        if wrong:
            raise PlacementError("workers are not where the node map puts them:\n" + "\n".join(f"- {x}" for x in wrong))

    # -- PPORoles --------------------------------------------------------------------------------
    def score_tokens(self, batch: dict[str, torch.Tensor]) -> TokenScores:
        self.phases.enter("train")
        wanted = {"actor": "logps", "ref": "logps", "critic": "values"}
        pending: dict[str, tuple[list[Any], int]] = {}
        for role, method in wanted.items():
            if role in self.groups:
                shards, n = pad_rows(batch, len(self.groups[role]))
                pending[role] = (self.groups[role].scatter_async(method, shards), n)
        results = iter(gather([ref for refs, _ in pending.values() for ref in refs]))
        out = {role: torch.cat([next(results) for _ in refs])[:n] for role, (refs, n) in pending.items()}
        return out["actor"], out.get("ref"), out.get("critic")

    def learn(self, experience: ExperienceBatch, step: int, roles: Sequence[str],
              push: bool = False) -> tuple[Stats, dict[str, float]]:
        """Every role at once, each rank on its share of the experience. With `push`, the weight
        sync is queued behind the actor's epochs (`EngineFleet.start_sync`) where no role sleeps
        between the phases: the engines wait in it while the roles train, the actor sends as soon
        as it is done (while the critic may still train), and `push_weights` waits for the rest."""
        import ray

        self.phases.enter("train")
        pending: dict[str, list[Any]] = {}
        for role in roles:
            group = self.groups[role]
            shards = [experience.shard(a, b) for a, b in even_bounds(len(experience), len(group))]
            pending[role] = group.scatter_async("learn", shards, step)
        if push and not self.phases.sleepers:
            self.rollout.start_sync()
        start, left, seconds = time.perf_counter(), {role: set(refs) for role, refs in pending.items()}, {}
        waiting = [ref for refs in pending.values() for ref in refs]
        while waiting:  # each role's time from the common start to its last rank's end
            (ready,), waiting = ray.wait(waiting, num_returns=1)
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

    def push_weights(self) -> dict[str, float] | None:
        self.phases.enter("weight_sync")
        self.rollout.sync()
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
        groups = self.all_groups
        seconds = iter(gather([w.pop_busy.remote() for g in groups for w in g.workers]))
        return {g.role: sum(next(seconds) for _ in g.workers) / max(len(g.workers), 1) for g in groups}

    def optimizer_stats(self) -> dict[str, float | None]:
        import ray

        return ray.get(self.groups["actor"].workers[0].optimizer_stats.remote())

    def trained_weights(self) -> None:
        return None  # on the actor's workers

    def save_model(self) -> None:
        self.phases.enter("train")
        self.groups["actor"].call("save_model")

    def close(self) -> None:
        """Stop the engines and every worker (also after one of them died)."""
        self.rollout.close()
        for group in self.groups.values():
            group.kill()
