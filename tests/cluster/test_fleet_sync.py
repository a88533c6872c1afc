"""`EngineFleet`'s weight syncs started early (`start_sync`, queued behind the actor's epochs) and
finished by `sync`: which push runs when, with a recording push in place of `WeightPush`."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest

from hpcrlhf.cluster.engines import EngineFleet


class RecordingPush:
    """`WeightPush`'s three calls, recorded (and the versions pushed); `start` returns `tasks` (None: the group
    must form)."""

    def __init__(self, tasks) -> None:
        self.tasks, self.calls, self.versions = tasks, [], []

    def start(self, engines, version=None):
        self.calls.append(("start", list(engines)))
        self.versions.append(version)
        return self.tasks

    def finish(self, tasks) -> None:
        self.calls.append(("finish", tasks))

    def __call__(self, engines, version=None) -> None:
        self.calls.append(("push", list(engines)))
        self.versions.append(version)


class Engines:
    """The fleet's worker group: its workers, and what was asked of all of them."""

    def __init__(self, *workers) -> None:
        self.workers, self.asked = list(workers), []

    def call_async(self, method):
        self.asked.append(method)
        return []

    def kill(self) -> None:
        self.asked.append("kill")


def test_a_started_sync_is_finished_not_redone():
    push = RecordingPush(tasks=["t"])
    fleet = EngineFleet(Engines("e0", "e1"), push)
    fleet.start_sync()
    assert push.calls == [("start", ["e0", "e1"])]
    fleet.sync()
    assert push.calls[1:] == [("finish", ["t"])]
    fleet.sync()  # nothing started: the whole push
    assert push.calls[2:] == [("push", ["e0", "e1"])]


def test_each_push_carries_the_version_of_its_sync_and_a_restarted_engine_gets_the_last_one():
    """The engines record which policy version they hold (an engine loop's spans name it): `sync(version)` pushes
    it, a push started before the version is known (`start_sync`, behind the epochs) names none, and the fleet
    keeps the last one named (a restart's push gives it: below)."""
    push = RecordingPush(tasks=None)
    fleet = EngineFleet(Engines("e0", "e1"), push)
    fleet.sync(3)
    fleet.start_sync()
    fleet.sync(4)
    fleet.sync()
    assert push.versions == [3, None, 4, 4] and fleet.version == 4


def test_a_sync_whose_group_must_form_first_waits_for_sync():
    push = RecordingPush(tasks=None)
    fleet = EngineFleet(Engines("e0"), push)
    fleet.start_sync()
    fleet.sync()
    assert push.calls == [("start", ["e0"]), ("push", ["e0"])]


def test_an_engine_replaced_after_the_start_gets_a_whole_push(ray_cluster):
    """(An engine restarted between the start and `sync`.) The started push's tasks are waited
    for, failed or not, then every engine -- the new one too -- gets the weights in a new push."""
    import ray

    tasks = [ray.put(1), ray.put(2)]
    push = RecordingPush(tasks=tasks)
    engines = Engines("e0", "e1")
    fleet = EngineFleet(engines, push)
    fleet.start_sync()
    engines.workers[1] = "e1-restarted"
    fleet.sync()
    assert push.calls == [("start", ["e0", "e1"]), ("push", ["e0", "e1-restarted"])]


@pytest.mark.parametrize("started", [False, True])
def test_close_does_not_wait_on_engines_that_may_wait_for_weights(started):
    """A run that fails between the start and `sync` (the actor's epochs raised, say) closes its
    fleet: engines possibly waiting in the weight-sync group are killed, not asked to close."""
    engines = Engines("e0")
    fleet = EngineFleet(engines, RecordingPush(tasks=["t"]))
    if started:
        fleet.start_sync()
    fleet.close()
    assert engines.asked == (["kill"] if started else ["close", "kill"])


def test_the_ray_roles_start_the_sync_only_where_nobody_sleeps_between_phases():
    """`RayRoles.learn(push=True)` queues the sync behind the epochs unless a role or the engines
    sleep between train and weight_sync (their memory must move first, at `push_weights`)."""
    from hpcrlhf.trainers.ppo.ray.roles import RayRoles

    for sleepers, push, expected in [((), True, 1), (("engines",), True, 0), (("actor",), True, 0), ((), False, 0)]:
        started = []
        roles = SimpleNamespace(phases=SimpleNamespace(enter=lambda phase: None, sleepers=sleepers), groups={},
                                rollout=SimpleNamespace(start_sync=partial(started.append, 1)))
        RayRoles.learn(roles, None, 0, [], push=push)
        assert len(started) == expected, (sleepers, push)


class Counter:
    """An engine's stand-in: answers `pop_busy` with its seconds so far (a new one starts at 0)."""

    def __init__(self, busy: float) -> None:
        self.busy = busy

    def pop_busy(self) -> float:
        out, self.busy = self.busy, 0.0
        return out

    def node_ip(self) -> str:
        return "127.0.0.1"


class LiveEngines(Engines):
    """A fleet's group of real Ray actors that `respawn` replaces (at 0 busy seconds) and no node loses."""

    def __init__(self, *busy: float) -> None:
        import ray

        self.actor = ray.remote(num_cpus=0)(Counter)
        super().__init__(*(self.actor.remote(b) for b in busy))
        self.reservation = SimpleNamespace(lost_nodes=lambda: [])

    def rank_of(self, actor_id):
        return next((r for r, w in enumerate(self.workers) if w._actor_id.hex() == actor_id), None)

    def name(self, rank: int) -> str:
        return f"vLLM engine {rank}"

    def owner(self, actor_id: str) -> str | None:
        rank = self.rank_of(actor_id)
        return None if rank is None else self.name(rank)

    def respawn(self, rank: int):
        self.workers[rank] = self.actor.remote(0.0)
        return self.workers[rank]

    def locate(self, ranks) -> None:
        import ray

        ray.get([self.workers[r].node_ip.remote() for r in ranks])


def killed(handle) -> None:
    """Kill a Ray actor and wait until it is gone (`ray.kill` returns at once)."""
    import ray

    ray.kill(handle, no_restart=True)
    with pytest.raises(ray.exceptions.RayActorError):
        while True:
            ray.get(handle.node_ip.remote())


def test_an_engine_that_died_between_steps_is_restarted_by_the_next_call_to_all_engines(ray_cluster):
    """An engine killed after a step's end is met first by whatever the next step asks of every engine (the
    driver pops their busy seconds before generating): restarted there when allowed, given the weights, and
    asked again -- the others are asked once; not allowed, its death is raised (the run ends with exit 4)."""
    import ray

    push = RecordingPush(tasks=None)
    engines = LiveEngines(1.5, 2.5)
    fleet = EngineFleet(engines, push, max_restarts=1)
    fleet.version = 7  # the last sync's
    killed(engines.workers[1])
    assert fleet.call_every("pop_busy") == [1.5, 0.0]  # engine 0's answer kept, engine 1 restarted
    assert fleet.restarts_left == 0 and push.calls == [("push", engines.workers)] and push.versions == [7]
    killed(engines.workers[0])
    with pytest.raises(ray.exceptions.ActorDiedError):
        fleet.call_every("pop_busy")
    fleet.group.kill = lambda: None
