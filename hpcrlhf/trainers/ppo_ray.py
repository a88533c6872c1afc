"""PPO on Ray: every role on its own workers, placed by the static node map.

The driver is `PPOTrainer` itself (same loop, same step, same maths: rewards, KL shaping,
advantages, metrics, the KL controller, checkpoints), with the role hooks pointed at Ray workers:

    generate        the vLLM engine actors (`EngineFleet`), prompts split over engines
    reward          the rules here; reward models on the reward role's workers
    score_tokens    actor / reference log-probs and critic values, all roles at once, each
                    role's ranks on equal row shards
    learn           actor and critic updates at once, rank r on the experiences of its prompts
                    (as rank r of a single-machine run); timed per role from the same start
    sync_rollout    actor ranks gather the weights chunk by chunk, rank 0 broadcasts them to every
                    engine worker in a weight-sync group (`WeightPush`; or, as the
                    `placement.vllm.weight_sync=object_store` fallback, hands the whole state dict to
                    every engine through Ray's object store)

Data crosses between the driver and the roles as typed batches: padded tensors for forward
passes, `ExperienceBatch` shards for updates, `Response`s for reward models.

Before the first step the driver reads back where every worker runs and fails unless it is the
map (`placement.json` in the run folder records both).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from hpcrlhf.cluster.engines import EngineFleet, EngineWorker
from hpcrlhf.trainers.ppo_workers import ROLE_WORKERS, role_config
from hpcrlhf.cluster.reservation import Reservation
from hpcrlhf.cluster.worker_group import (WorkerGroup, dead_worker_message, death_verdict, even_bounds, gather,
                                          lost_node_message, lost_worker_error, unreachable, worker_with_id)
from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.errors import PlacementError, WorkerLost
from hpcrlhf.logs import get_logger
from hpcrlhf.placement import NodeMap
from hpcrlhf.placement.problems import Problem, raise_problems
from hpcrlhf.placement.roles import TRAINED
from hpcrlhf.trainers.experience import ExperienceBatch
from hpcrlhf.trainers.online import Prompt, refill_seed, vllm_engine_args
from hpcrlhf.trainers.ppo import PPOTrainer
from hpcrlhf.trainers.stats import Stats, add_stats, new_stats

log = get_logger()

NODE_VERDICT_S = 60.0
"""How long a run that lost contact with a worker waits for Ray to say whether the worker's node died
(hpcrlhf.cluster.bootstrap.HEALTH_CHECKS decide in 10-30 s), to name the node in its error."""


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
        results = gather(self.group.scatter_async("score", shards))
        total = torch.cat([t for t, _ in results])[:n]
        return total, {name: torch.cat([p[name] for _, p in results])[:n] for name in self.names}


class RayPPOTrainer(PPOTrainer):
    """The PPO driver: holds the prompts, the run folder and the step's maths; the models live on
    the workers of `reservation`'s node map."""

    def __init__(self, cfg: PPOConfig, reservation: Reservation):
        self.setup(cfg)
        self.setup_online()
        self.reservation, node_map = reservation, reservation.node_map
        self.plan = self.build_plan(len(node_map.role_ranks("actor")))
        self.groups: dict[str, WorkerGroup] = {}
        for role, worker in ROLE_WORKERS.items():
            if not node_map.role_ranks(role):
                continue
            r = node_map.roles[role]
            plan = self.build_plan(r.ranks) if role in TRAINED else self.plan
            self.groups[role] = WorkerGroup.for_role(
                role, worker, reservation, role_config(cfg, r.zero_stage, r.offload_optimizer, r.offload_params, role),
                plan)
        engines = WorkerGroup.for_engines(EngineWorker, reservation, tensor_parallel_size=node_map.vllm.tensor_parallel_size,
                                          **vllm_engine_args(cfg))
        self.weight_push = WeightPush(self.groups["actor"], node_map.vllm.tensor_parallel_size,
                                      cfg.placement.vllm.weight_sync)
        self.rollout = EngineFleet(engines, self.weight_push, max_restarts=cfg.placement.vllm.max_restarts)
        gather([ref for g in self.groups.values() for ref in g.call_async("setup")])
        self.rollout_synced = False  # engines start from model.path; the actor's weights go in before use
        if "reward" in self.groups:
            self.rewards = RemoteRewards(self.groups["reward"])
        else:  # rules only (the plan gives the reward role GPUs whenever there is a reward model)
            self.build_rewards()
        self.setup_ppo_state()
        self.check_placement()
        self.log_start(f"on Ray: {', '.join(f'{r} {len(g)} rank(s)' for r, g in self.groups.items())}, "
                       f"{len(engines)} vLLM engine(s) x TP {node_map.vllm.tensor_parallel_size}")

    def trained_weights(self) -> None:
        return None  # on the actor's workers

    def train_step(self, step: int) -> dict[str, float]:
        """The PPO step, plus how long each role's workers were busy in it (`timing/busy_<role>`,
        the mean over its ranks; `util/<role>_idle` in the log is 1 - busy / step)."""
        self.pop_busy()  # what evaluation used is not this step's
        metrics = super().train_step(step)
        for role, seconds in self.pop_busy().items():
            self.run.add_timing(f"busy_{role}", seconds)
        return metrics

    def pop_busy(self) -> dict[str, float]:
        """Each role's (and the engines', `vllm`) busy seconds since the last call, mean over ranks."""
        groups = self.all_groups
        seconds = iter(gather([w.pop_busy.remote() for g in groups for w in g.workers]))
        return {g.role: sum(next(seconds) for _ in g.workers) / max(len(g.workers), 1) for g in groups}

    # -- placement ---------------------------------------------------------------------------
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
        if self.env.is_main:
            (self.run.dir / "placement.json").write_text(json.dumps(
                {"node_map": json.loads(self.reservation.node_map.to_json()), "workers": rows}, indent=2) + "\n")
        if wrong:
            raise PlacementError("workers are not where the node map puts them:\n" + "\n".join(f"- {x}" for x in wrong))

    # -- the role hooks ------------------------------------------------------------------------
    def step_prompts(self, step: int, round: int = 0) -> list[Prompt]:
        """The prompts every actor rank of a single-machine run would take, in rank order."""
        ranks, seed = self.plan.data_parallel_size, refill_seed(self.cfg.seed, round)
        return [self.prompts[i] for rank in range(ranks) for i in self.plan.prompts_for_step(len(self.prompts), step, seed, rank)]

    def score_tokens(self, batch: dict[str, torch.Tensor]):
        wanted = {"actor": "logps", "ref": "logps", "critic": "values"}
        pending: dict[str, tuple[list[Any], int]] = {}
        for role, method in wanted.items():
            if role in self.groups:
                shards, n = pad_rows(batch, len(self.groups[role]))
                pending[role] = (self.groups[role].scatter_async(method, shards), n)
        results = iter(gather([ref for refs, _ in pending.values() for ref in refs]))
        out = {role: torch.cat([next(results) for _ in refs])[:n] for role, (refs, n) in pending.items()}
        return out["actor"], out.get("ref"), out.get("critic")

    def learn(self, experience: ExperienceBatch, step: int) -> Stats:
        import ray

        pending: dict[str, list[Any]] = {}
        for role in TRAINED:
            if role not in self.groups or (role == "actor" and step < self.cfg.ppo.freeze_actor_steps):
                continue
            group = self.groups[role]
            shards = [experience.shard(a, b) for a, b in even_bounds(len(experience), len(group))]
            pending[role] = group.scatter_async("learn", shards, step)
        start, left = time.perf_counter(), {role: set(refs) for role, refs in pending.items()}
        waiting = [ref for refs in pending.values() for ref in refs]
        while waiting:  # each role's time from the common start to its last rank's end
            (ready,), waiting = ray.wait(waiting, num_returns=1)
            ray.get(ready)  # a failed rank raises now, not after its peers' collective timeout
            for role, refs in left.items():
                if ready in refs:
                    refs.discard(ready)
                    if not refs:
                        self.run.add_timing(f"train_{role}", time.perf_counter() - start)
        sums: Stats = new_stats()
        for refs in pending.values():
            for part in ray.get(refs):
                add_stats(sums, part)
        return sums

    def sync_rollout(self) -> None:
        self.rollout.sync()
        self.rollout_synced = True
        self.sync_metrics = self.weight_push.last

    def greedy_rollout(self):
        if not self.rollout_synced:
            self.sync_rollout()
        return self.rollout

    def optimizer_stats(self) -> dict[str, float | None]:
        import ray

        return ray.get(self.groups["actor"].workers[0].optimizer_stats.remote())

    @property
    def checkpointable(self):
        return RayPPOState(self)

    def save_outputs(self) -> None:
        self.groups["actor"].call("save_model")

    @property
    def all_groups(self) -> list[WorkerGroup]:
        """Every role's workers and the engines."""
        return [*self.groups.values(), self.rollout.group]

    def close(self) -> None:
        """Stop the engines and every worker (also after one of them died)."""
        self.rollout.close()
        for group in self.groups.values():
            group.kill()


