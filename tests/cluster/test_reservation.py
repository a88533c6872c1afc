"""The node map made real on a two-node Ray cluster: every worker runs on the node and sees the
GPUs the map gives it, each role's ranks form their own process group, and a cluster that does
not match the map is refused before anything starts."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from hpcrlhf.cluster.bootstrap import RayPorts, ray_start_args, wait_for_nodes
from hpcrlhf.cluster.reservation import WORKER_SETUP, RayNode, check_cluster, order_nodes, reserve, worker_env
from hpcrlhf.cluster.worker_group import (RoleWorker, WorkerGroup, dead_worker_message, death_verdict,
                                          lost_worker_error, unreachable)
from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.errors import ConfigError, HpcrlhfError, PlacementError
from hpcrlhf.placement import Device, build_node_map
from hpcrlhf.config.jobspec import resolve_recipe


def tiny_map(*overrides: str):
    return build_node_map(load_config(PPOConfig, resolve_recipe("ppo-tiny-ray"), list(overrides)))


@pytest.mark.slow
def test_workers_run_where_the_node_map_says(ray_cluster):
    node_map = tiny_map()
    reservation = reserve(node_map)
    try:
        assert [n.ip for n in reservation.nodes] == ray_cluster.node_ips  # map node i = i-th started node
        groups = [WorkerGroup.for_role(role, RoleWorker, reservation) for role in ("actor", "critic", "ref")]
        groups.append(WorkerGroup.for_engines(RoleWorker, reservation))
        for group in groups:
            seen = group.call("whereabouts")
            assert len(seen) == len(group.placements) > 0
            for rank, (where, devices) in enumerate(zip(seen, group.placements)):
                assert (where.role, where.rank) == (group.role, rank)
                assert where.node_ip == ray_cluster.node_ips[devices[0].node], (group.role, rank)
                assert where.visible_devices == ",".join(str(d.gpu) for d in devices), (group.role, rank)
            if group.role != "vllm":
                # the role's own group: both ranks (one per node), no rank of another role
                assert group.call("check_group") == [len(group.placements)] * len(group.placements)
        # spread as planned: every role on both nodes, engines as TP-2 groups on GPUs 2-3 of each node
        assert {w.node_ip for g in groups for w in g.call("whereabouts")} == set(ray_cluster.node_ips)
        assert [(e[0].node, [d.gpu for d in e]) for e in node_map.engines] == [(0, [2, 3]), (1, [2, 3])]
        for group in groups:
            group.kill()
    finally:
        reservation.release()


@pytest.mark.slow
def test_a_peer_that_fails_first_in_a_collective_is_traced_to_the_dead_rank(ray_cluster):
    """When a rank dies, its peer in a collective may be the first to report (gloo: connection
    closed by peer, a RayTaskError). The driver must still name the dead rank, so the run ends as a
    lost worker (exit 4, requeued) and not as a crash."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    reservation = reserve(tiny_map())
    try:
        group = WorkerGroup("critic", RoleWorker, reservation, [[Device(0, 0)], [Device(1, 0)]])
        assert group.call("check_group") == [2, 2]
        ray.kill(group.workers[1])
        with pytest.raises(RayTaskError) as peer_failure:
            ray.get(group.workers[0].check_group.remote(), timeout=120)
        assert "Connection closed by peer" in str(peer_failure.value) or "Connection reset" in str(peer_failure.value)
        cause = lost_worker_error(peer_failure.value, [group])
        assert isinstance(cause, RayActorError)
        assert dead_worker_message(cause, [group]).startswith("critic rank 1 (node 1 GPU 0) died (")
        assert lost_worker_error(ValueError("a bug"), [group]) is None
        healthy = WorkerGroup("ref", RoleWorker, reservation, [[Device(0, 1)]], join=False)
        bug = RayTaskError("check_group", "Traceback ...", ValueError("a bug"))
        assert lost_worker_error(bug, [healthy]) is None  # every worker answers: a plain failure
        group.kill()
        healthy.kill()
    finally:
        reservation.release()


class WorkerWithAChild(RoleWorker):
    """A worker that forks a child process which outlives it, as a vLLM engine's actor starts its
    engine-core and worker processes (they exit seconds after it dies)."""

    def fork_child(self, seconds: float) -> int:
        import multiprocessing

        self.child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(seconds,), daemon=True)
        self.child.start()
        return self.child.pid


