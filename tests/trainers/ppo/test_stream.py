"""Arrival order's rule for k (`hpcrlhf.trainers.ppo.stream`) on a scripted engine: groups end after a seeded
long-tail number of looks, steps take the first G that ended, stale groups are dropped and requeued. Checked
against the rule's own statement: nothing trained older than k, at most (k + 1) G groups started and not trained,
every planned group trained exactly once (the requeued ones later), a checkpoint in the middle changes none of it."""

from __future__ import annotations

import random
import time

import pytest

from hpcrlhf.engines.rollout import Generation
from hpcrlhf.trainers.ppo.stream import Ledger, RolloutStream, admits


def test_admits_counts_what_can_be_trained_within_k() -> None:
    # (v + k + 1) G - (A - R), at most the supply, never negative
    assert admits(0, 2, 4, 0, 0, 100) == 12  # the first step starts steps 0..2's groups
    assert admits(1, 2, 4, 12, 0, 88) == 4  # step 0 trained 4: 4 more
    assert admits(1, 2, 4, 12, 3, 91) == 7  # 3 dropped: they start again
    assert admits(4, 2, 4, 24, 0, 2) == 2  # the run's last groups: 4 may start, 2 are left
    assert admits(0, 1, 4, 9, 0, 50) == 0


def test_the_ledger_hands_out_requeued_groups_first_in_plan_order() -> None:
    ledger = Ledger(per_step=3, total=9)
    assert [ledger.hand_out() for _ in range(4)] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    ledger.reject((0, 2), version=0, step=2)
    ledger.reject((0, 1), version=0, step=2)
    assert ledger.requeued == [(0, 1), (0, 2)] and ledger.supply() == 9 - 4 + 2
    assert [ledger.hand_out() for _ in range(3)] == [(0, 1), (0, 2), (1, 1)]
    assert (ledger.admitted, ledger.rejected) == (7, 2)
    assert ledger.dropped == [(0, 2, 0, 2), (0, 1, 0, 2)]


class ScriptedBatch:
    """One group under way: it ends after `looks` calls of `done` (a long-tail draw)."""

    def __init__(self, looks: int, version: int, prompt: int) -> None:
        self.looks, self.version, self.prompt = looks, version, prompt
        self.cancelled = False
        self._finished: float | None = None

    def done(self) -> bool:
        assert not self.cancelled, "a cancelled group was waited for"
        self.looks -= 1
        if self.looks <= 0 and self._finished is None:
            self._finished = time.monotonic()
        return self._finished is not None

    def finished(self) -> float | None:
        return self._finished

    def result(self) -> list[list[Generation]]:
        return [[Generation([self.prompt], [1, 2], [-0.5, -0.5], True) for _ in range(2)]]


class ScriptedEngine:
    def __init__(self, seed: int, longest: int = 400) -> None:
        self.random, self.longest = random.Random(seed), longest
        self.launched: list[ScriptedBatch] = []

    def launch(self, t: int, i: int, version: int):
        looks = 1 + int(self.random.paretovariate(1.2))  # most end at once, a few run very long
        batch = ScriptedBatch(min(looks, self.longest), version, 100 * t + i)
        self.launched.append(batch)
        return (t, i), batch

    def cancel(self, batches) -> None:
        for b in batches:
            b.cancelled = True

    def suspend(self, batches) -> list:
        return [b.looks for b in batches]

    def relaunch(self, looks: int) -> ScriptedBatch:
        batch = ScriptedBatch(looks, -1, -1)
        self.launched.append(batch)
        return batch


def run_stream(stream: RolloutStream, steps: range, per_step: int, k: int) -> list[tuple[int, int, int, int]]:
    """Steps as the driver takes them: drop, admit at version = step, take G; the invariants at every step (with
    `keep_stale` a step may train groups older than k: counted in its metrics)."""
    overage = []
    for step in steps:
        stream.drop_stale(step)
        stream.admit(step)
        ledger = stream.ledger
        assert ledger.admitted - ledger.rejected - len(ledger.trained) <= (k + 1) * per_step
        take = stream.take(per_step)
        generations = take.result()
        assert len(generations) == per_step and take.prompts == [(g.step, g.index) for g in take.groups]
        ended = [g.ended for g in take.groups]
        assert ended == sorted(ended)  # in the order they ended
        metrics = stream.commit([take], step)
        too_old = sum(step - head > k for *_, head, s in ledger.trained if s == step)
        assert metrics["stream/overage_groups"] == too_old and (too_old == 0 or stream.keep_stale)
        overage.append(too_old)
    stream.overage = overage
    return stream.ledger.trained