class WeightPush:
    """`push(engines)`: the actor's current weights into `engines` (all the fleet's), by the
    `placement.vllm.weight_sync` path. The collective path's group spans actor rank 0 and every
    worker of those engines; it is formed at the first push and again whenever the engines are not
    the ones it was formed with (an engine restarted). `last`: the last push's metrics."""

    def __init__(self, actor: WorkerGroup, tensor_parallel_size: int, mode: str) -> None:
        self.actor, self.tp, self.mode = actor, tensor_parallel_size, mode
        self.members: list[str] | None = None
        self.formed = 0
        self.last: dict[str, float] = {}

    def __call__(self, engines: list[Any]) -> None:
        if self.mode == "object_store":
            gather(self.actor.call_async("push_weights", engines))
            return
        if self.members != [e._actor_id.hex() for e in engines]:
            self.form(engines)
        sent = gather([*self.actor.call_async("broadcast_weights"), *[e.receive_weights.remote() for e in engines]])[0]
        self.last = {"weight_sync/bytes": float(sent["bytes"]), "weight_sync/buckets": float(sent["buckets"]),
                     "weight_sync/broadcast_s": sent["seconds"]}

    def form(self, engines: list[Any]) -> None:
        import ray

        from hpcrlhf.engines.weight_sync import SyncGroup

        self.members = None
        rank0 = self.actor.workers[0]
        host, port = ray.get(rank0.serve_weight_group.remote())
        self.formed += 1
        spec = SyncGroup(host, port, 1 + len(engines) * self.tp, f"hpcrlhf-weights-{self.formed}")
        chosen = gather([rank0.open_weight_group.remote(spec),
                         *[e.join_weight_group.remote(spec, 1 + i * self.tp) for i, e in enumerate(engines)]])[0]
        self.members = [e._actor_id.hex() for e in engines]
        log.info(f"weight-sync group {spec.name}: actor rank 0 and {len(engines)} engine(s) x TP {self.tp} "
                 f"({spec.world_size} members, {chosen}) at {host}:{port}")


