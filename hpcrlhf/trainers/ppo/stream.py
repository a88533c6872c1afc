"""Arrival order (rollout.stream_order: arrival): each step trains the first groups its engine finishes.

In plan order (`trainers.ppo.staleness`) step s trains its planned prompts, and waits for the last of their
samples. In arrival order the prompts still come in the plan's order -- group (t, i) is prompt i of step t's
planned prompts, sampled with step t's seed as the plan samples it -- but they are handed out one group at a time
(a prompt's n samples) as the rule for k allows, and step s takes the first G groups (rollout.prompts_per_step)
that ended, in the order they ended: a straggler no longer holds a step; it is trained by a later one.

The rule for k (design 3.2; v = the policy version the engine holds, A the groups admitted since the run began, R
those rejected):
- admission (`admits`): a group may start iff A - R < (v + k + 1) G -- AReaL's capacity in these counters: what
  starts now can be trained within k updates, the pool under way or waiting is at most (k + 1) G groups;
- the guarantee: at step s a group whose first token is older than s - k (its head, `head_version`) can no longer
  be trained; it is dropped -- cancelled on the engine if still under way -- counted (`stream/dropped_groups`) and
  its prompt goes back to the front of the queue (`stream/requeued_prompts`), so that every prompt of the run is
  still trained once (TRL and prime-rl discard instead; here an epoch keeps its prompts). With
  rollout.stale_groups keep there is no such guarantee (the Tinker cookbook's and Agent Lightning's way): a slow
  group is trained when it ends, however old (`stream/overage_groups`), so that a response longer than k steps
  does not start over at each drop; admission alone bounds how far generation runs ahead.
A group's staleness is that of its head, at most k (with drop); with rollout.partial its later tokens are newer.

The state -- the ledger (`Ledger`: hand-outs, the requeued queue, counters, and which step trained or dropped
which group) and the groups admitted and not yet trained -- goes into a checkpoint (`stream_rank0.pt`): ended
groups whole, those under way as far as they got (rollout.partial: the engine loop's `suspend`; else waited for).
A run resumed from it loses and repeats no group; which groups a step takes depends on when they end (the host's
timing), so a resumed arrival run is not equal to an uninterrupted one -- use rollout.stream_order plan for that.
"""

from __future__ import annotations

import bisect
import contextlib
import queue
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpcrlhf.engines.rollout import Generation
from hpcrlhf.engines.rollout.contract import Groups, head_version, stamp_version
from hpcrlhf.engines.rollout.loop import LOOP_PARTY, WAIT_S, EngineLoopError
from hpcrlhf.logs import get_logger
from hpcrlhf.run.signals import watched_until, watched_wait

log = get_logger()

STREAM_FILE = "stream_rank0.pt"


def admits(version: int, k: int, per_step: int, admitted: int, rejected: int, supply: int) -> int:
    """How many groups may start now (pure): while A - R < (version + k + 1) x per_step, at most `supply` (the
    groups left to hand out)."""
    return max(0, min(supply, (version + k + 1) * per_step - (admitted - rejected)))


@dataclass
class Ledger:
    """Which groups were handed out, trained and dropped (the checkpointed counters of the rule for k).
    Group (t, i): prompt i of planned step t; `total` = planned steps x groups per step."""

    per_step: int
    total: int | None
    """None: no bound (ppo.dynamic_sampling discards groups: the plan's prompts go on into the next epochs)."""
    handed: int = 0
    """Groups handed out in plan order so far (the next is (handed // per_step, handed % per_step))."""
    requeued: list[tuple[int, int]] = field(default_factory=list)
    """Dropped groups to hand out again, before any new one (kept in plan order)."""
    admitted: int = 0
    rejected: int = 0
    trained: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(t, i, head version, step that trained it), in the order they were trained."""
    dropped: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(t, i, head version, step that dropped it)."""
    discarded: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(t, i, head version, step that took it): ended and not trained, not handed out again (ppo.dynamic_sampling:
    its samples all scored alike, or its step had its quota)."""

    def supply(self) -> int:
        left = self.total - self.handed if self.total is not None else sys.maxsize // 2
        return left + len(self.requeued)

    def hand_out(self) -> tuple[int, int]:
        """The next group to start: a requeued one first, else the plan's next; counted as admitted."""
        self.admitted += 1
        if self.requeued:
            return self.requeued.pop(0)
        self.handed += 1
        return divmod(self.handed - 1, self.per_step)

    def reject(self, group: tuple[int, int], version: int, step: int) -> None:
        self.rejected += 1
        self.dropped.append((*group, version, step))
        bisect.insort(self.requeued, group)

    def discard(self, group: tuple[int, int], version: int, step: int) -> None:
        self.rejected += 1
        self.discarded.append((*group, version, step))


