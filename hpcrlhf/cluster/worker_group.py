"""One Ray actor per rank of a role, each on the device the node map gives it, the ranks of a
role joined in their own torch.distributed group (gloo on CPU, NCCL on GPU).

The controller calls a group as if it were local: `group.call("method", *args)` runs the method
on every rank and returns their results in rank order; `group.scatter_rows("method", batch)` runs
it on each rank's row shard of a batch, and `gather_rows` joins the shards' results into one batch.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

from hpcrlhf.cluster.reservation import WORKER_SETUP, Reservation
from hpcrlhf.data.batching import shard_rows
from hpcrlhf.errors import RewardServerError
from hpcrlhf.placement import Device
from hpcrlhf.run.signals import StopRequested, stop_requested_here, watched_wait
from hpcrlhf.run.usercode import load_named
from hpcrlhf.run.stacks import PY_SPY_TIMEOUT_S, SIGNALLED_WAIT_S, dump_on_signal, signalled_stacks


COLLECTIVE_TIMEOUT_S = 1800.0
"""How long a rank waits in a collective before failing: long, since legitimate waits are long (the
other ranks wait at a barrier while rank 0 writes a 70B model). A rank that died is noticed by
the driver at once (`gather`), which then kills its peers; this timeout only ends a rank that
hangs alive (the same 30 minutes as hpcrlhf.engines.distributed.init_distributed)."""


@dataclass(frozen=True)
class Whereabouts:
    """Where a worker really runs, as it sees it (compared with the map in tests and at start)."""

    role: str
    rank: int
    node_ip: str
    visible_devices: str
    pid: int
    node_id: str = ""
    """Ray's id of its node (where a task that reads its stacks must run)."""
    stacks_fd: int | None = None
    """The file its stacks go to on STACKS_SIGNAL (`hpcrlhf.run.stacks.dump_on_signal`), if armed."""


