"""vLLM engines as Ray actors, one per tensor-parallel group of the node map.

An engine actor runs on its group's node and sees exactly the group's GPUs; vLLM starts its TP
workers itself with multiprocessing (never Ray: that would escape the map, and vLLM's CPU build
does not support it). The actor holds nothing but its engine, so on vLLM's CPU platform the engine
core runs inside it (`VLLMRollout(in_process=None)`): one vLLM process fewer to spawn and import per
engine, two at TP 1. Weights arrive after every actor update, broadcast in a weight-sync group
(`receive_weights`) or as a full state dict (`load_weights`). With an agent section the actor also
runs its part of a batch's multi-turn trajectories (`run_episodes_stream`): their environments and
tools run in its process, on its node's CPU cores.

With rollout.partial (k >= 1) each actor's engine runs on an engine loop (`hpcrlhf.engines.rollout.loop`):
batches launched share the engine, and a weight sync pauses the samples under way, loads the weights and lets
them go on under them (each span's version recorded). The actor is then threaded: its calls keep their order in
the default concurrency group (`launch`, `receive_weights`, ...: a batch launched before a sync starts under the
weights it was launched with), while each batch's stream of finished groups (`stream_batch`) waits in a group of
its own (STREAMS). A checkpoint keeps the batches under way as far as each engine got (`suspend`, `relaunch`:
`EngineFleet.suspend` gives a `FleetState`). Arrival order (rollout.stream_order: arrival) runs each engine on an
engine loop too, with or without partial: each group is a batch of one prompt, sent to the engine with the fewest
such groups under way, and a group too old to train is cancelled where it runs (`cancel`). With an agent section a
group is its prompt's trajectories (`run_episodes_stream` of one row), stopped where they run when cancelled
(`cancel_episodes`: no new turn starts, the turns in the engine are aborted, every environment still finishes).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpcrlhf.agents.runner import AgentRunner, AgentSpec
from hpcrlhf.agents.scheduler import BatchStats, added
from hpcrlhf.cluster.worker_group import (RoleWorker, WorkerGroup, busy, dead_worker_message, death_verdict, gather,
                                          lost_worker_error, wait_any)
from hpcrlhf.data.batching import shard_rows
from hpcrlhf.engines.rollout.contract import EndCallbacks
from hpcrlhf.engines.rollout.loop import BatchState, StreamBatch, StreamingRollout
from hpcrlhf.engines.rollout.vllm import VLLMRollout
from hpcrlhf.logs import get_logger

log = get_logger()


STREAMS = "streams"
"""The concurrency group of an engine loop's batch streams (`EngineWorker.stream_batch`)."""
LOOP_ACTOR = {"concurrency_groups": {STREAMS: 64}}
"""`ray.remote` options of an engine actor on an engine loop: the default group keeps its calls in order (one at a
time), the streams of the batches under way wait in STREAMS (at most 64 at once: k + 1 batches per step, each
redone at most once, and evaluation's)."""


def omp_binding(tp: int, cpus: int) -> str:
    """vLLM CPU's per-TP-rank core sets, "0-3|4-7"; ranks share cores when there are fewer than tp."""
    per = cpus // tp
    if per <= 1:
        return "|".join(str(i % cpus) for i in range(tp))
    return "|".join(f"{i * per}-{(i + 1) * per - 1}" for i in range(tp))