@dataclass
class StreamGroup:
    """A group admitted and not yet trained: under way (`batch`, a `Pending` of one prompt), ended
    (`generations`, at `ended`), or kept under way by a checkpoint (`state`, to be relaunched)."""

    step: int
    index: int
    version: int
    """The policy version the engine held at its launch (its head's, unless a checkpoint's relaunch)."""
    prompt: Any
    batch: Any = None
    generations: list[Generation] | None = None
    ended: float | None = None
    state: Any = None
    listed: bool = False
    """Whether it is in the stream's `ready` list (ended, waiting for a step)."""

    @property
    def key(self) -> tuple[int, int]:
        return self.step, self.index

    def poll(self) -> bool:
        """Whether it ended (its generations kept, each stamped with the launch version where the engine recorded
        none); raises the engine's error if it failed."""
        if self.generations is None and self.batch is not None and self.batch.done():
            self.generations = self.batch.result()[0]
            stamp_version(self.generations, self.version)
            self.ended, self.batch = self.batch.finished(), None
        return self.generations is not None

    def head(self) -> int:
        """The version of its oldest token: its first sample's head, or its launch version while under way (a bound:
        its first token may have come after a sync, under newer weights; `drop_stale` may so drop a group one step
        early, never keep one too old)."""
        return min(head_version(g) for g in self.generations) if self.generations else self.version


class StreamTake:
    """Step s's groups as the engine ends them (a `Pending`): the first `count` groups of the stream's `ready`
    list, those that ended before the step began first. `prompts` fills as they come (slot order). `keyed`: each
    group's generations come with its key, (key, generations) -- for ranks that know their prompts by it."""

    def __init__(self, stream: RolloutStream, count: int, keyed: bool = False) -> None:
        self.stream, self.count, self.keyed = stream, count, keyed
        self.launched = time.monotonic()
        self.prompts: list[Any] = []
        self.groups: list[StreamGroup] = []
        self._finished: float | None = None

    def as_finished(self) -> Iterator[Groups]:
        stream = self.stream
        while len(self.groups) < self.count:
            watched_wait(stream.await_ended, stream.parties, poll_s=WAIT_S)
            new = stream.ready[:self.count - len(self.groups)]
            del stream.ready[:len(new)]
            for g in new:
                del stream.pool[g.key]
                g.listed = False
            first = len(self.groups)
            self.groups += new
            self.prompts += [g.prompt for g in new]
            if len(self.groups) == self.count:
                self._finished = time.monotonic()
            yield [(first + j, self._item(g)) for j, g in enumerate(new)]

    def _item(self, g: StreamGroup) -> Any:
        return (g.key, list(g.generations)) if self.keyed else list(g.generations)

    def result(self) -> list[Any]:
        for _ in self.as_finished():
            pass
        return [self._item(g) for g in self.groups]

    def finished(self) -> float | None:
        return self._finished