class RayPPOState:
    """A Ray PPO checkpoint: the actor's and the critic's engines and replay buffers (written by
    their ranks into the same folders as a single-machine run's) plus the driver's KL controller
    and reward moments. The workers' random states are not saved: PPO's randomness (sampling,
    mini-batch order) is seeded per step."""

    def __init__(self, trainer: RayPPOTrainer):
        self.t = trainer

    def _trained(self):
        """(group, its checkpoint folder under the step's) of the trained roles, actor first."""
        return [(self.t.groups[role], sub) for role, sub in (("actor", ""), ("critic", "critic")) if role in self.t.groups]

    def save_checkpoint(self, folder, client_state: dict[str, Any]) -> None:
        t = self.t
        state = {**client_state, **t.controller_state()}
        gather([ref for group, sub in self._trained()
                 for ref in group.call_async("save_checkpoint", str(folder / sub),
                                             {"step": client_state["step"]} if sub else state)])
        t.save_ahead(folder, 0)  # the driver holds every engine's samples

    def load_checkpoint(self, folder) -> dict[str, Any]:
        t = self.t
        refs = [group.call_async("load_checkpoint", str(folder / sub)) for group, sub in self._trained()]
        state = gather([ref for more in refs for ref in more])[0]
        t.load_controller_state(state)
        t.load_ahead(folder, 0)
        t.rollout_synced = False  # push the resumed weights before generating
        return state


