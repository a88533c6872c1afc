"""PPO on Ray from the command line's point of view: `run_ray_ppo` plans the node map, checks the host
and the model paths before anything starts (`start_problems`), connects to (or starts) the Ray
cluster, reserves the map's GPUs, trains with `PPOTrainer` on `RayRoles`, and turns a lost worker or
node into an error that says who, where, and how to resume.
"""

from __future__ import annotations

import os
import time

from hpcrlhf.cluster import netns
from hpcrlhf.cluster.reservation import reserve
from hpcrlhf.cluster.session import host_gpus, local_cluster_problem, ray_session
from hpcrlhf.cluster.worker_group import (dead_worker_message, death_verdict, lost_node_message, lost_worker_error,
                                          unreachable, worker_with_id)
from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.errors import Hung, WorkerLost
from hpcrlhf.logs import get_logger
from hpcrlhf.models.loading import ModelPathError, check_model_source
from hpcrlhf.models.tiny import resolve_model_path
from hpcrlhf.placement import NodeMap, build_node_map, render_text
from hpcrlhf.placement.problems import Problem, raise_problems
from hpcrlhf.placement.roles import role_models
from hpcrlhf.trainers.ppo.driver import PPOTrainer
from hpcrlhf.trainers.ppo.ray.roles import RayRoles

log = get_logger()

NODE_VERDICT_S = 60.0
"""How long a run that lost contact with a worker waits for Ray to say whether the worker's node died
(hpcrlhf.cluster.bootstrap.HEALTH_CHECKS decide in 10-30 s), to name the node in its error."""


def start_problems(cfg: PPOConfig, node_map: NodeMap) -> list[Problem]:
    """What would make the run fail once started, checked before Ray starts: a local cluster (no
    RAY_ADDRESS) this host's GPUs cannot hold, and a model path of a role with GPUs that is neither
    a model folder nor a hub model the hub can provide now."""
    problems = []
    if not os.environ.get("RAY_ADDRESS"):
        problem = local_cluster_problem(node_map.nodes, node_map.gpus_per_node, gpus_here=host_gpus(),
                                        simulated=cfg.placement.simulated_gpus)
        problems += [problem] if problem else []
    checked = set()
    served = ["reward_server"] if any(s.model for s in node_map.reward_servers) else []
    for role in [*node_map.roles, *(["vllm"] if node_map.vllm else []), *served]:
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
    node_map = build_node_map(cfg)
    log.info("node map:\n" + render_text(node_map))
    raise_problems(start_problems(cfg, node_map), title="ppo on Ray would fail here, so nothing was started")
    with ray_session(node_map.nodes, node_map.gpus_per_node) as node_ips:
        reservation = reserve(node_map, node_ips)
        trainer = None
        try:
            trainer = PPOTrainer(cfg, lambda ctx: RayRoles(ctx, reservation))
            return trainer.fit()
        except Hung as e:  # the watchdog named what hung; a stuck worker is killed, not asked to close
            if trainer is not None:
                for line in trainer.roles.stuck_stacks(e.parties, trainer.run.dir / "watchdog"):
                    log.warning(line)
                trainer.roles.abandon()
            raise
        except Exception as e:
            groups = trainer.roles.all_groups if trainer is not None else []
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
