"""The engine loop: one thread builds a vLLM engine and alone drives it, so that batches are generated while
the caller scores and trains (the local runtime with rollout.max_staleness >= 1; issue 40, design 3.4).

`StreamingRollout` is the rollout engine a trainer sees (`launch`, `generate`, `load_weights`, `close`, as
`VLLMRollout`): a batch is under way in the loop when `launch` returns (`StreamBatch`, a `Pending`), batches
share the engine (the tail of one runs beside the start of the next, so the engine's batch stays full), and
`load_weights` takes new weights with samples under way:

- `partial`: the samples under way are paused, the weights load, and they go on under the new ones
  (`VLLMStream` records each span's version); the caller waits for none of them;
- otherwise the loop drains first -- the samples under way end under the weights they began with -- and then
  the weights load: the caller's sync waits for that tail.

A batch launched after a `load_weights` starts under the new weights (the loop takes its messages in order).
With `partial` a checkpoint need not wait for the batches under way: `suspend` pauses them at the next engine
step, records what each sample has generated (`BatchState`) and lets them go on; a run resumed from it
`relaunch`es each state and every paused sample goes on exactly as it went on in the run that saved it (the
same prefix, version and continuation seed).
The loop's thread builds the engine (vLLM's CPU thread binding then holds for the thread that drives it) and
alone calls it; every other thread posts a message. A failure in the loop fails every batch under way and every
later call, naming its cause; the engine is closed with the loop.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from hpcrlhf.engines.rollout.contract import (EndCallbacks, Generation, Groups, SamplingParams, check_prompts,
                                              greedy_copies)
from hpcrlhf.engines.rollout.shared import Rank0Rollout
from hpcrlhf.engines.rollout.streaming import StreamSample, VLLMStream, sample_seeds
from hpcrlhf.engines.rollout.vllm import VLLMRollout
from hpcrlhf.engines.weight_sync import SyncStats
from hpcrlhf.logs import get_logger
from hpcrlhf.run.signals import watched_until, watched_wait

T = TypeVar("T")

WAIT_S = 1.0
"""How long a waiting caller sleeps between looks at its batch or sync (a stop signal is handled meanwhile, a
watchdog's expired deadline raises: `hpcrlhf.run.watchdog`)."""
CLOSE_S = 60.0
"""How long `EngineLoop.close` waits for the loop's thread (an engine step that never returns holds it)."""
LOOP_PARTY = "the vLLM engine loop (thread hpcrlhf-engine-loop)"
"""Whom a wait on the loop names to the watchdog."""

log = get_logger()

_CLOSE = object()


@dataclass(frozen=True)
class EngineLoad:
    """What an engine loop did since the last look (`EngineLoop.pop_load`)."""

    busy_s: float
    """Seconds spent in engine steps (the rest the engine had nothing to run)."""
    steps: int
    rows_per_step: float
    """Samples under way in the mean engine step: how full the engine's batch was kept."""
    reprefilled: int = 0
    """Tokens of paused samples' prefixes prefilled again (`VLLMStream.reprefilled`): what partial rollouts cost."""


@dataclass
class BatchState:
    """A batch under way as a checkpoint keeps it (`EngineLoop.suspend`, `EngineLoop.relaunch`): `count`
    prompts of `n` samples (`greedy`: sampled once, copied), those ended whole and the others as far as they
    got (tokens, log-probs, spans, segment: `StreamSample`), each with its prompt and sample index."""

    count: int
    n: int
    greedy: bool
    ended: list[tuple[int, int, Generation]]
    under_way: list[tuple[int, int, StreamSample]]


class Sink(Protocol):
    """Who is given the samples of a loop's caller as they end (the loop's thread): a `StreamBatch`, a
    `LoopTurns`."""

    def add(self, i: int, j: int, generation: Generation) -> None:
        """Sample j of prompt (or turn) i ended."""

    def fail(self, error: BaseException) -> None:
        """The loop stopped with this sink's samples under way."""


class EngineLoopError(RuntimeError):
    """The engine loop stopped on an error (the cause is chained): nothing more runs on its engine."""


class StreamBatch:
    """A batch under way in an engine loop (`Pending`): each prompt's group once all its samples ended."""

    def __init__(self, count: int, n: int, greedy: bool) -> None:
        self.launched = time.monotonic()
        self._cond = threading.Condition()
        self.count, self.n, self.greedy = count, n, greedy
        self._copies = n if greedy else 1  # a greedy prompt is sampled once and copied
        self._samples: list[list[Generation | None]] = [[None] * (n // self._copies) for _ in range(count)]
        self._left = [len(s) for s in self._samples]
        self._done: list[int] = []
        """Prompts whose groups are complete, in the order they completed."""
        self._given = 0
        self._finished: float | None = None if count else self.launched
        self._error: BaseException | None = None
        self.cancelled = False
        """Dropped for good (`EngineLoop.cancel`): it never finishes; a wait on it ends with what it has."""
        self._on_end = EndCallbacks()
        if not count:
            self._on_end.fire()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call `fn()` once the batch ended or failed (at once if it did; else on the loop's thread)."""
        self._on_end.add(fn)

    def add(self, i: int, j: int, generation: Generation) -> None:
        """Sample j of prompt i ended (the loop's thread)."""
        with self._cond:
            self._samples[i][j] = generation
            self._left[i] -= 1
            if not self._left[i]:
                self._done.append(i)
                if len(self._done) == len(self._samples):
                    self._finished = time.monotonic()
                self._cond.notify_all()
        if self._finished is not None:
            self._on_end.fire()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()
        self._on_end.fire()

    def cancel(self) -> None:
        with self._cond:
            self.cancelled = True
            self._cond.notify_all()

    def ended(self) -> list[tuple[int, int, Generation]]:
        """Each sample that ended so far, with its prompt and sample index."""
        with self._cond:
            return [(i, j, g) for i, gens in enumerate(self._samples) for j, g in enumerate(gens) if g is not None]

    def _wait(self, ready: Callable[[], bool]) -> None:
        def poll(seconds: float) -> bool:
            with self._cond:
                self._cond.wait_for(lambda: ready() or self._error is not None, seconds)
                if not ready() and self._error is not None:
                    raise EngineLoopError(f"the engine loop stopped with this batch under way: {self._error}") \
                        from self._error
                return ready()

        watched_wait(poll, lambda: [LOOP_PARTY], poll_s=WAIT_S)

    def _group(self, i: int) -> list[Generation]:
        gens = self._samples[i]
        return greedy_copies(gens[0], self._copies) if self._copies > 1 else list(gens)  # type: ignore[arg-type]

    def result(self) -> list[list[Generation]]:
        self._wait(lambda: len(self._done) == len(self._samples))
        return [self._group(i) for i in range(len(self._samples))]

    def finished(self) -> float | None:
        return self._finished

    def done(self) -> bool:
        """Whether every group ended, without waiting; EngineLoopError if the loop stopped before."""
        with self._cond:
            if self._finished is None and self._error is not None:
                raise EngineLoopError(f"the engine loop stopped with this batch under way: {self._error}") \
                    from self._error
            return self._finished is not None

    def as_finished(self) -> Iterator[Groups]:
        """The groups as they end; a cancelled batch's stop where it was cancelled."""
        while self._given < len(self._samples) and not self.cancelled:
            self._wait(lambda: len(self._done) > self._given or self.cancelled)
            with self._cond:
                new, self._given = self._done[self._given:], len(self._done)
            if new:  # (none: cancelled)
                yield [(i, self._group(i)) for i in new]


class EngineLoop:
    """A thread that builds an engine (`make_engine()`, a `VLLMRollout`) and alone drives it through a
    `VLLMStream` (`partial`: samples can be paused across a weight update). Every method posts a message the
    loop runs in order between engine steps."""

    def __init__(self, make_engine: Callable[[], VLLMRollout], *, partial: bool,
                 name: str = "hpcrlhf-engine-loop") -> None:
        self.partial = partial
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._owners: dict[str, tuple[Sink, int, int]] = {}
        """A sample's key -> its sink (a batch, an agent scheduler's turns), prompt and sample index (the loop's
        thread only)."""
        self._batch_ids = itertools.count()
        self._load = [0.0, 0, 0]
        """Seconds in engine steps, steps, samples under way summed over them (since `pop_load`)."""
        self._reprefilled = 0
        """`VLLMStream.reprefilled` at the last `pop_load`."""
        self.stream: VLLMStream | None = None
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(make_engine, built), name=name, daemon=True)
        self._thread.start()
        self.engine: VLLMRollout = built.result()

    # -- the loop's thread -------------------------------------------------------------------------
    def _run(self, make_engine: Callable[[], VLLMRollout], built: Future) -> None:
        try:
            engine = make_engine()
        except BaseException as e:
            built.set_exception(e)
            return
        try:
            self.stream = VLLMStream(engine, SamplingParams(), engine.version, partial=self.partial)  # params: each batch's
            built.set_result(engine)
            while True:
                try:
                    message = self._inbox.get(block=not self.stream.running())
                except queue.Empty:
                    self._step()
                    continue
                if message is _CLOSE:
                    break
                work, future = message
                try:
                    future.set_result(work())
                except BaseException as e:  # it fails the loop too: the stream may be half changed
                    future.set_exception(e)
                    raise
        except BaseException as e:
            self._fail(e)
        finally:
            if not built.done():
                built.set_exception(self._error or EngineLoopError("the engine loop ended before it started"))
            engine.close()
        self._fail(EngineLoopError("the engine loop was closed"))

    def _step(self) -> None:
        """One engine step; the samples that ended go to their batches."""
        assert self.stream is not None
        rows, began = len(self.stream.requests), time.perf_counter()
        ended = self.stream.step()
        with self._lock:
            self._load[0] += time.perf_counter() - began
            self._load[1] += 1
            self._load[2] += rows
        for key, generation in ended:
            owner = self._owners.pop(key, None)
            if owner is not None:  # (None: its batch was cancelled after the sample ended)
                owner[0].add(owner[1], owner[2], generation)

    def _fail(self, error: BaseException) -> None:
        """Every batch under way and every message not yet run fail with `error`; later calls too."""
        with self._lock:
            if self._error is None:
                self._error = error
            while True:
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if message is not _CLOSE:
                    message[1].set_exception(EngineLoopError(f"the engine loop stopped: {self._error}"))
        for batch in {batch for batch, _, _ in self._owners.values()}:
            batch.fail(self._error)
        self._owners.clear()

    def _launch(self, batch: StreamBatch, number: int, prompts: Sequence[Sequence[int]],
                params: SamplingParams) -> None:
        assert self.stream is not None
        for i, prompt in enumerate(prompts):
            for j, seed in enumerate(sample_seeds(params, i)[:1 if params.greedy else None]):
                key = f"b{number}.{i}.{j}"
                self._owners[key] = (batch, i, j)
                self.stream.submit(key, prompt, seed, params=params.at(i))

    def _suspend(self, batches: Sequence[StreamBatch]) -> list[BatchState]:
        assert self.stream is not None
        self.stream.pause()
        try:
            states = {id(b): BatchState(b.count, b.n, b.greedy, [], []) for b in batches}
            for b in batches:
                states[id(b)].ended += b.ended()
            for key, generation in self.stream.ended:  # cut at its length: given to its batch at the next step
                batch, i, j = self._owners[key]
                if id(batch) in states:
                    states[id(batch)].ended.append((i, j, generation))
            for key, sample in self.stream.samples.items():
                batch, i, j = self._owners[key]
                if id(batch) in states:
                    states[id(batch)].under_way.append((i, j, replace(sample, tokens=list(sample.tokens),
                                                                      logprobs=list(sample.logprobs),
                                                                      versions=list(sample.versions))))
        finally:
            self.stream.resume()
        return [states[id(b)] for b in batches]

    def _relaunch(self, batch: StreamBatch, number: int, state: BatchState) -> None:
        assert self.stream is not None
        for i, j, sample in state.under_way:
            key = f"b{number}.{i}.{j}"
            self._owners[key] = (batch, i, j)
            self.stream.resubmit(replace(sample, key=key))

    def _cancel(self, batches: Sequence[StreamBatch]) -> None:
        assert self.stream is not None
        drop = {id(b) for b in batches}
        keys = [key for key, (owner, _, _) in self._owners.items() if id(owner) in drop]
        self.stream.abort(keys)
        for key in keys:
            del self._owners[key]

    def _submit_turn(self, sink: Sink, i: int, number: int, prompt_ids: list[int], seed: int | None,
                     max_new_tokens: int, params: SamplingParams) -> None:
        assert self.stream is not None
        key = f"t{number}.{i}"
        self._owners[key] = (sink, i, 0)
        self.stream.submit(key, prompt_ids, seed, max_new_tokens=max_new_tokens, params=params)

    def _abort_turns(self, number: int, ids: Sequence[int]) -> None:
        assert self.stream is not None
        keys = [f"t{number}.{i}" for i in ids]
        self.stream.abort(keys)
        for key in keys:
            self._owners.pop(key, None)

    def _publish(self, version: int, receive: Callable[[], T]) -> T:
        assert self.stream is not None
        if self.partial:
            return self.stream.publish(version, receive)
        while self.stream.running():  # drain: what runs ends under the weights it began with
            self._step()
        result = receive()
        self.stream.version = version
        return result

    # -- any other thread ------------------------------------------------------------------------
    def post(self, work: Callable[[], T]) -> Future:
        """Run `work()` on the loop's thread, between engine steps; its future."""
        future: Future = Future()
        with self._lock:
            if self._error is not None:
                raise EngineLoopError(f"the engine loop stopped: {self._error}") from self._error
            self._inbox.put((work, future))
        return future

    def launch(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> StreamBatch:
        """`params.n` samples of each prompt (seeded as `VLLMRollout.generate` seeds a batch), under way when
        this returns."""
        check_prompts(prompts)
        batch = StreamBatch(len(prompts), params.n, params.greedy)
        prompts, number = [[int(t) for t in p] for p in prompts], next(self._batch_ids)
        self.post(lambda: self._launch(batch, number, prompts, params))
        return batch

    def cancel(self, batches: Sequence[StreamBatch]) -> None:
        """Drop `batches` (under way in this loop) for good: their samples under way are aborted at the next engine
        step; the batches never finish (a stream of their groups ends where it is)."""
        for batch in batches:
            batch.cancel()
        if batches:
            self.post(lambda: self._cancel(list(batches)))

    def turns(self, params: SamplingParams) -> LoopTurns:
        """A request-level face of this loop (`hpcrlhf.agents.scheduler.RequestEngine`) for one caller: an agent
        scheduler's model turns generated beside the loop's other samples, sampled as `params` say."""
        return LoopTurns(self, next(self._batch_ids), params)

    def suspend(self, batches: Sequence[StreamBatch]) -> list[BatchState]:
        """What each of `batches` (under way in this loop) has generated so far, for a checkpoint: at the next
        engine step every sample under way is paused, recorded and continued (`partial` only)."""
        if not self.partial:
            raise EngineLoopError("an engine loop without `partial` cannot pause its samples: wait for the batches")
        future = self.post(lambda: self._suspend(batches))
        watched_until(future.done, lambda: [LOOP_PARTY], poll_s=WAIT_S)
        return future.result()

    def relaunch(self, state: BatchState) -> StreamBatch:
        """A batch a checkpoint kept (`suspend`) under way again: its samples go on under the version the engine
        holds now, each as it went on in the run that saved it."""
        batch = StreamBatch(state.count, state.n, state.greedy)
        for i, j, generation in state.ended:
            batch.add(i, j, generation)
        number = next(self._batch_ids)
        self.post(lambda: self._relaunch(batch, number, state))
        return batch

    def publish(self, version: int, receive: Callable[[], T]) -> Future:
        """Take new weights (`receive()`, on the loop's thread) of policy `version`: samples under way are paused
        and continued under them (`partial`), else finished first. Returns once `receive` has begun -- the
        caller may then send (a collective: it must not wait for a receiver that never comes) -- with its future
        (what `receive` returned); EngineLoopError if the loop stopped before (an engine step of the drain
        failed)."""
        receiving = threading.Event()

        def received() -> T:
            receiving.set()
            return receive()

        future = self.post(lambda: self._publish(version, received))
        watched_wait(lambda seconds: receiving.wait(seconds) or future.done(), lambda: [LOOP_PARTY], poll_s=WAIT_S)
        if not receiving.is_set():
            error = future.exception()
            raise EngineLoopError(f"the engine loop stopped before it took the weights of version {version}: "
                                  f"{error}") from error
        return future

    def pop_load(self) -> EngineLoad:
        """What the engine did since the last call."""
        with self._lock:
            busy, steps, rows = self._load
            self._load = [0.0, 0, 0]
        total = self.stream.reprefilled if self.stream is not None else 0
        reprefilled, self._reprefilled = total - self._reprefilled, total
        return EngineLoad(busy, steps, rows / steps if steps else 0.0, reprefilled)

    def close(self) -> None:
        """Stop the loop (samples under way are dropped) and close its engine; idempotent. A loop whose thread
        does not end within CLOSE_S (an engine step that never returns) is left behind, said in the log."""
        if self._thread.is_alive():
            self._inbox.put(_CLOSE)
            self._thread.join(CLOSE_S)
            if self._thread.is_alive():
                log.warning(f"the engine loop did not end within {CLOSE_S:g} s of its close (an engine step that does "
                            "not return): its thread is left to end with the process, its engine not closed")


TURN_WAIT_S = 0.01
"""How long `LoopTurns.step` waits for a turn to end (its caller also waits for environments meanwhile)."""


class LoopTurns:
    """Model turns on an engine loop, one caller's (`EngineLoop.turns`): `submit` posts a turn, the loop generates
    it between its other samples, `step` gives the turns that ended since the last call (waiting up to
    TURN_WAIT_S for one), each with its key, as `VLLMStream` does (`hpcrlhf.agents.requests.VLLMRequests` makes it
    the agent scheduler's `RequestEngine`). Driven by one thread."""

    def __init__(self, loop: EngineLoop, number: int, params: SamplingParams) -> None:
        self.loop, self.number, self.params = loop, number, replace(params, n=1)
        self._cond = threading.Condition()
        self._ended: list[tuple[int, Generation]] = []
        self._error: BaseException | None = None
        self._keys: dict[int, str] = {}
        """Each turn under way: its number here -> the caller's key."""
        self._ids = itertools.count()

    def submit(self, key: str, prompt_ids: Sequence[int], seed: int | None, max_new_tokens: int) -> None:
        """A turn of `prompt_ids` (`seed`: its own) of at most `max_new_tokens`."""
        i, prompt = next(self._ids), [int(t) for t in prompt_ids]
        self._keys[i] = key
        self.loop.post(lambda: self.loop._submit_turn(self, i, self.number, prompt, seed, max_new_tokens,
                                                      self.params))

    def add(self, i: int, j: int, generation: Generation) -> None:  # the loop's thread
        with self._cond:
            self._ended.append((i, generation))
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def step(self) -> list[tuple[str, Generation]]:
        with self._cond:
            self._cond.wait_for(lambda: self._ended or self._error is not None, TURN_WAIT_S)
            if self._error is not None:
                raise EngineLoopError(f"the engine loop stopped with turns under way: {self._error}") from self._error
            ended, self._ended = self._ended, []
        return [(self._keys.pop(i), g) for i, g in ended if i in self._keys]  # (not one aborted meanwhile)

    def running(self) -> int:
        return len(self._keys)

    def abort(self, keys: Sequence[str]) -> None:
        drop = set(keys)
        ids = [i for i, key in self._keys.items() if key in drop]
        for i in ids:
            del self._keys[i]
        if ids and self._error is None:
            try:
                self.loop.post(lambda: self.loop._abort_turns(self.number, ids))
            except EngineLoopError:  # a stopped loop runs nothing
                pass


class StreamingRollout:
    """A `VLLMRollout` driven by an `EngineLoop`: the local trainer's engine with rollout.max_staleness >= 1
    (module docstring). `make_engine` builds the engine on the loop's thread. It never sleeps (no `sleep`,
    `wake`): placement.vllm.sleep is refused with rollout.max_staleness >= 1 (the engine generates meanwhile) and
    with rollout.min_engine_step_s. `min_step_s`: each model step of the engine lasts at least that long
    (`VLLMRollout.set_min_step_s`)."""

    def __init__(self, make_engine: Callable[[], VLLMRollout], *, partial: bool, min_step_s: float = 0.0) -> None:
        def build() -> VLLMRollout:
            engine = make_engine()
            engine.weight_group()  # formed here, where the engine is driven; the senders reuse it
            if min_step_s:
                engine.set_min_step_s(min_step_s)
            return engine

        self.loop = EngineLoop(build, partial=partial)
        self.engine = self.loop.engine
        self.partial = partial

    @property
    def version(self) -> int:
        return self.engine.version

    def launch(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> StreamBatch:
        return self.loop.launch(prompts, params)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        return self.launch(prompts, params).result()

    def suspend(self, batches: Sequence[StreamBatch]) -> list[BatchState]:
        return self.loop.suspend(batches)

    def relaunch(self, state: BatchState) -> StreamBatch:
        return self.loop.relaunch(state)

    def cancel(self, batches: Sequence[StreamBatch]) -> None:
        self.loop.cancel(batches)

    def set_min_step_s(self, seconds: float) -> None:
        """Each engine step lasts at least `seconds` from now on (`VLLMRollout.set_min_step_s`, on the loop)."""
        self.loop.post(lambda: self.engine.set_min_step_s(seconds)).result()

    def load_weights(self, tensors: Any, version: int | None = None) -> SyncStats:
        """The weights into the engine while the loop keeps its samples (paused, or drained first): this
        thread sends them, the loop's receives."""
        engine = self.engine
        return engine.load_weights(tensors, version, receive=lambda: self.loop.publish(
            engine.version if version is None else version, lambda: engine.receive_weights("local")))

    def close(self) -> None:
        self.loop.close()


def streams(rollout: Any) -> bool:
    """Whether `rollout` generates on engine loops: a `StreamingRollout`, rank 0's one serving every local rank
    (`Rank0Rollout.streaming`), or a Ray fleet's engine actors (`hpcrlhf.cluster.engines.EngineFleet.streaming`):
    a batch launched is under way beside the step, and the batches share the engines."""
    return isinstance(rollout, StreamingRollout) or bool(getattr(rollout, "streaming", False))


def suspends(rollout: Any) -> bool:
    """Whether a checkpoint can keep `rollout`'s batches under way as far as they got (`suspend`, `relaunch`):
    an engine loop of this job's processes (`StreamingRollout`, or rank 0's serving every local rank), or a Ray
    fleet's engine actors on engine loops with rollout.partial
    (`hpcrlhf.cluster.engines.EngineFleet.suspends_batches`)."""
    return (isinstance(rollout, StreamingRollout) or (isinstance(rollout, Rank0Rollout) and rollout.streaming)
            or bool(getattr(rollout, "suspends_batches", False)))


def engine_loop(rollout: Any) -> EngineLoop | None:
    """This rank's engine loop, for its figures (`EngineLoop.pop_load`): a `StreamingRollout`'s, or under a
    `Rank0Rollout` serving every local rank rank 0's (None on the other ranks, which log no metrics)."""
    return rollout.loop if isinstance(rollout, (StreamingRollout, Rank0Rollout)) else None