def start_problems(cfg: PPOConfig, node_map: NodeMap) -> list[Problem]:
    """What would make the run fail once started, checked before Ray starts: a local cluster (no
    RAY_ADDRESS) this host's GPUs cannot hold, and a model path of a role with GPUs that is neither
    a model folder nor a hub model the hub can provide now."""
    from hpcrlhf.cluster import netns
    from hpcrlhf.cluster.session import host_gpus, local_cluster_problem
    from hpcrlhf.models.loading import ModelPathError, check_model_source
    from hpcrlhf.models.tiny import resolve_model_path
    from hpcrlhf.placement.roles import role_models

    problems = []
    if not os.environ.get("RAY_ADDRESS"):
        problem = local_cluster_problem(node_map.nodes, node_map.gpus_per_node, gpus_here=host_gpus(),
                                        simulated=cfg.placement.simulated_gpus)
        problems += [problem] if problem else []
    checked = set()
    for role in [*node_map.roles, *(["vllm"] if node_map.vllm else [])]:
        for key, path in role_models(cfg)[role]:
            if path in checked:  # each path once, under the first field that names it
                continue
            checked.add(path)
            try:
                check_model_source(resolve_model_path(path), key)
            except ModelPathError as e:
                fix = e.fix
                if "hub" in e.reason and netns.inside():
                    fix += ("; this job runs in a private network (placement.local_network), where the hub cannot be "
                            "reached: download the model beforehand, or set placement.local_network=host")
                problems.append(Problem(e.key, repr(e.path), e.reason, fix))
    return problems


def run_ray_ppo(cfg: PPOConfig) -> dict:
    """Plan, check the host and the model paths, connect to (or start) the Ray cluster, reserve the
    map's GPUs, train, clean up. A plan that cannot work, or cannot start here, fails before Ray starts."""
    from hpcrlhf.cluster.reservation import reserve
    from hpcrlhf.cluster.session import ray_session
    from hpcrlhf.placement import build_node_map

    node_map = build_node_map(cfg)
    log.info("node map:\n" + node_map.render())
    raise_problems(start_problems(cfg, node_map), title="ppo on Ray would fail here, so nothing was started")
    with ray_session(node_map.nodes, node_map.gpus_per_node) as node_ips:
        reservation = reserve(node_map, node_ips)
        trainer = None
        try:
            trainer = RayPPOTrainer(cfg, reservation)
            return trainer.fit()
        except Exception as e:
            groups = trainer.all_groups if trainer is not None else []
            cause = lost_worker_error(e, groups)
            if cause is None:
                raise
            verdict_by = time.monotonic() + NODE_VERDICT_S
            if unreachable(cause):
                log.info(f"lost contact with a worker: waiting up to {NODE_VERDICT_S:.0f} s for Ray to tell whether "
                         "it or its node died")
                cause = death_verdict(worker_with_id(cause.actor_id, groups), cause, NODE_VERDICT_S)
            message = dead_worker_message(cause, groups)
            lost = reservation.lost_nodes(max(0.0, verdict_by - time.monotonic()) if unreachable(cause) else 0.0)
            if lost:
                message = "; ".join(lost_node_message(reservation.nodes[i].describe(i), i, groups) for i in lost)
            latest = trainer.run.checkpoints.latest() if trainer is not None else None
            raise WorkerLost(f"ppo on Ray: {message}. Every other worker was stopped; rerun the same command to "
                             "resume from " + (f"the last checkpoint ({latest.name})" if latest else
                                               "the start (no checkpoint yet: see checkpoint.every_steps)")) from None
        finally:
            if trainer is not None:
                trainer.close()
            reservation.release()