class RolloutStream:
    """The groups of an arrival-order run (module docstring).

    `launch(t, i, version)` starts group (t, i) -- (its prompt, its `Pending`); `cancel(batches)` drops batches
    under way; `suspend(batches)` / `relaunch(state)` keep and continue batches under way (rollout.partial), or
    None where a checkpoint waits for them. A batch with `add_done_callback` says when it ends (each ended group
    costs O(1) to find); one without is polled."""

    def __init__(self, ledger: Ledger, k: int, launch: Callable[[int, int, int], tuple[Any, Any]],
                 cancel: Callable[[Sequence[Any]], None], suspend: Callable[[Sequence[Any]], list] | None = None,
                 relaunch: Callable[[Any], Any] | None = None,
                 parties: Callable[[], list[str]] = lambda: [LOOP_PARTY], keep_stale: bool = False) -> None:
        """`parties()`: whom a wait for groups names to the watchdog; `keep_stale`: rollout.stale_groups keep (no
        group is dropped for age)."""
        self.ledger, self.k, self.parties, self.keep_stale = ledger, k, parties, keep_stale
        self._launch, self._cancel, self._suspend, self._relaunch = launch, cancel, suspend, relaunch
        self.pool: dict[tuple[int, int], StreamGroup] = {}
        """The groups admitted and not yet taken nor dropped, by key."""
        self.ready: list[StreamGroup] = []
        """The pool's groups that ended, in the order they ended (a step takes from the front)."""
        self._ends: queue.SimpleQueue[StreamGroup] = queue.SimpleQueue()
        """Groups whose batches said they ended (their engine's thread), not yet looked at."""
        self._polled: list[StreamGroup] = []
        """Groups under way whose batches cannot say when they end."""
        self._dropped_before: set[tuple[int, int]] = set()
        self.counts = {"admitted": 0, "dropped": 0}
        """Since the step began (`step_metrics`)."""
        self._going: tuple[float, list[StreamGroup]] = (0.0, [])
        """When the step's groups were in, and the groups then under way (`overlap`)."""

    # -- the groups that end -----------------------------------------------------------------------
    def _watch(self, g: StreamGroup) -> None:
        tell = getattr(g.batch, "add_done_callback", None)
        if tell is not None:
            tell(lambda: self._ends.put(g))
        else:
            self._polled.append(g)

    def _collect(self, first: StreamGroup | None = None) -> None:
        """Move the groups that ended since the last look into `ready`, in the order they ended."""
        told = [first] if first is not None else []
        while True:
            try:
                told.append(self._ends.get_nowait())
            except queue.Empty:
                break
        polled = [g for g in self._polled if g.poll()]
        if polled:
            self._polled = [g for g in self._polled if g.generations is None]
        new = [g for g in told + polled if self.pool.get(g.key) is g and not g.listed and g.poll()]
        for g in sorted(new, key=lambda g: g.ended):
            g.listed = True
            self.ready.append(g)

    def await_ended(self, seconds: float) -> bool:
        """Wait up to `seconds` for an ended group in `ready` (a poll for `watched_wait`)."""
        self._collect()
        if self.ready:
            return True
        try:
            first = self._ends.get(timeout=min(seconds, 0.005) if self._polled else seconds)
        except queue.Empty:
            first = None
        self._collect(first)
        return bool(self.ready)

    # -- the rule for k ---------------------------------------------------------------------------
    def drop_stale(self, step: int) -> list[StreamGroup]:
        """Drop the groups step `step` and later can no longer train (head older than step - k): those under way
        are cancelled; their prompts go back to the front of the queue. None with `keep_stale`."""
        self._collect()
        if self.keep_stale:
            return []
        for g in self.pool.values():
            g.poll()
        stale = [g for g in self.pool.values() if g.head() < step - self.k]
        self._cancel([g.batch for g in stale if g.batch is not None])
        gone = {g.key for g in stale}
        self.ready = [g for g in self.ready if g.key not in gone]
        self._polled = [g for g in self._polled if g.key not in gone]
        for g in stale:
            del self.pool[g.key]
            self.ledger.reject(g.key, g.head(), step)
            if g.key in self._dropped_before:  # longer than k steps: dropped each time, trained when the prompts end
                log.warning(f"arrival order: the group of step {g.step + 1}'s prompt {g.index} was dropped again at "
                            f"step {step + 1} (not done within rollout.max_staleness={self.k} updates of its start): "
                            "responses that take longer than k steps to generate are held back "
                            + ("until the prompts run out" if self.ledger.total is not None else
                               "for good (with ppo.dynamic_sampling the prompts never run out)")
                            + "; raise rollout.max_staleness, set rollout.stale_groups=keep (trained when it ends, "
                              "however old), or use rollout.stream_order=plan")
            self._dropped_before.add(g.key)
        self.counts["dropped"] += len(stale)
        return stale

    def admit(self, version: int, beyond: int = 0) -> int:
        """Start the groups the rule lets start with the engine at `version` (the groups a checkpoint kept under
        way go on first), counting `beyond` groups taken by this step as rejected already (ppo.dynamic_sampling:
        a step that takes r rounds of G groups trains G of them); how many started."""
        for g in self.pool.values():
            if g.state is not None:
                g.batch, g.state = self._relaunch(g.state), None
                self._watch(g)
        ledger = self.ledger
        count = admits(version, self.k, ledger.per_step, ledger.admitted, ledger.rejected + beyond, ledger.supply())
        for _ in range(count):
            t, i = ledger.hand_out()
            prompt, batch = self._launch(t, i, version)
            g = self.pool[t, i] = StreamGroup(t, i, version, prompt, batch)
            self._watch(g)
        self.counts["admitted"] += count
        return count

    def take(self, count: int, keyed: bool = False) -> StreamTake:
        return StreamTake(self, count, keyed)

    def untake(self, takes: Sequence[StreamTake]) -> None:
        """A step abandoned: the groups it took wait in the pool again, first in line."""
        back = [g for take in takes for g in take.groups]
        for g in back:
            self.pool[g.key], g.listed = g, True
        self.ready[:0] = back
        for take in takes:
            take.groups = []

    def commit(self, takes: Sequence[StreamTake], step: int,
               used: Sequence[tuple[int, int]] | None = None) -> dict[str, float]:
        """The step trained the groups it took (`takes`: its rounds), or those of them `used` names -- (round,
        slot) each, ppo.dynamic_sampling's picks -- and the others are discarded: recorded in the ledger; the step's
        stream metrics."""
        picked = [(r, j) for r, take in enumerate(takes) for j in range(len(take.groups))] if used is None else used
        chosen = set(picked)
        trained = [takes[r].groups[j] for r, j in picked]
        self.ledger.trained += [(g.step, g.index, g.head(), step) for g in trained]
        left = [g for r, take in enumerate(takes) for j, g in enumerate(take.groups) if (r, j) not in chosen]
        for g in left:
            self.ledger.discard(g.key, g.head(), step)
        self._collect()
        self._going = (time.monotonic(), [g for g in self.pool.values() if not g.listed and not g.poll()])
        under_way = len(self._going[1])
        metrics = {"stream/admitted_groups": float(self.counts["admitted"]),
                   "stream/dropped_groups": float(self.counts["dropped"]),
                   "stream/discarded_groups": float(len(left)),
                   "stream/requeued_prompts": float(len(self.ledger.requeued)),
                   "stream/under_way_groups": float(under_way),
                   "stream/ended_groups": float(len(self.pool) - under_way),
                   "stream/late_groups": float(sum(g.step < step for g in trained)),
                   "stream/overage_groups": float(sum(step - g.head() > self.k for g in trained))}
        self.counts = {"admitted": 0, "dropped": 0}
        return metrics

    def overlap(self) -> float:
        """The seconds the engine generated since the step's groups were in (`commit`: while the step trained):
        until now if a group then under way still is, else until the last of them ended."""
        since, going = self._going
        now = time.monotonic()
        ends = [g.ended if g.poll() else now for g in going]
        return max(0.0, min(max(ends), now) - since) if ends else 0.0

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The ledger and the pool: ended groups whole (in the order they ended), those under way as far as they got
        (`suspend`: they go on meanwhile) or, without it, waited for."""
        self._collect()
        going = [g for g in self.pool.values() if not g.poll() and g.state is None]
        kept: dict[int, Any] = {}
        if going and self._suspend is not None:
            kept = {id(g): state for g, state in zip(going, self._suspend([g.batch for g in going]))}
        for g in going if self._suspend is None else ():
            watched_until(g.poll, self.parties, poll_s=WAIT_S)
        done = {g.key for g in self.pool.values() if g.poll()}  # one look: a group may end meanwhile
        later = sorted((g for g in self.pool.values() if not g.listed and g.key in done), key=lambda g: g.ended)
        order = self.ready + later + [g for g in self.pool.values() if g.key not in done]
        groups = [{"step": g.step, "index": g.index, "version": g.version, "prompt": g.prompt,
                   "generations": g.generations, "under_way": g.state if g.state is not None else kept.get(id(g))}
                  for g in order]
        return {"ledger": self.ledger.__dict__, "groups": groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if any(g["under_way"] is not None for g in state["groups"]) and self._relaunch is None:
            raise ValueError("the checkpoint keeps groups under way on an engine loop; resume with rollout.partial")
        self.ledger = Ledger(**state["ledger"])
        self._dropped_before = {(t, i) for t, i, *_ in self.ledger.dropped}
        now = time.monotonic()
        groups = [StreamGroup(g["step"], g["index"], g["version"], g["prompt"], None, g["generations"],
                              now + 1e-6 * n if g["generations"] is not None else None, g["under_way"])
                  for n, g in enumerate(state["groups"])]
        self.pool = {g.key: g for g in groups}
        self.ready = [g for g in groups if g.generations is not None]
        for g in self.ready:
            g.listed = True

    def close(self) -> None:
        """Cancel what is under way (the run ended; nothing to cancel on a loop that stopped)."""
        with contextlib.suppress(EngineLoopError):
            self._cancel([g.batch for g in self.pool.values() if g.batch is not None])


def save_stream(state: dict[str, Any], folder: Path) -> None:
    """A stream's `state_dict` into a checkpoint folder."""
    torch.save(state, folder / STREAM_FILE)


def load_stream(stream: RolloutStream, folder: Path) -> bool:
    """The stream a checkpoint folder holds into `stream`; False when it holds none (a run in plan order)."""
    path = folder / STREAM_FILE
    if not path.exists():
        return False
    stream.load_state_dict(torch.load(path, weights_only=False))
    return True