@pytest.mark.slow
def test_a_killed_worker_whose_child_lingers_is_named_dead_once_ray_knows(ray_cluster):
    """Killed while its child lives on, a worker is not known dead to Ray until the child exits
    (seconds for a vLLM engine): the probe behind a peer's failure and `death_verdict` (after an
    'unavailable' error) wait for Ray's word -- which decides between restarting an engine and
    ending the run -- instead of giving up after a few seconds."""
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the class travels with its code
    reservation = reserve(tiny_map())
    try:
        group = WorkerGroup("vllm", WorkerWithAChild, reservation, [[Device(0, 2)]], join=False)
        worker = group.workers[0]
        ray.get(worker.fork_child.remote(8.0))
        os.kill(group.call("whereabouts")[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        cut_off = RayTaskError("broadcast_weights", "Traceback ...", RuntimeError("Connection closed by peer"))
        assert lost_worker_error(cut_off, [group], probe_s=1.0) is None  # Ray does not know yet
        cause = lost_worker_error(cut_off, [group], probe_s=30.0)
        assert isinstance(cause, ActorDiedError) and time.monotonic() - killed > 4, cause
        assert dead_worker_message(cause, [group]).startswith("vLLM engine 0 (node 0 GPU 2) died (")
        unavailable = ActorUnavailableError("lost contact", worker._actor_id.binary())
        assert unreachable(unavailable) and isinstance(death_verdict(worker, unavailable, 30.0), ActorDiedError)
        assert death_verdict(worker, cause, 30.0) is cause  # a verdict stands
        assert not reservation.lost_nodes()  # its node lives: an engine may be restarted there
    finally:
        reservation.release()


def test_cluster_that_does_not_match_the_map_is_refused():
    node_map = tiny_map()
    one = [RayNode("a", "10.0.0.1", 4, True)]
    with pytest.raises(PlacementError, match="needs 2 nodes but the Ray cluster has 1 .*--nodes 1"):
        check_cluster(node_map, one)
    small = [RayNode("a", "10.0.0.1", 4, True), RayNode("b", "10.0.0.2", 2, False)]
    with pytest.raises(PlacementError, match=r"node 1 \(10.0.0.2\) has 2 GPUs .*--gpus-per-node 2"):
        check_cluster(node_map, small)
    with pytest.raises(PlacementError, match="expected but not in the cluster: 10.0.0.9"):
        check_cluster(node_map, small, ["10.0.0.1", "10.0.0.9"])


def test_node_order_is_the_allocations_or_head_first():
    nodes = [RayNode("b", "10.0.0.10", 4, False), RayNode("c", "10.0.0.9", 4, False), RayNode("h", "10.0.0.200", 4, True)]
    assert [n.node_id for n in order_nodes(nodes)] == ["h", "c", "b"]  # numeric, not string order
    assert [n.node_id for n in order_nodes(nodes, ["10.0.0.10", "10.0.0.200"])] == ["b", "h"]


def test_waiting_for_nodes_names_the_missing_ones():
    calls = []
    wait_for_nodes(["a", "b"], 5, alive=lambda: calls.append(1) or (["a"] if len(calls) < 3 else ["a", "b"]), poll_s=0)
    assert len(calls) == 3
    with pytest.raises(HpcrlhfError, match="1 of 2 Ray node.*did not join within 0 s: b"):
        wait_for_nodes(["a", "b"], 0, alive=lambda: ["a"])


def test_ray_start_commands_use_explicit_ports():
    ports = RayPorts.from_base(30000)
    head = ray_start_args(node_ip="10.0.0.1", ports=ports, head_address=None, num_cpus=8, num_gpus=4)
    worker = ray_start_args(node_ip="10.0.0.2", ports=RayPorts.from_base(30120), head_address="10.0.0.1:30000",
                            num_cpus=8, num_gpus=4)
    assert "--head" in head and "--port=30000" in head and "--include-dashboard=false" in head
    assert "--address=10.0.0.1:30000" in worker and "--head" not in worker
    assert "--include-log-monitor=false" in head and "--include-log-monitor=false" in worker
    # dead-node detection is chosen, not left to Ray's defaults: the head's GCS runs the checks
    (config,) = [json.loads(a.split("=", 1)[1]) for a in head if a.startswith("--system-config=")]
    assert config == {"health_check_period_ms": 2000, "health_check_timeout_ms": 6000, "health_check_failure_threshold": 5}
    used = [int(a.split("=")[1]) for a in head + worker if a.split("=")[0].endswith("port")]
    assert len(used) == len(set(used))  # no two services share a port
    with pytest.raises(HpcrlhfError, match="out of range"):
        RayPorts.from_base(65500)


def test_the_drivers_worker_variables_reach_every_worker_and_a_bad_setup_hook_fails_in_the_driver(monkeypatch):
    """HPCRLHF_WORKER_* (and nothing else of the driver's) goes into each worker's runtime environment; a setup
    hook that does not import is a ConfigError naming the variable and the value before any worker starts."""
    monkeypatch.setenv(WORKER_SETUP, "tests.trainers.faults:hang_in_worker")
    monkeypatch.setenv("HPCRLHF_WORKER_HANG", "critic:1:update:3")
    monkeypatch.setenv("HPCRLHF_CACHE", "/elsewhere")
    assert worker_env() == {WORKER_SETUP: "tests.trainers.faults:hang_in_worker", "HPCRLHF_WORKER_HANG": "critic:1:update:3"}
    monkeypatch.setenv(WORKER_SETUP, "tests.trainers.faults:no_such_hook")
    with pytest.raises(ConfigError, match=r"HPCRLHF_WORKER_SETUP='tests.trainers.faults:no_such_hook' cannot be "
                                          r"imported \(module 'tests.trainers.faults' has no 'no_such_hook'\)"):
        worker_env()
