"""Running a batch of trajectories, each on its own clock.

The engine side is a small request-level protocol (`RequestEngine`): submit one model turn, step the
engine once, collect the turns that finished. vLLM keeps generating the other trajectories while one
waits for its environment, and a trajectory re-enters the engine the moment its environment has
answered (`schedule="trajectory"`). `schedule="turn"` waits, after every round of turns, until every
environment has answered (what turn-synchronous frameworks do; the benchmark's baseline, and the only
way an engine that generates a whole batch at once -- Hugging Face `generate` -- can run).

All engine calls happen on the scheduler's thread; environment and tool calls run on the pool's
threads (`EnvPool`), each with its deadline. A trajectory whose call runs past it ends with status
`timeout`. When more than `max_failed_share` of the batch ended by a timeout or an environment error,
the batch fails (a dead tool server must not train silently); so does any `reset` that raises, and any
environment error under `agent.on_env_error: fail`. Whatever way the loop ends, requests still in the
engine are aborted, so the engine is clean for the next batch or a checkpoint. A batch whose `cancelled()`
turns true (arrival order dropping a group too old to train) stops at once: its turns in the engine are aborted,
no further turn starts, the environment calls under way are let end, and every environment still has its last
say (`finish`: its reward, its close), so nothing it holds leaks.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Protocol

from hpcrlhf.agents.episode import Episode
from hpcrlhf.agents.pool import Call, CallTimeout, EnvPool
from hpcrlhf.errors import AgentEnvError

SCHEDULES = ("trajectory", "turn")


@dataclass(frozen=True)
class TurnRequest:
    """One model turn of a trajectory: what the model reads, how many tokens it may add, its seed."""

    key: str
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int | None


@dataclass(frozen=True)
class TurnOutput:
    key: str
    token_ids: list[int]
    logprobs: list[float]
    finished: bool
    """Ended with EOS (else cut at its token limit)."""
    versions: list[tuple[int, int]] | None = None
    """The policy versions that sampled the turn, (first index in the turn, version) per span, where the engine
    records them (an engine loop's weights change while trajectories run: `Generation.versions`); None: the
    weights the batch was launched with."""


class RequestEngine(Protocol):
    synchronous: bool
    """True: `step` generates every submitted turn at once (no trajectory can wait for another)."""

    def submit(self, request: TurnRequest) -> None: ...

    def step(self) -> list[TurnOutput]:
        """One engine iteration; the turns that finished in it."""
        ...

    def running(self) -> int: ...

    def abort(self, keys: list[str]) -> None: ...


def mixed_seed(*parts: object) -> int:
    """A stable seed from `parts` (a batch's seed, a trajectory's index, a turn): distinct per
    combination, < 2**62 (room for vLLM's per-sample offsets within int64)."""
    digest = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


@dataclass
class BatchStats:
    wall_s: float = 0.0
    engine_idle_s: float = 0.0
    """Seconds the engine had nothing to generate while some trajectory waited for its environment."""
    env_calls: int = 0
    timeouts: int = 0
    env_errors: int = 0
    abandoned_calls: int = 0


def added(parts: Sequence[BatchStats]) -> BatchStats:
    """The figures of a batch run in parts (one per engine): every count and every second added up, so
    an idle share over them is the engines' mean."""
    return BatchStats(**{f.name: sum(getattr(p, f.name) for p in parts) for f in fields(BatchStats)})


def run_episodes(engine: RequestEngine, episodes: Sequence[Episode], pool: EnvPool, *, max_new_tokens: int,
                 seed: int | None, schedule: str = "trajectory", max_failed_share: float = 1.0,
                 first: int = 0, cancelled: Callable[[], bool] | None = None) -> BatchStats:
    """Run `episodes` to their ends on `engine`; their records and tokens hold the results. Turn t of
    episode i is sampled with `mixed_seed(seed, first + i, t)` (None: the engine's own stream; `first`:
    the first episode's place in a batch split over engines). `cancelled()` true: stop (module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if engine.synchronous and schedule != "turn":
        raise ValueError("an engine that generates a batch at once runs turn by turn: use schedule='turn'")
    index = {ep.key: i for i, ep in enumerate(episodes)}
    if len(index) != len(episodes):
        raise ValueError("episodes need distinct keys")
    stats, began = BatchStats(), time.monotonic()
    limits = episodes[0].setup.limits if episodes else None
    calls: dict[Call, tuple[Episode, str]] = {}
    ready: list[Episode] = []
    in_engine: dict[str, Episode] = {}

    def call(ep: Episode, method: str) -> None:
        calls[pool.call(getattr(ep, method), timeout_s=limits.step_timeout_s, label=f"{ep.label}.{method}")] = (ep, method)
        stats.env_calls += 1

    def wait() -> None:
        """Until a call ends or the next may be due."""
        due = pool.next_deadline(calls)
        pool.wait(calls, None if due is None else max(0.0, due - time.monotonic()) + 0.005)

    def collect() -> None:
        """Apply the calls that ended; end the trajectories whose call is past its deadline."""
        for c in [c for c in calls if c.done()]:
            ep, method = calls.pop(c)
            _settled(ep, method, c, ready, limits.on_env_error, stats)
        for c in pool.overdue(calls):
            ep, _ = calls.pop(c)
            ep.end("timeout", str(c.future.exception()))
            stats.timeouts += 1
            stats.abandoned_calls += c.lost_thread  # this batch's own (a pool may serve batches at once)

    try:
        for ep in episodes:
            call(ep, "reset")
        while calls or ready or in_engine:
            if cancelled is not None and cancelled():
                if in_engine:
                    engine.abort(list(in_engine))
                    in_engine.clear()
                while calls:  # their answers are not acted on
                    wait()
                    collect()
                break
            held = schedule == "turn" and calls  # the round's ready turns wait for its other trajectories
            if calls and not in_engine and (held or not ready):  # nothing to generate: wait for an answer or a deadline
                waited = time.monotonic()
                wait()
                stats.engine_idle_s += time.monotonic() - waited
            collect()
            if schedule == "trajectory" or (not calls and not in_engine):
                for ep in ready:
                    turn = ep.record.turns
                    engine.submit(TurnRequest(ep.key, ep.context, min(max_new_tokens, ep.room),
                                              None if seed is None else mixed_seed(seed, first + index[ep.key], turn)))
                    in_engine[ep.key] = ep
                ready = []
            if engine.running():
                for out in engine.step():
                    ep = in_engine.pop(out.key)
                    ep.add_model(out.token_ids, out.logprobs, out.finished, out.versions)
                    call(ep, "after_turn")
            elif in_engine:
                raise RuntimeError(f"the engine runs nothing, but turns of {sorted(in_engine)[:3]} never came back")
        # the environments' last say (get_reward, close), on the pool as well
        for ep in episodes:
            if ep.record.status != "timeout":
                call(ep, "finish")
        while calls:
            wait()
            collect()
    finally:
        if in_engine:
            engine.abort(list(in_engine))
    stats.wall_s = time.monotonic() - began
    failed = [ep for ep in episodes if ep.record.status in ("timeout", "env_error")]
    if episodes and len(failed) > max_failed_share * len(episodes):
        raise AgentEnvError(f"{len(failed)} of {len(episodes)} trajectories ended by a timeout or an environment error, "
                            f"more than agent.max_failed_share ({max_failed_share:g}); the first: {failed[0].record.error}")
    return stats


def _settled(ep: Episode, method: str, c: Call, ready: list[Episode], on_env_error: str, stats: BatchStats) -> None:
    """Apply what the finished call `c` (`ep.method`) gave."""
    try:
        outcome = c.result()
    except CallTimeout as e:
        ep.end("timeout", str(e))
        stats.timeouts += 1
        return
    except AgentEnvError as e:
        if method == "reset" or on_env_error == "fail":
            raise
        ep.end("env_error", str(e))
        stats.env_errors += 1
        return
    if method == "reset":
        ep.start(outcome)
        ready.append(ep)
    elif method == "after_turn":
        ep.apply(outcome)
        if not ep.ended:
            ready.append(ep)
