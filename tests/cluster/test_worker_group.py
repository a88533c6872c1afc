"""Waiting on Ray workers (`hpcrlhf.cluster.worker_group.gather`) on the package's real Ray cluster."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from hpcrlhf.cluster.worker_group import RoleWorker, busy, gather
from hpcrlhf.run.signals import STOP_SIGNALS, StopFlag, StopRequested


@pytest.mark.slow
def test_an_interruptible_gather_leaves_work_that_never_returns_on_a_stop_request(ray_cluster):
    """The reward role runs the user's rules, which may never return: the driver stops waiting for
    them when it is asked to stop (issue 36), instead of hanging until they end."""
    import ray

    @ray.remote(num_cpus=1)
    def forever() -> None:
        time.sleep(3600)

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, *STOP_SIGNALS)}
    ref = forever.remote()
    try:
        StopFlag().install()
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        start = time.monotonic()
        with pytest.raises(StopRequested):
            gather([ref], interruptible=True)
        assert time.monotonic() - start < 10
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        ray.cancel(ref, force=True)


class Items(RoleWorker):
    @busy
    def items(self, n: int, seconds: float):
        for i in range(n):
            time.sleep(seconds)
            yield i


def test_a_generator_methods_busy_time_is_the_time_making_its_items():
    """Not the time its caller held an item (an engine streaming groups while the driver scores them)."""
    worker = Items("vllm", 0, 1)
    items = worker.items(3, 0.1)
    assert worker.busy_s == 0.0  # nothing made until asked
    assert next(items) == 0
    time.sleep(0.5)  # the caller holds item 0
    assert list(items) == [1, 2]
    assert 0.3 <= worker.pop_busy() < 0.5


def test_a_watched_gather_names_the_worker_it_waits_for_and_ends_at_the_deadline(ray_cluster, tmp_path):
    """The Ray driver's waits under the watchdog (issue 41): a gather polls, names the workers whose tasks are
    still pending (here the one of two that never answers), and raises WaitExpired at the deadline -- not a
    SystemError from inside Ray's wait, where the watchdog's signal lands."""
    import ray

    from hpcrlhf.cluster.worker_group import LIVE_GROUPS
    from hpcrlhf.config.schema import WatchdogConfig
    from hpcrlhf.run.watchdog import Watchdog, WaitExpired

    @ray.remote(num_cpus=0)
    class Sleeper:
        def nap(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    a, b = Sleeper.remote(), Sleeper.remote()
    ray.get([a.nap.remote(0), b.nap.remote(0)])

    class Critic:  # the workers' group, as the driver's WorkerGroup names them
        def owner(self, actor_id: str) -> str | None:
            return {a._actor_id.hex(): "critic rank 0", b._actor_id.hex(): "critic rank 1"}.get(actor_id)

    critic = Critic()
    LIVE_GROUPS.add(critic)
    dog = Watchdog(WatchdogConfig(first_s=2, floor_s=1, grace_s=120), tmp_path).start()
    try:
        start = time.monotonic()
        with pytest.raises(WaitExpired) as hung, dog.phase("train"):
            gather([a.nap.remote(0.2), b.nap.remote(3600)])
        assert 2 <= time.monotonic() - start < 10
        assert hung.value.expiry.parties == ("critic rank 1",), hung.value.expiry
        assert "critic rank 1" in hung.value.expiry.message() and list(tmp_path.glob("hang-*critic_rank_1.txt"))
        assert gather([a.nap.remote(0.1)]) == [0.1]  # no watched phase: an ordinary gather
    finally:
        dog.stop()
        ray.kill(a)
        ray.kill(b)


class Napper(RoleWorker):
    def nap_forever(self) -> None:
        time.sleep(3600)


@pytest.mark.slow
def test_a_stuck_workers_stacks_are_read_where_it_runs(ray_cluster):
    """What the watchdog writes for a stuck Ray worker (issue 41): a worker busy in a method that never returns
    writes its stacks on the signal (faulthandler, armed by RoleWorker), read by a task pinned to its node; a
    stopped worker writes none, and the text says so before py-spy's reading (or why there is none)."""
    import ray

    from hpcrlhf.cluster.worker_group import worker_stacks

    napper = ray.remote(num_cpus=0)(Napper).remote("critic", 1, 2)
    try:
        where = ray.get(napper.whereabouts.remote())
        assert where.node_id in {n["NodeID"] for n in ray.nodes()} and where.stacks_fd is not None, where
        napper.nap_forever.remote()
        time.sleep(1.0)
        (text,) = worker_stacks([where])
        assert "in nap_forever" in text, text
        os.kill(where.pid, signal.SIGSTOP)  # the test cluster's node is this host
        try:
            (text,) = worker_stacks([where], wait_s=1.0)
        finally:
            os.kill(where.pid, signal.SIGCONT)
        assert text.startswith(f"(process {where.pid} wrote no stacks within 1 s of signal"), text
    finally:
        ray.kill(napper)