def test_dynamic_sampling_rounds_take_the_next_groups_that_end_and_discard_those_left_out() -> None:
    """ppo.dynamic_sampling in arrival order: a round takes the next G groups that end (as many more start: the
    pool never runs dry), a group is informative with probability 1/2, the step trains G (informative first) and
    the rest are discarded -- never handed out again; every group handed out is trained, discarded or dropped."""
    per_step, steps, k, rounds = 4, 100, 1, 3
    engine, chance = ScriptedEngine(seed=3, longest=30), random.Random(5)
    stream = RolloutStream(Ledger(per_step, None), k, engine.launch, engine.cancel)
    for step in range(steps):
        stream.drop_stale(step)
        takes, good, bad = [], [], []
        while len(good) < per_step and len(takes) < rounds:
            stream.admit(step, beyond=max(0, len(takes) - 1) * per_step)
            assert stream.pool, "a round would wait for nothing"
            takes.append(stream.take(per_step))
            takes[-1].result()
            for j in range(per_step):
                (good if chance.random() < 0.5 else bad).append((len(takes) - 1, j))
        picks = good[:per_step] + bad[:per_step - min(per_step, len(good))]
        stream.commit(takes, step, picks)
        ledger = stream.ledger
        assert ledger.admitted - ledger.rejected - len(ledger.trained) <= (k + 1) * per_step
        assert all(step - head <= k for *_, head, s in ledger.trained if s == step)
    ledger = stream.ledger
    assert len(ledger.trained) == steps * per_step and ledger.discarded
    handed = ledger.admitted
    assert handed == len(ledger.trained) + len(ledger.discarded) + len(ledger.dropped) + len(stream.pool)
    finals = [(t, i) for t, i, *_ in ledger.trained + ledger.discarded]
    assert len(finals) == len(set(finals))  # no group trained or discarded twice
    assert not set(finals) & set(ledger.requeued)


@pytest.mark.parametrize("total, held", [(8, "until the prompts run out"), (None, "for good")])
def test_a_group_dropped_twice_is_named_with_what_becomes_of_it(total, held, caplog) -> None:
    """A group that takes longer than k steps every time it starts is dropped again and again: the second drop
    warns, naming the group, the step and its fate -- trained once the prompts run out, or never where
    ppo.dynamic_sampling makes the supply endless."""
    engine = ScriptedEngine(seed=0)
    stream = RolloutStream(Ledger(1, total), 1, engine.launch, engine.cancel)
    for step in range(5):
        stream.drop_stale(step)
        stream.admit(step)
        for g in stream.pool.values():
            if g.batch is not None:
                g.batch.looks = 10 ** 9 if g.key == (0, 0) else 1  # group (0, 0) never ends, the others at once
        take = stream.take(1)
        take.result()
        stream.commit([take], step)
    assert [(t, i) for t, i, *_ in stream.ledger.dropped] == [(0, 0), (0, 0)]
    (warning,) = [r.getMessage() for r in caplog.records if "dropped again" in r.getMessage()]
    assert warning.startswith("arrival order: the group of step 1's prompt 0 was dropped again at step 5") and held in warning


@pytest.mark.parametrize("k", [1, 2, 4])
def test_arrival_trains_every_planned_group_once_never_older_than_k(k: int) -> None:
    per_step, steps = 4, 500
    engine = ScriptedEngine(seed=k)
    stream = RolloutStream(Ledger(per_step, steps * per_step), k, engine.launch, engine.cancel)
    trained = run_stream(stream, range(steps), per_step, k)
    assert sorted((t, i) for t, i, *_ in trained) == [(t, i) for t in range(steps) for i in range(per_step)]
    ledger = stream.ledger
    assert ledger.dropped and ledger.rejected == len(ledger.dropped)  # the long tail made some too old
    dropped = {(t, i) for t, i, *_ in ledger.dropped}
    assert all(s - head > k for *_, head, s in ledger.dropped)
    # a dropped group is started again at once, at the version of the step that dropped it (or it was dropped again)
    later = {(t, i): (head, s) for t, i, head, s in trained}
    assert all(later[t, i][0] >= s and later[t, i][1] >= s for t, i, _, s in ledger.dropped)
    assert not stream.pool and not ledger.requeued and ledger.supply() == 0
    assert sum(b.cancelled for b in engine.launched) >= 1 and len(dropped) <= len(ledger.dropped)
    # arrival order: some steps trained groups planned for a later step, some for an earlier one
    assert any(t > s for t, _, _, s in trained) and any(t < s for t, _, _, s in trained)