class EngineWorker(RoleWorker):
    """A VLLMRollout on one TP group: `generate`, `load_weights`, `sleep`/`wake`, `close`; on an engine loop
    (`loop`, with `partial`) also `launch` and `stream_batch` (module docstring)."""

    def __init__(self, role: str, rank: int, world_size: int, model_dir: str, *, tensor_parallel_size: int,
                 seed: int = 0, loop: bool = False, partial: bool = False, min_step_s: float = 0.0,
                 **engine_kwargs: Any) -> None:
        super().__init__(role, rank, world_size)

        if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            import torch

            if not torch.cuda.is_available():  # CPU build: one OpenMP core set per TP rank
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_binding(tensor_parallel_size, os.cpu_count() or 1)

        def make() -> VLLMRollout:
            return VLLMRollout(model_dir, seed=seed + rank, tensor_parallel_size=tensor_parallel_size,
                               distributed_executor_backend="mp", in_process=None, **engine_kwargs)

        self.streaming = StreamingRollout(make, partial=partial, min_step_s=min_step_s) if loop else None
        """The engine on an engine loop that alone drives it (rollout.partial), else None: calls drive it."""
        self.loop = self.streaming.loop if self.streaming is not None else None
        self.engine = self.streaming.engine if self.streaming is not None else make()
        self.batches: dict[int, StreamBatch] = {}
        """(engine loop) The batches launched and not yet streamed, by number."""
        self._numbers = itertools.count()
        self.agent: tuple[AgentSpec, AgentRunner] | None = None
        """The job's agent (multi-turn rollouts), built at its first batch."""
        self.episode_runs: dict[Any, threading.Event] = {}
        """(agent section) The trajectory batches under way by their driver's token, each its cancel flag; a
        cancel that comes first leaves its flag set for the run it names."""
        self._agent_lock = threading.Lock()

    @busy
    def generate(self, prompts: Sequence[Sequence[int]], params) -> list:
        return (self.streaming or self.engine).generate(prompts, params)

    @busy
    def generate_stream(self, prompts: Sequence[Sequence[int]], params) -> Iterator[list]:
        """`generate`, the finished prompts' groups as they finish (`VLLMRollout.stream`); called
        with `.options(num_returns="streaming")`. (On an engine loop `EngineFleet` calls `launch` and
        `stream_batch` instead: a sync after the call must not overtake its launch.)"""
        if self.streaming is not None:
            yield from self.streaming.launch(prompts, params).as_finished()
        else:
            yield from self.engine.stream(prompts, params)

    def launch(self, prompts: Sequence[Sequence[int]], params) -> int:
        """(engine loop) Start generating `prompts` beside the batches under way, under the weights the engine
        holds after the calls before this one; the batch's number, for `stream_batch`."""
        number = next(self._numbers)
        self.batches[number] = self.streaming.launch(prompts, params)
        return number

    def stream_batch(self, number: int) -> Iterator[list]:
        """(engine loop) Batch `number`'s groups as its prompts finish; called in the STREAMS group with
        `.options(num_returns="streaming")` (the default group goes on meanwhile: a sync pauses the batch)."""
        try:
            yield from self.batches[number].as_finished()
        finally:
            self.batches.pop(number, None)

    def suspend(self, number: int) -> BatchState | None:
        """(engine loop with partial) What batch `number` made so far, for a checkpoint that does not wait for it (it
        goes on); None if its stream ended (the caller has its groups). (One number: Ray resolves a launch's
        ref passed as an argument, not one inside a list.)"""
        batch = self.batches.get(number)
        return self.streaming.suspend([batch])[0] if batch is not None else None

    def relaunch(self, state: BatchState) -> int:
        """(engine loop) A batch a checkpoint kept (`suspend`) going on here, each sample from where it stopped;
        its number, for `stream_batch`."""
        number = next(self._numbers)
        self.batches[number] = self.streaming.relaunch(state)
        return number

    def cancel(self, number: int) -> None:
        """(engine loop) Drop batch `number` for good (arrival order's group too old to train): its samples under
        way are aborted and its stream ends where it is; nothing if it ended."""
        batch = self.batches.get(number)
        if batch is not None:
            self.streaming.cancel([batch])

    @busy
    def run_episodes_stream(self, rows: Sequence[Mapping[str, Any]], params, origins: Sequence[str], env_seed: int,
                            spec: AgentSpec, token: Any = None) -> Iterator[list]:
        """`params.n` multi-turn trajectories of each row (`AgentRunner.run`) on this engine, the
        environments and tools of the job's agent section (`spec`) in this process: one item, the part's
        groups with the batch's scheduling figures (`EpisodeGroups`). `token`: the name `cancel_episodes`
        stops them by (on an engine loop several such batches run at once, each in a STREAMS thread)."""
        with self._agent_lock:
            if self.agent is None or self.agent[0] != spec:
                if self.agent is not None:
                    self.agent[1].close()
                self.agent = (spec, spec.runner())
            runner = self.agent[1]
            cancelled = self.episode_runs.setdefault(token, threading.Event()) if token is not None else None
        try:
            generations, stats = runner.run(self.streaming or self.engine, rows, params, env_seed, origins,
                                            cancelled.is_set if cancelled is not None else None)
        finally:
            with self._agent_lock:
                self.episode_runs.pop(token, None)
        yield EpisodeGroups(enumerate(generations), stats)

    def cancel_episodes(self, token: Any) -> None:
        """Stop the trajectory batch `token` (arrival order's group too old to train): no new turn starts, its
        turns in the engine are aborted, every environment still finishes; one not yet started ends at once."""
        with self._agent_lock:
            self.episode_runs.setdefault(token, threading.Event()).set()

    @busy
    def load_weights(self, state: Mapping[str, Any], version: int | None = None) -> None:
        (self.streaming or self.engine).load_weights(state, version)

    def join_weight_group(self, spec, first_rank: int) -> list[int]:
        """Join the actor's weight group where the engine is driven: on the loop's thread between its steps."""
        join = lambda: self.engine.join_weight_group(spec, first_rank)  # noqa: E731
        return self.loop.post(join).result() if self.loop is not None else join()

    def receive_weights(self, version: int | None = None) -> int:
        """Load the weights actor rank 0 broadcasts in the weight-sync group (`version`: the policy version
        they are, which the engine then holds); busy only while they load (the engine may wait for the sender
        first: a sync started while the actor trains). On an engine loop the samples under way are paused for
        it and go on under the new weights."""
        if self.loop is not None:
            received = self.loop.publish(self.engine.version if version is None else version,
                                         self.engine.receive_weights).result()
        else:
            received = self.engine.receive_weights()
        if version is not None:
            self.engine.version = version
        self.busy_s += received.load_s
        return received.tensors

    def pop_busy(self) -> float:
        """Seconds spent in work methods since the last call; on an engine loop, in its engine steps."""
        if self.loop is None:
            return super().pop_busy()
        self.busy_s = 0.0
        return self.loop.pop_load().busy_s

    @busy
    def sleep(self) -> None:
        self.engine.sleep()

    @busy
    def wake(self, tags: Sequence[str]) -> None:
        self.engine.wake(tags)

    def close(self) -> None:
        (self.streaming or self.engine).close()  # an engine loop closes its engine on its thread
        if self.agent is not None:  # its environment threads: a hung call's stays, as a daemon
            self.agent[1].close()