def busy(method: Callable) -> Callable:
    """Count the wall time of a RoleWorker method as the worker's busy time (`pop_busy`); of a
    generator method, the time spent making its items (not while its caller holds one)."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def timed_items(self, *args: Any, **kwargs: Any) -> Any:
            items = method(self, *args, **kwargs)
            while True:
                began = time.perf_counter()
                try:
                    item = next(items)
                except StopIteration:
                    return
                finally:
                    self.busy_s += time.perf_counter() - began
                yield item

        return timed_items

    @functools.wraps(method)
    def timed(self, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - began

    return timed


class RoleWorker:
    """Base of every role's Ray actor: knows its role and rank, joins its role's process group,
    and counts the seconds its work methods (`@busy`) ran."""

    def __init__(self, role: str, rank: int, world_size: int) -> None:
        self.role, self.rank, self.world_size = role, rank, world_size
        self.busy_s = 0.0
        if os.environ.get(WORKER_SETUP):  # checked in the driver (`worker_env`)
            load_named(os.environ[WORKER_SETUP], WORKER_SETUP, "function")(self)
        try:  # the driver's watchdog asks a stuck worker for its stacks (`worker_stacks`)
            self.stacks_fd: int | None = dump_on_signal()
        except (OSError, ValueError, RuntimeError):  # no writable temp folder, or no such signal here
            self.stacks_fd = None

    def pop_busy(self) -> float:
        """Seconds spent in work methods since the last call."""
        out, self.busy_s = self.busy_s, 0.0
        return out

    def serve_rendezvous(self, timeout_s: float = COLLECTIVE_TIMEOUT_S):
        """(Rank 0) Serve the store of this role's process group on this node's address, on a port of
        the job's block, sealed (hpcrlhf.engines.rendezvous); its rendezvous, for the group's ranks."""
        from hpcrlhf.engines import rendezvous  # torch: imported where a worker uses it, as torch is below

        self._store, meeting = rendezvous.serve(self.node_ip(), timeout_s)
        return meeting

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def init_process_group(self, meeting, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        """Join this role's process group (ranks of other roles are not in it) at `meeting`, the
        store rank 0 serves (`serve_rendezvous`)."""
        import datetime

        import torch
        import torch.distributed as dist

        from hpcrlhf.engines import rendezvous  # torch, as above

        # kept for the group's life: torch holds only the C++ half of a store written in Python
        self._store = rendezvous.member_store(meeting, self.rank, getattr(self, "_store", None), timeout_s)
        # torchrun's variables, for libraries that look for them (DeepSpeed does); the store is given
        os.environ.update(MASTER_ADDR=meeting.host, MASTER_PORT=str(meeting.port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=self._store, rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))

    def check_group(self) -> int:
        """All-reduce a one from every rank of the role's group: returns the group's size (a start-up
        check that the group is wired, and that it holds only this role's ranks)."""
        import torch
        import torch.distributed as dist

        one = torch.ones(1)
        dist.all_reduce(one)
        return int(one.item())

    def whereabouts(self) -> Whereabouts:
        import ray

        return Whereabouts(self.role, self.rank, self.node_ip(), os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                           os.getpid(), ray.get_runtime_context().get_node_id(), self.stacks_fd)


class Workers:
    """Ray actors, one per rank, as the driver sees them: all of them called at once, one named by its
    actor id (`owner`), where each runs (`locate`), those a hung wait names (`stuck`). Subclasses
    hold `workers` and say how a rank is named where it runs (`placed_name`)."""

    workers: list[Any]

    def __init__(self) -> None:
        self.located: dict[int, Whereabouts] = {}
        """Where each rank runs, as it said (`locate`)."""
        LIVE_GROUPS.add(self)  # a pending task of one of them is named by its worker (`task_owner`)

    def placed_name(self, rank: int) -> str:
        raise NotImplementedError

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def rank_of(self, actor_id: str | None) -> int | None:
        """The rank of this group's actor with hex id `actor_id`, else None."""
        return next((rank for rank, w in enumerate(self.workers) if w._actor_id.hex() == actor_id), None)

    def owner(self, actor_id: str) -> str | None:
        """'critic rank 1 (node 2 GPU 1)' for the hex id of one of this group's actors, else None."""
        rank = self.rank_of(actor_id)
        return None if rank is None else self.placed_name(rank)

    def locate(self, ranks: Sequence[int] | None = None) -> list[Whereabouts]:
        """Ask ranks `ranks` (all: None) where they run, and keep it (`located`: the stacks of a stuck
        worker are read where it runs)."""
        ranks = range(len(self.workers)) if ranks is None else ranks
        found = gather([self.workers[rank].whereabouts.remote() for rank in ranks])
        self.located.update(zip(ranks, found))
        return found

    def stuck(self, parties: Sequence[str]) -> list[int]:
        """The ranks of this group's located workers named in `parties` (`placed_name`s: a hung wait's);
        `worker_stacks` reads theirs."""
        return [r for r in range(len(self.workers)) if self.placed_name(r) in parties and r in self.located]


class WorkerGroup(Workers):
    """The Ray actors of one role (or of the vLLM engines: one actor per TP group)."""

    def __init__(self, role: str, worker_cls: type, reservation: Reservation, placements: Sequence[Sequence[Device]],
                 *args: Any, env: dict[str, str] | None = None, join: bool = True,
                 remote_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """`remote_options`: `ray.remote`'s for the worker class (its concurrency groups)."""
        import ray

        super().__init__()
        self.role, self.placements, self.reservation = role, [tuple(p) for p in placements], reservation
        remote_cls = ray.remote(**remote_options)(worker_cls) if remote_options else ray.remote(worker_cls)
        world = len(self.placements)
        self._spawn = lambda rank: remote_cls.options(name=None, **reservation.actor_options(
            self.placements[rank], env=env)).remote(role, rank, world, *args, **kwargs)
        self.workers = [self._spawn(rank) for rank in range(world)]
        self.joined = join
        if join and world > 0:
            (meeting,) = gather([self.workers[0].serve_rendezvous.remote()])
            gather([w.init_process_group.remote(meeting) for w in self.workers])

    @classmethod
    def for_role(cls, role: str, worker_cls: type, reservation: Reservation, *args: Any, **kwargs: Any) -> WorkerGroup:
        """The group of `role`'s ranks, each on its device in the node map."""
        return cls(role, worker_cls, reservation, [[d] for d in reservation.node_map.role_ranks(role)],
                   *args, **kwargs)

    @classmethod
    def for_engines(cls, worker_cls: type, reservation: Reservation, *args: Any, **kwargs: Any) -> WorkerGroup:
        """One actor per vLLM engine, on its TP group's devices (no process group between engines)."""
        return cls("vllm", worker_cls, reservation, reservation.node_map.engines, *args, join=False, **kwargs)

    def __len__(self) -> int:
        return len(self.workers)

    def scatter_async(self, method: str, shards: Sequence[Any], *args: Any) -> list[Any]:
        """`method(shards[i], *args)` on worker i (one shard per worker)."""
        if len(shards) != len(self.workers):
            raise ValueError(f"{len(shards)} shards for the {len(self.workers)} {self.role} workers")
        return [getattr(w, method).remote(shard, *args) for w, shard in zip(self.workers, shards)]

    def scatter_rows(self, method: str, batch: Any, *args: Any, pad_to_equal: bool = False) -> Scattered:
        """`method(shard, *args)` on each worker, shard i of `batch.split(len(self), pad_to_equal=...)`
        (the rows as `shard_rows` splits them); `gather_rows` joins the results."""
        shards = batch.split(len(self.workers), pad_to_equal=pad_to_equal)
        return Scattered(self.scatter_async(method, shards, *args), [len(s) for s in shard_rows(len(batch), len(self))])

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return gather(self.call_async(method, *args, **kwargs))

    def name(self, rank: int) -> str:
        return f"vLLM engine {rank}" if self.role == "vllm" else f"{self.role} rank {rank}"

    def placed_name(self, rank: int) -> str:
        """'critic rank 1 (node 2 GPU 1)': rank `rank` and its devices in the node map."""
        return f"{self.name(rank)} ({', '.join(f'node {d.node} GPU {d.gpu}' for d in self.placements[rank])})"

    def on_node(self, node: int) -> list[str]:
        """Names of this group's workers on map node `node`."""
        return [self.name(rank) for rank, devices in enumerate(self.placements) if devices[0].node == node]

    def respawn(self, rank: int) -> Any:
        """A new worker in place of (dead) worker `rank`, on the same devices and built with the same
        arguments. Only for groups without a process group (a new rank cannot join a live one)."""
        if self.joined:
            raise RuntimeError(f"{self.role} rank {rank} cannot be replaced: its role's process group is fixed")
        self.workers[rank] = self._spawn(rank)
        self.located.pop(rank, None)
        return self.workers[rank]

    def kill(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []


@dataclass(frozen=True)
class Scattered:
    """Work on a batch's row shards under way on a group's workers (`WorkerGroup.scatter_rows`)."""

    refs: list[Any]
    """One task per worker."""
    rows: list[int]
    """Each shard's own rows: a padded shard's repeated rows are dropped from its result."""


def gather_rows(*scattered: Scattered, interruptible: bool = False) -> list[Any]:
    """The joined result of each scattered work: its shards' results (batches with `head(n)` and
    `concat(parts)`, such as the batch they were given) without their padding, concatenated in rank
    order. Every task is awaited at once (`gather`: the first failure raises)."""
    results = iter(gather([ref for work in scattered for ref in work.refs], interruptible=interruptible))
    joined = []
    for work in scattered:
        parts = [next(results).head(rows) for rows in work.rows]
        joined.append(type(parts[0]).concat(parts))
    return joined


STOP_POLL_S = 0.5
"""How often a `gather(..., interruptible=True)` looks for a stop request while it waits."""
LIVE_GROUPS: weakref.WeakSet[Workers] = weakref.WeakSet()
"""This process's worker groups (to name the worker a pending task runs on)."""


def task_owner(ref: Any) -> str:
    """'critic rank 1 (node 0 GPU 1)' for a task running on a worker of this process's groups."""
    try:
        actor = ref.task_id().actor_id().hex()
    except Exception:  # noqa: BLE001 -- not an actor task
        return "a Ray task"
    return next((who for g in list(LIVE_GROUPS) if (who := g.owner(actor))), f"Ray actor {actor[:12]}")


def wait_any(pending: Sequence[Any], *, timeout: float | None = None,
             who: Callable[[Sequence[Any]], list[str]] | None = None) -> tuple[list[Any], list[Any]]:
    """`ray.wait(pending, num_returns=1, timeout=timeout)`, in polls that name what is still pending to this
    process's watchdog (`who`, default `task_owner` of each) and raise its WaitExpired once the wait's deadline
    passed (a signal cannot interrupt a Ray wait cleanly): `hpcrlhf.run.signals.watched_wait`."""
    import ray

    last: list = [[], list(pending)]

    def poll(seconds: float) -> bool:
        last[:] = ray.wait(list(pending), num_returns=1, timeout=seconds)
        return bool(last[0])

    watched_wait(poll, lambda: who(pending) if who is not None else [task_owner(r) for r in pending],
                 timeout=timeout)
    return last[0], last[1]


def gather(refs: Sequence[Any], *, interruptible: bool = False) -> list[Any]:
    """`ray.get(refs)`, except that the first failure raises at once. `ray.get` of a list waits for
    every result first, and the peers of a dead rank sit in a collective with it until their
    timeout: the run would look hung, then fail with the peers' timeouts instead of the cause.

    `interruptible`: for work that runs the user's code (rules on the reward role), which may never
    return: a stop request to this process while it waits raises StopRequested, leaving the work
    (the caller's `Run.stoppable` drops the step; the workers go with the job, or end at their
    rule's deadline)."""
    import ray

    pending = list(refs)
    while pending:
        ready, pending = wait_any(pending, timeout=STOP_POLL_S if interruptible else None)
        if interruptible and stop_requested_here():
            raise StopRequested
        ray.get(ready)  # raises this one's failure
    return ray.get(list(refs))


def worker_stacks(workers: Sequence[Whereabouts], wait_s: float = SIGNALLED_WAIT_S) -> list[str]:
    """The stacks of each worker (where it runs: `whereabouts`), read on its node by a task pinned there
    (`hpcrlhf.run.stacks.signalled_stacks`), all at once; for each, its text or why there is none."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    read = ray.remote(num_cpus=0, max_retries=0)(signalled_stacks)
    refs = [read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(w.node_id, soft=False)).remote(
        w.pid, w.stacks_fd, wait_s) if w.node_id and w.stacks_fd is not None else None for w in workers]
    asked = [ref for ref in refs if ref is not None]
    ray.wait(asked, num_returns=len(asked), timeout=wait_s + PY_SPY_TIMEOUT_S + 10)
    texts = []
    for w, ref in zip(workers, refs):
        if ref is None:
            texts.append(f"(no stacks of process {w.pid}: it was not armed for them)")
            continue
        try:
            texts.append(ray.get(ref, timeout=0))
        except Exception as e:  # noqa: BLE001 -- its node is gone, or the read timed out: say so
            texts.append(f"(no stacks of process {w.pid} on {w.node_ip}: {type(e).__name__}: {e})")
    return texts


def dead_worker_message(error, groups: Sequence[WorkerGroup]) -> str:
    """What to tell the user when a Ray actor of `groups` died (`error`: its `RayActorError`):
    which rank or engine, where, and Ray's own account of why (pid, node, exit detail)."""
    who = next((o for g in groups if error.actor_id and (o := g.owner(error.actor_id))), "a worker")
    detail = " ".join(line.strip() for line in str(error.error_msg).splitlines()[1:] if line.strip())
    return f"{who} died ({detail or error.error_msg})"


PROBE_S = 5.0
"""How long `lost_worker_error` waits for the workers to answer a ping (busy ones just don't)."""


def lost_worker_error(error: BaseException, groups: Sequence[WorkerGroup], probe_s: float = PROBE_S):
    """The `RayActorError` of a lost worker behind `error`, or None: `error` itself when it is one;
    when a worker *raised* instead (a peer of a dead rank can fail first, its collective cut off:
    gloo's 'Connection closed by peer'), or a job's reward server stopped answering (RewardServerError:
    its actor may have died), the first worker found dead by pinging them all. The probe
    ends at the first dead worker; one that neither answers nor is known dead within `probe_s` (busy,
    or Ray not yet told of its death) counts as alive."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(error, RayActorError):
        return error
    if not isinstance(error, (RayTaskError, RewardServerError)):
        return None
    pending = [w.node_ip.remote() for g in groups for w in g.workers]
    deadline = time.monotonic() + probe_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        try:
            ray.get(ready)
        except RayActorError as lost:
            return lost
    return None


def unreachable(error: BaseException) -> bool:
    """Whether Ray lost contact with an actor without knowing yet why (its process, or its node?)."""
    from ray.exceptions import ActorUnavailableError

    return isinstance(error, ActorUnavailableError)


def worker_with_id(actor_id: str | None, groups: Sequence[WorkerGroup]) -> Any:
    """The actor handle of `groups` whose hex id is `actor_id` (None when none is)."""
    return next((g.workers[rank] for g in groups if (rank := g.rank_of(actor_id)) is not None), None)


def death_verdict(worker: Any | None, error: BaseException, wait_s: float) -> BaseException:
    """`error` (a `RayActorError` of `worker`) once Ray knows why the worker is gone: an
    `ActorUnavailableError` (contact lost, cause not yet known) is replaced by the `ActorDiedError`
    that follows within `wait_s` if one does. (A killed actor stays 'unavailable' while child
    processes it started -- vLLM's engine core and workers -- linger: seconds.)"""
    import ray
    from ray.exceptions import RayActorError

    deadline = time.monotonic() + wait_s
    while worker is not None and unreachable(error) and (left := deadline - time.monotonic()) > 0:
        try:
            ray.get(worker.node_ip.remote(), timeout=left)
            return error  # it answers: contact came back, the cause stays unknown
        except RayActorError as later:
            error = later
            if unreachable(error):
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        except Exception:  # GetTimeoutError, or Ray itself failing: the cause stays unknown
            return error
    return error


def lost_node_message(node: str, index: int, groups: Sequence[WorkerGroup]) -> str:
    """'node 1 (n2, 10.0.0.2) died ...': which node Ray declared dead and the workers it took along."""
    took = [name for g in groups for name in g.on_node(index)]
    return f"{node} died (Ray's health checks declared it dead) and took {', '.join(took) or 'no worker'} with it"