@pytest.mark.parametrize("k", [1, 2])
def test_keeping_stale_groups_trains_each_once_when_it_ends_and_starts_none_over(k: int) -> None:
    """rollout.stale_groups keep: the same long tail, nothing dropped or cancelled -- each planned group is started
    once and trained once, when it ends; admission still holds at most (k + 1) G groups started and not trained, so
    a slow group holds a slot and fewer start; the long tail makes some groups older than k when trained, counted
    step by step (stream/overage_groups), each as old as the steps it took to end."""
    per_step, steps = 4, 500
    engine = ScriptedEngine(seed=k)
    stream = RolloutStream(Ledger(per_step, steps * per_step), k, engine.launch, engine.cancel, keep_stale=True)
    trained = run_stream(stream, range(steps), per_step, k)
    assert sorted((t, i) for t, i, *_ in trained) == [(t, i) for t in range(steps) for i in range(per_step)]
    ledger = stream.ledger
    assert not ledger.dropped and not ledger.requeued and ledger.rejected == 0
    assert len(engine.launched) == steps * per_step and not any(b.cancelled for b in engine.launched)
    assert sum(stream.overage) == sum(s - head > k for *_, head, s in trained) > 0  # the tail outlived k
    assert max(s - head for *_, head, s in trained) > k + 1


def test_a_group_that_never_ends_within_k_is_trained_once_when_kept() -> None:
    """The drop storm's case (`test_a_group_dropped_twice_is_named_with_what_becomes_of_it`) with
    rollout.stale_groups keep: the slow group is started once, never dropped, and trained when it ends, while the
    other groups go on around it."""
    engine = ScriptedEngine(seed=0)
    stream = RolloutStream(Ledger(1, 8), 1, engine.launch, engine.cancel, keep_stale=True)
    slow = None
    for step in range(8):
        stream.drop_stale(step)
        stream.admit(step)
        for g in stream.pool.values():
            if g.batch is not None and g.key == (0, 0) and slow is None:
                slow = g.batch
                slow.looks = 10 ** 9  # under way for 5 steps
            elif g.batch is not None and g.batch is not slow:
                g.batch.looks = 1
        if step == 5:
            slow.looks = 1
        take = stream.take(1)
        take.result()
        stream.commit([take], step)
    trained = {(t, i): (head, s) for t, i, head, s in stream.ledger.trained}
    assert not stream.ledger.dropped and sorted(trained) == [(t, 0) for t in range(8)]
    assert trained[0, 0][1] == 5 and trained[0, 0][1] - trained[0, 0][0] > 1  # 5 updates old, trained once
    assert sum(b is slow for b in engine.launched) == 1


@pytest.mark.parametrize("suspend", [True, False])
def test_a_checkpoint_in_the_middle_loses_and_repeats_no_group(suspend: bool) -> None:
    per_step, steps, k = 3, 200, 2
    engine = ScriptedEngine(seed=7)
    hooks = (engine.suspend, engine.relaunch) if suspend else (None, None)
    stream = RolloutStream(Ledger(per_step, steps * per_step), k, engine.launch, engine.cancel, *hooks)
    run_stream(stream, range(90), per_step, k)
    state = stream.state_dict()
    under_way = [g for g in state["groups"] if g["under_way"] is not None]
    assert bool(under_way) == suspend and all(g["generations"] is None for g in under_way)
    resumed = RolloutStream(Ledger(per_step, 0), k, engine.launch, engine.cancel, *hooks)
    resumed.load_state_dict(state)
    assert [(g.step, g.index) for g in resumed.pool.values()] == [(g["step"], g["index"]) for g in state["groups"]]
    trained = run_stream(resumed, range(90, steps), per_step, k)
    assert sorted((t, i) for t, i, *_ in trained) == [(t, i) for t in range(steps) for i in range(per_step)]
    if not suspend:  # without suspend the checkpoint waited for every group under way
        assert all(g["generations"] is not None for g in state["groups"])


def test_arrival_order_without_an_engine_loop_is_refused_at_the_start() -> None:
    """An engine that generates each batch in one call (here the hf backend's) cannot hand out groups as they end:
    the error names the setting, what this run has, and the way out -- before any group starts."""
    from types import SimpleNamespace

    from hpcrlhf.errors import ConfigError
    from hpcrlhf.trainers.ppo.arrival import ArrivalRollouts

    cfg = SimpleNamespace(placement=SimpleNamespace(runtime="local"), rollout=SimpleNamespace(backend="hf"))
    trainer = SimpleNamespace(cfg=cfg, rollout=object(), agent=None, env=SimpleNamespace(world_size=1))
    with pytest.raises(ConfigError) as refused:
        ArrivalRollouts(trainer)
    message = str(refused.value)
    assert message.startswith("rollout.stream_order: arrival") and "here: 1 local rank(s), runtime local" in message
    assert "backend hf" in message and "use rollout.stream_order=plan" in message