DEATH_NOTICE_S = 30.0
"""How long a failed generation or weight sync waits for Ray to say which engine died and why: the
actor's rank 0 can fail first (its broadcast cut off), and a killed engine stays 'unavailable' to
Ray until the vLLM processes it started have exited (seconds)."""


class EngineFleet:
    """The engine actors as one rollout engine: a batch of prompts is split into contiguous
    parts, one per engine, generated concurrently and joined in order. Each part's sampling
    seeds follow its prompts' positions in the whole batch, so the samples do not depend on how
    many engines there are -- nor on whether an engine was restarted and redid its part.

    `push(handles)` loads the actor's current weights into those engines (always all of them);
    `push.start(handles)` queues such a push and `push.finish(tasks)` waits for it (`WeightPush`).
    An engine that dies while its node stays up (Ray: ActorDiedError) is restarted up to
    `max_restarts` times in all: same GPUs, weights pushed, its part of the batch (or the weight
    sync) redone."""

    def __init__(self, group: WorkerGroup, push: Any, *, max_restarts: int = 0, streaming: bool = False,
                 partial: bool = False) -> None:
        self.group, self.push, self.restarts_left = group, push, max_restarts
        self.streaming = streaming
        """Whether the engines run on engine loops (rollout.partial, or arrival order; `EngineWorker(loop=True)`):
        the batches launched share them, and a sync pauses the samples under way (partial) or drains them."""
        self.suspends_batches = streaming and partial
        """Whether a checkpoint can keep its batches under way as far as they got (`suspend`, `relaunch`: engine
        loops with rollout.partial)."""
        self.started: tuple[list[Any], list[Any]] | None = None
        """A sync under way (`start_sync`): the engines it went to and its tasks."""
        self.graceful = True
        """Whether `close` asks the engines to close first (not after a hang: one may never answer)."""
        self.version: int | None = None
        """The policy version the engines hold (the last `sync` that named one): a restarted engine is given it."""
        self.launching: list[Any] = []
        """(engine loops) The batches' launch calls since the last sync: it waits for them, so that a batch
        launched before a sync starts under the weights before it -- whoever sends them (the object-store
        path's loads come from the actor, whose calls keep no order with the driver's)."""
        self.singles: set[int] = set()
        """One-prompt batches under way (arrival order's groups, by id), to spread the next over the engines; one
        leaves when its stream ends (its done callback) or it is cancelled."""
        self.single_load: dict[int, int] = {}
        """How many of `singles` each engine (rank) has."""
        self._singles_lock = threading.Lock()
        self._tokens = itertools.count()
        """Names of trajectory batches, by which an engine stops one (`cancel`)."""

    @property
    def handles(self) -> list[Any]:
        return list(self.group.workers)

    def generate(self, prompts: Sequence[Sequence[int]], params) -> list:
        return self.launch(prompts, params).result()

    def launch(self, prompts: Sequence[Sequence[int]], params) -> FleetBatch:
        """Start generating `prompts` on the engines (each its part); `result()` collects them. One prompt (arrival
        order's group) goes to the engine with the fewest such groups under way."""
        return self._spread(len(prompts), lambda ranks: FleetBatch(self, prompts, params, ranks=ranks))

    def _spread(self, count: int, make: Callable[[Sequence[int] | None], FleetBatch]) -> FleetBatch:
        """`make(ranks)`: a batch of `count` prompts on every engine (None), or one prompt on the engine with the
        fewest one-prompt batches under way."""
        if count != 1 or len(self.group) == 1:
            return make(None)
        with self._singles_lock:
            rank = min(range(len(self.group)), key=lambda r: self.single_load.get(r, 0))  # the lowest on a tie
            batch = make([rank])
            self.singles.add(id(batch))
            self.single_load[rank] = self.single_load.get(rank, 0) + 1
        batch.add_done_callback(lambda: self._unload(batch))
        return batch

    def _unload(self, batch: FleetBatch) -> None:
        """One-prompt `batch` no longer counts on its engine (once: ended, or cancelled)."""
        with self._singles_lock:
            if id(batch) in self.singles:
                self.singles.discard(id(batch))
                (rank,) = batch.parts  # its engine
                self.single_load[rank] -= 1

    def suspend(self, batches: Sequence[FleetBatch]) -> list[FleetState]:
        """What each batch under way made so far (each engine's part: `EngineWorker.suspend`; a part that ended:
        the groups received), for a checkpoint that does not wait for them; they go on."""
        asked = {(k, rank): batch.sent_to[rank].suspend.remote(batch.numbers[rank])
                 for k, batch in enumerate(batches) for rank in batch.parts if rank not in batch.done_at}
        answers = dict(zip(asked, gather(list(asked.values()))))
        states = []
        for k, batch in enumerate(batches):
            under_way = {rank: answers[k, rank] for rank in batch.parts if answers.get((k, rank)) is not None}
            for rank in set(batch.parts) - set(under_way):
                batch.receive(rank)  # (ended meanwhile: its last groups may still be on the way)
            states.append(FleetState(list(batch.prompts), batch.params, dict(batch.parts), under_way,
                                     dict(batch.groups)))
        return states

    def relaunch(self, state: FleetState) -> FleetBatch:
        """A batch a checkpoint kept under way (`suspend`) going on: each part still under way from where it stopped
        on its engine (a restarted one too), the groups that had ended kept."""
        return FleetBatch(self, state.prompts, state.params, resume=state)

    def cancel(self, batches: Sequence[FleetBatch]) -> None:
        """Drop `batches` for good (engine loops: arrival order's groups too old to train): each engine aborts its
        part's samples under way and its stream ends."""
        calls = []
        for batch in batches:
            batch.cancelled = True
            self._unload(batch)
            if batch.token is not None:  # trajectories: stopped by their token on each engine with a part
                calls += [batch.sent_to[rank].cancel_episodes.remote(batch.token) for rank in batch.parts
                          if rank not in batch.done_at]
            else:
                calls += [batch.sent_to[rank].cancel.remote(number) for rank, number in batch.numbers.items()]
        gather(calls)

    def launch_episodes(self, rows: Sequence[Mapping[str, Any]], params, origins: Sequence[str], env_seed: int,
                        spec: AgentSpec) -> FleetBatch:
        """Start the multi-turn trajectories of `rows` on the engines, each its part beside its engine
        (`EngineWorker.run_episodes_stream`); `result()` collects them, `stats()` their figures. One row (arrival
        order's group) goes to the engine with the fewest such groups under way."""
        token = next(self._tokens)
        return self._spread(len(rows), lambda ranks: FleetBatch(
            self, rows, params, method="run_episodes_stream", sliced=(origins,), extra=(env_seed, spec),
            ranks=ranks, token=token))

    def sleep(self) -> None:
        """Every engine releases its GPU memory (`VLLMRollout.sleep`)."""
        self.call_every("sleep")

    def wake(self, tags: Sequence[str]) -> None:
        """Every engine restores the memory of `tags` (`VLLMRollout.wake`); an engine restarted
        since it slept is awake already."""
        self.call_every("wake", list(tags))

    def call_every(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every engine, the answers in rank order. An engine found dead is restarted
        (`restart`: when allowed, else its death raises) and asked again, as in a generation: an engine can
        die between two steps, and the next call to meet it may be any of the fleet's."""
        from ray.exceptions import RayActorError

        asked = {rank: getattr(w, method).remote(*args) for rank, w in enumerate(self.handles)}
        while True:
            try:
                answers = gather(list(asked.values()))
                return [answers[rank] for rank in sorted(asked)]
            except RayActorError as e:
                rank = self.group.rank_of(e.actor_id)
                if rank is None:
                    raise
                self.restart(rank, e)  # raises when it may not
                asked[rank] = getattr(self.handles[rank], method).remote(*args)

    def start_sync(self, version: int | None = None) -> None:
        """Start the next `sync` (of policy `version`) now, behind the work already queued on either side:
        each engine receives once it is free, the actor sends once it has learned, without waiting for the
        driver in between. `sync` then waits for what is left of it. (Not where the push must
        form its group first: `sync` does all of it then.)"""
        self._launched()
        pushing = self.push.start(self.handles, version)
        self.started = (self.handles, pushing) if pushing is not None else None

    def sync(self, version: int | None = None) -> None:
        """The actor's weights -- policy `version` (None: unnamed) -- into every engine, or the rest of the
        sync `start_sync` began (restarting an engine found dead on the way)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        started, self.started = self.started, None
        self._launched()
        self.version = version if version is not None else self.version
        try:
            if started is not None and started[0] == self.handles:
                self.push.finish(started[1])
            else:
                if started is not None:  # an engine was replaced since: that push went partly nowhere
                    ray.wait(started[1], num_returns=len(started[1]))
                self.push(self.handles, self.version)
        except (RayTaskError, RayActorError) as e:
            lost = lost_worker_error(e, [self.group], probe_s=DEATH_NOTICE_S)
            rank = self.group.rank_of(lost.actor_id) if lost is not None else None
            if rank is None:
                raise
            self.restart(rank, lost, pushed=False)
            self.push(self.handles, self.version)

    def _launched(self) -> None:
        """Wait for the launches since the last sync (`launching`; a failed one is the batch's to redo)."""
        import ray

        launching, self.launching = self.launching, []
        if launching:
            ray.wait(launching, num_returns=len(launching))

    def restart(self, rank: int, error, *, pushed: bool = True) -> None:
        """Replace dead engine `rank` (re-raising `error` when out of restarts or when its node may be
        gone) and, when `pushed`, give it the weights the other engines hold."""
        import ray

        if self.restarts_left <= 0:
            raise error
        error = death_verdict(self.group.workers[rank], error, DEATH_NOTICE_S)
        if not isinstance(error, ray.exceptions.ActorDiedError) or self.group.reservation.lost_nodes():
            raise error
        self.restarts_left -= 1
        log.warning(f"{dead_worker_message(error, [self.group])}; restarting it on its GPUs "
                    f"({self.restarts_left} restart(s) left, placement.vllm.max_restarts)")
        began = time.monotonic()
        self.group.respawn(rank)
        self.group.locate([rank])  # constructed: vLLM is up
        if pushed:
            self.push(self.handles, self.version)  # all: a collective weight sync re-forms its group with the new engine
        log.info(f"{self.group.name(rank)} restarted in {time.monotonic() - began:.0f} s; redoing its share")

    def close(self) -> None:
        import ray

        if self.group.workers:
            if self.started is None and self.graceful:  # else engines may wait in a weight sync, or be hung
                try:
                    gather(self.group.call_async("close"))
                except ray.exceptions.RayActorError:
                    pass  # an engine died (the error being raised says so); kill the others
            self.group.kill()


@dataclass
class FleetState:
    """A `FleetBatch` under way as a checkpoint keeps it (`EngineFleet.suspend`): its prompts and params, each
    engine's part (prompt range), the parts still under way as their engines' `BatchState`s, and the groups
    received (prompt index -> generations)."""

    prompts: list
    params: Any
    parts: dict[int, tuple[int, int]]
    under_way: dict[int, BatchState]
    groups: dict[int, list]


class EpisodeGroups(list):
    """An engine's finished groups of multi-turn trajectories, (prompt index, generations) each, with
    the scheduling figures of its part of the batch (`stats`)."""

    def __init__(self, groups: Iterable[tuple[int, list]], stats: BatchStats) -> None:
        super().__init__(groups)
        self.stats = stats


class FleetBatch:
    """A batch under way on an `EngineFleet`: one contiguous part per engine, each part's sampling
    seeds following its prompts' positions in the batch. Each engine streams the prompts it has
    finished (`EngineWorker.generate_stream`), so the batch's finished groups come back while the
    rest still generate (`as_finished`). The part of an engine that died is redone -- restarting
    it, or on the engine that already replaced it (a weight sync found it dead first); the groups
    received before it died are kept (what was scored stays what is trained on) and their copies
    in the redo dropped."""

    def __init__(self, fleet: EngineFleet, prompts: Sequence[Any], params, *, method: str = "generate_stream",
                 sliced: Sequence[Sequence[Any]] = (), extra: Sequence[Any] = (), ranks: Sequence[int] | None = None,
                 resume: FleetState | None = None, token: Any = None) -> None:
        """`prompts` (token ids, or rows for `run_episodes_stream`) by the workers' streaming `method`,
        each given its part of `prompts` and of each of `sliced`, its params, then `extra`; on the engines
        `ranks` (default: all); or a batch a checkpoint kept going on (`resume`: `EngineFleet.relaunch`).
        `token`: a trajectory batch's name on its engines (given to `method` after `extra`), for
        `EngineFleet.cancel`."""
        self.fleet, self.prompts, self.params = fleet, prompts, params
        self.method, self.sliced, self.extra, self.token = method, sliced, extra, token
        self.part_stats: dict[int, BatchStats] = {}
        """A multi-turn batch's figures, per part."""
        ranks = list(range(len(fleet.group))) if ranks is None else list(ranks)
        self.parts = {rank: (rows[0], rows[-1] + 1) for rank, rows in zip(ranks, shard_rows(len(prompts), len(ranks)))
                      if rows} if resume is None else dict(resume.parts)
        self.resume = resume
        self.numbers: dict[int, Any] = {}
        """(engine loops) Each part's batch number on its engine (a ref of its `launch`), for `cancel`."""
        self.cancelled = False
        self._on_end = EndCallbacks()
        self.sent_to: dict[int, Any] = {}
        self.current: dict[int, Any] = {}
        self.done_at: dict[int, float] = {}
        self.groups: dict[int, list] = dict(resume.groups) if resume is not None else {}
        """Prompt index -> its generations, as received."""
        self.given: set[int] = set()
        """Prompts `as_finished` has handed out."""
        self.streams: dict[Any, int] = {}
        """The engines' streams under way -> their part (rank)."""
        for rank in self.parts:
            if resume is None or rank in resume.under_way:
                self._start(rank)
            else:  # ended before the checkpoint: its groups are in `groups`
                self.done_at[rank] = time.monotonic()
        self.launched = time.monotonic()
        if self.finished() is not None:  # every part had ended
            self._on_end.fire()

    def _start(self, rank: int) -> None:
        a, b = self.parts[rank]
        worker = self.fleet.group.workers[rank]
        self.sent_to[rank] = worker
        self.done_at.pop(rank, None)
        part = self.params.part(a, b)
        if self.fleet.streaming and self.method == "generate_stream":  # launched in order with the syncs
            launched = (worker.launch.remote(self.prompts[a:b], part) if self.resume is None else
                        worker.relaunch.remote(self.resume.under_way[rank]))
            self.fleet.launching.append(launched)
            self.numbers[rank] = launched
            stream = worker.stream_batch.options(num_returns="streaming", concurrency_group=STREAMS).remote(launched)
        else:  # (trajectories on an engine loop: their turns posted to it, a sync pausing them, in STREAMS too)
            options = {"concurrency_group": STREAMS} if self.fleet.streaming else {}
            stream = getattr(worker, self.method).options(num_returns="streaming", **options).remote(
                self.prompts[a:b], part, *(s[a:b] for s in self.sliced), *self.extra,
                *((self.token,) if self.token is not None else ()))
        self.current[rank] = stream
        stream.completed().future().add_done_callback(lambda _, rank=rank, s=stream: self._mark_done(rank, s))
        self.streams[stream] = rank

    def _mark_done(self, rank: int, stream) -> None:
        """(Ray's callback thread) Part `rank` is done, unless `stream` is a try that was redone."""
        if self.current.get(rank) is stream:
            self.done_at[rank] = time.monotonic()
            if self.finished() is not None:
                self._on_end.fire()

    def add_done_callback(self, fn) -> None:
        """Call `fn()` once every part's stream ended (at once if they did; else on Ray's callback thread; a part
        that failed counts: `result` redoes it)."""
        self._on_end.add(fn)

    def finished(self) -> float | None:
        return max(self.done_at.values()) if len(self.done_at) == len(self.parts) else None

    def done(self) -> bool:
        """Whether every part's stream ended, without waiting (its groups are taken by `result`, which redoes the
        part of an engine that died)."""
        return self.finished() is not None

    def as_finished(self) -> Iterator[list]:
        """The groups (prompt index, generations) finished since the last item, as they finish -- at
        once those already received; every prompt once over all calls."""
        while True:
            new = sorted(set(self.groups) - self.given)
            if new:
                self.given.update(new)
                yield [(i, self.groups[i]) for i in new]
            if not self.streams:
                return
            self._take()

    def receive(self, rank: int) -> None:
        """Wait until part `rank`'s stream ended and its groups are here."""
        while any(r == rank for r in self.streams.values()):
            self._take()

    def result(self) -> list:
        """The batch's generations in prompt order (waits for them; again: the same list)."""
        while self.streams:
            self._take()
        return [self.groups[i] for i in range(len(self.prompts))]

    def stats(self) -> BatchStats:
        """A multi-turn batch's scheduling figures, its parts' added up (waits for them)."""
        self.result()
        return added([self.part_stats[rank] for rank in sorted(self.part_stats)])

    def _take(self) -> None:
        """Wait until an engine's stream has news, then take one item of every stream that has one: its
        groups kept, its end noted, or its part started again when its engine died."""
        import ray

        wait_any(list(self.streams), who=lambda pending: [self.fleet.group.placed_name(self.streams[s]) for s in pending])
        ready, _ = ray.wait(list(self.streams), num_returns=len(self.streams), timeout=0)
        for stream in ready:
            rank = self.streams[stream]
            try:
                ref = next(stream)
            except StopIteration:
                del self.streams[stream]
                if self.current.get(rank) is stream:  # ended: Ray's done-callback may not have run yet
                    self.done_at.setdefault(rank, time.monotonic())
                continue
            try:
                groups = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                del self.streams[stream]
                if self.fleet.group.workers[rank] is self.sent_to[rank]:  # not replaced meanwhile
                    self.fleet.restart(rank, e)  # raises when it may not
                self._start(rank)
                continue
            first = self.parts[rank][0]
            if isinstance(groups, EpisodeGroups):
                self.part_stats[rank] = groups.stats
            for i, generations in groups:
                self.groups.setdefault(first + i, generations)  # a redo's copy of a kept group: dropped
