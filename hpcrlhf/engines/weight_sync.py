"""Weight sync by a collective: the actor's weights broadcast into every vLLM worker.

One process group is made for the purpose: actor rank 0 is its rank 0, every worker of every
engine a further rank (engine e, tensor-parallel rank t: `1 + e * tp + t`). NCCL when every member
has a GPU of its own; CUDA IPC when every member computes on one and the same GPU (a colocated
TP-1 engine beside actor rank 0, e.g. one GPU): each bucket stays on the GPU, the members receive
a handle to it over a gloo group and copy it device to device; else gloo (CPU hosts, and members
of which only some share a GPU, which NCCL refuses: the weights then go through host memory); the
same code. It is separate from the actor's own group (ZeRO's) and from each engine's
(vLLM's TP group): a store served by actor rank 0 (hpcrlhf.engines.rendezvous: on the node's
address and a port of the job's block, sealed with the group's secret) and a process group built
on it directly, so nobody's default group is touched.

A sync streams. Every actor rank walks the state dict chunk by chunk (under ZeRO-3 gathering one
chunk's parameters at a time: the whole state dict never exists twice); rank 0 copies each
chunk's tensors, in checkpoint names (`checkpoint_names`), into a bucket of at most
`bucket_bytes` and broadcasts it, preceded by a header (names, dtypes, shapes, and whether it is
the last bucket); a tensor larger than a bucket goes alone, uncopied (and when it is the last,
an empty last header follows). Each engine worker turns the
broadcasts back into `(name, tensor)` pairs as they arrive and feeds them, as one iterator, to
vLLM's in-place `reload_weights`, which loads each layer when its weights are complete (fused
q/k/v and gate/up layers, TP sharding and the CPU build's repacking handled there). So the engine
never holds a second copy of the model either.

A member may be armed long before a sync (an engine waiting while the actor trains): it waits
for rank 0's announcement of the sync in the group's store, as long as that takes, and enters the
collectives only then.

The header is UTF-8 JSON in a broadcast of fixed size (`HEADER_BYTES`: its length, then as much
of it as fits; the rest, rarely any, in a second), on the group's control device, so the only
thing that crosses a process boundary outside the group is a method name -- and a bucket costs
two collectives: a member's wake-ups, not bytes, are what a small model's sync spends its time on
(a CPU host with more processes than cores). With a shared transport (CUDA IPC; "shm", its CPU
twin through a /dev/shm file, chosen only by `SyncGroup.transport`) the header carries the
bucket's handle instead, each member copies the bucket into a buffer of its own and a barrier
tells the sender it may refill it: what a member yields stays valid however long the loader keeps
it, as with a broadcast.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import pickle
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from hpcrlhf.engines import rendezvous
from hpcrlhf.engines.rendezvous import Rendezvous
from hpcrlhf.logs import get_logger

log = get_logger()

ALIGN = 16
"""Byte alignment of each tensor in a bucket (a tensor is viewed in place as its dtype)."""

HEADER_BYTES = 1 << 16
"""Size of a header's broadcast: 8 bytes of length, then the JSON (~100 bytes a tensor); a longer
header sends the rest in a second broadcast."""


@dataclass(frozen=True)
class SyncGroup:
    """Where a weight-sync group meets: actor rank 0's store (`serve_store`), the group's size and
    name (each re-formed group, e.g. after an engine restart, gets a new one)."""

    at: Rendezvous
    world_size: int
    name: str
    timeout_s: float = 1800.0
    kind: str = "trainer"
    """"trainer" (a trainer's rank 0 and engines' workers) or "local" (an engine's own process and
    its workers): an engine worker can be in one group of each kind."""
    transport: str | None = None
    """None: chosen by the members' devices (`choose_backend`); "shm": buckets shared through /dev/shm
    files between processes of one host, the CPU twin of CUDA IPC (tests)."""

    def __post_init__(self) -> None:
        if isinstance(self.at, dict):  # from `dataclasses.asdict`, as vLLM's collective_rpc carries it
            object.__setattr__(self, "at", Rendezvous(**self.at))


@dataclass
class SyncStats:
    """What one sync moved: bytes, buckets (broadcasts of weights) and tensors."""

    bytes: int = 0
    buckets: int = 0
    tensors: int = 0
    seconds: float = 0.0


class Group:
    """A member's handle on a weight-sync group (keeps the store alive with the group). Buckets live
    on `device`; headers and handles travel on `control` (the group's own device: CPU for gloo).
    `keys`: the group's keys in the store, where each sync is announced (`announce`,
    `await_sender`)."""

    def __init__(self, store, pg, device: torch.device, backend: str, control: torch.device | None = None, *,
                 keys, poll_s: float = 1800.0) -> None:
        self.store, self.pg, self.device, self.backend = store, pg, device, backend
        self.control = control or device
        self.keys, self.poll_s = keys, poll_s
        self.syncs = 0

    def announce(self) -> None:
        """(Rank 0) A sync begins."""
        self.keys.set(f"sync/{self.syncs}", "1")
        self.syncs += 1

    def await_sender(self) -> None:
        """(A member) Wait until rank 0 begins the next sync, however long that takes -- an engine
        armed while the actor trains waits a whole training phase: in the store, whose connection
        fails at once if rank 0's process is gone, not in a collective, which would time out (gloo,
        NCCL: `SyncGroup.timeout_s`) and, on a GPU, hold a kernel on it meanwhile."""
        from torch.distributed import DistStoreError

        key = f"sync/{self.syncs}"
        self.syncs += 1
        while True:
            try:
                self.keys.wait([key], datetime.timedelta(seconds=self.poll_s))
                return
            except DistStoreError:  # not yet (a timeout); a lost connection raises DistNetworkError
                continue

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.pg.broadcast(tensor, 0).wait()

    def barrier(self) -> None:
        self.pg.allreduce([torch.zeros(1, device=self.control)]).wait()

    @property
    def shared(self) -> _Shared | None:
        """The transport that shares buckets instead of broadcasting them, if the group has one."""
        return SHARED.get(self.backend)


class _Shared:
    """Hand a bucket to the other members without a broadcast: `share(bucket)` -> bytes for them,
    `copy(bytes, into)` fills a member's own buffer from the sender's bucket (done when it
    returns), `done()` after a sync."""

    def share(self, bucket: torch.Tensor) -> bytes:
        raise NotImplementedError

    def copy(self, handle: bytes, into: torch.Tensor) -> None:
        raise NotImplementedError

    def done(self) -> None:
        pass


class _CudaIpc(_Shared):
    """CUDA IPC (GPU, unverified: benchmarks/README.md): the bucket's memory handle, opened in the
    member's process; the handle carries an event, so the member's copy waits for the sender's
    writes. The same GPU may have another index in the member's process (its own visible devices)."""

    def share(self, bucket: torch.Tensor) -> bytes:
        from torch.multiprocessing.reductions import reduce_tensor

        return pickle.dumps(reduce_tensor(bucket))

    def copy(self, handle: bytes, into: torch.Tensor) -> None:
        rebuild, args = pickle.loads(handle)  # noqa: S301 -- from the group's rank 0, our own process
        args = list(args)
        args[6] = into.device.index  # rebuild_cuda_tensor's storage_device
        into.copy_(rebuild(*args).reshape(-1)[: into.numel()])
        torch.cuda.current_stream(into.device).synchronize()  # before the sender may refill its bucket


class _ShmFile(_Shared):
    """The CPU twin of CUDA IPC: each bucket copied into the sender's one /dev/shm file, which the
    members map -- rewritten in place for the next bucket as a GPU bucket is refilled."""

    @property
    def path(self) -> str:
        return f"/dev/shm/hpcrlhf-sync-{os.getpid()}"

    def share(self, bucket: torch.Tensor) -> bytes:
        size = max(bucket.numel(), os.path.getsize(self.path) if os.path.exists(self.path) else 0)
        torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)[: bucket.numel()].copy_(bucket.reshape(-1))
        return self.path.encode()

    def copy(self, handle: bytes, into: torch.Tensor) -> None:
        into.copy_(torch.from_file(handle.decode(), shared=True, size=into.numel(), dtype=torch.uint8))

    def done(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


SHARED: dict[str, _Shared] = {"cuda_ipc": _CudaIpc(), "shm": _ShmFile()}


def device_key() -> str:
    """Which device this process computes on: the GPU's UUID (the same GPU seen by two processes
    under different indices has one UUID), or "cpu"."""
    if not torch.cuda.is_available():
        return "cpu"
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def choose_backend(devices: list[str]) -> str:
    """NCCL when every member has a GPU and no two share one; CUDA IPC when all of them share one
    GPU; else gloo over host memory (CPU members, or only some sharing a GPU: NCCL refuses two
    ranks on one device)."""
    if "cpu" in devices:
        return "gloo"
    if len(set(devices)) == 1:
        return "cuda_ipc"
    if len(set(devices)) < len(devices):
        return "gloo"
    return "nccl"


def serve_store(host: str, timeout_s: float = 1800.0, *, local: bool = False):
    """The group's store on rank 0, listening on `host` (127.0.0.1 when `local`: the members are this
    process's own vLLM workers): (store, its rendezvous for `SyncGroup.at`)."""
    return rendezvous.serve(host, timeout_s, local=local)


def join(spec: SyncGroup, rank: int, store=None) -> Group:
    """Join the group as `rank` (rank 0 passes the store it serves; the others connect to it).
    Every member first posts its device, so all of them pick the same backend (`choose_backend`).
    Returns when every member has joined."""
    from torch.distributed import PrefixStore, ProcessGroupGloo

    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = rendezvous.member_store(spec.at, rank, store, spec.timeout_s)
    keys = PrefixStore(spec.name, store)
    keys.set(f"device/{rank}", device_key())
    kind = spec.transport or choose_backend([keys.get(f"device/{r}").decode() for r in range(spec.world_size)])
    if rank == 0:
        log.info(f"weight sync {spec.name}: {kind} between {spec.world_size} processes")
    prefixed = PrefixStore("pg", keys)
    common = dict(keys=keys, poll_s=spec.timeout_s)
    if kind in ("gloo", "shm"):
        return Group(store, ProcessGroupGloo(prefixed, rank, spec.world_size, timeout), torch.device("cpu"), kind,
                     **common)
    if kind == "cuda_ipc":  # buckets stay on the GPU; headers and handles go over gloo
        return Group(store, ProcessGroupGloo(prefixed, rank, spec.world_size, timeout),
                     torch.device("cuda", torch.cuda.current_device()), kind, control=torch.device("cpu"), **common)
    from torch.distributed import ProcessGroupNCCL  # GPU, verified on 2 GPUs only by tests/gpu (benchmarks/README.md)

    device = torch.device("cuda", torch.cuda.current_device())
    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    pg = ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
    return Group(store, pg, device, kind, **common)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _send_header(group: Group, header: dict) -> None:
    data = json.dumps(header).encode()
    first = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    first[:8].view(torch.int64)[0] = len(data)
    fits = min(len(data), HEADER_BYTES - 8)
    first[8 : 8 + fits] = torch.frombuffer(bytearray(data[:fits]), dtype=torch.uint8)
    group.broadcast(first.to(group.control))
    if len(data) > fits:
        group.broadcast(torch.frombuffer(bytearray(data[fits:]), dtype=torch.uint8).to(group.control))


def _receive_header(group: Group) -> dict:
    first = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=group.control)
    group.broadcast(first)
    first = first.cpu()
    size = int(first[:8].view(torch.int64)[0])
    data = bytes(first[8 : 8 + min(size, HEADER_BYTES - 8)].numpy())
    if size > HEADER_BYTES - 8:
        rest = torch.empty(size - (HEADER_BYTES - 8), dtype=torch.uint8, device=group.control)
        group.broadcast(rest)
        data += bytes(rest.cpu().numpy())
    return json.loads(data.decode())


class WeightSender:
    """Rank 0's side: `send(named tensors)` streams them in buckets, the last one marked so."""

    def __init__(self, group: Group, bucket_bytes: int) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.group, self.bucket_bytes = group, bucket_bytes
        self._bucket: torch.Tensor | None = None

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        """Each tensor is copied into the bucket (or sent alone) before the next is asked for, so
        a tensor may be freed (a ZeRO-3 gather released) as soon as the iterator moves on."""
        began, stats = time.perf_counter(), SyncStats()
        self.group.announce()
        entries: list[dict] = []
        used = 0
        for name, tensor in tensors:
            raw = _as_bytes(tensor.to(self.group.device))
            entry = {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                     "offset": 0}
            if raw.numel() > self.bucket_bytes:  # alone, uncopied
                self._flush(entries, used, stats)
                entries, used = [], 0
                self._broadcast([entry], raw, stats)
                continue
            start = -(-used // ALIGN) * ALIGN
            if start + raw.numel() > self.bucket_bytes:
                self._flush(entries, used, stats)
                entries, used, start = [], 0, 0
            if self._bucket is None:
                self._bucket = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.group.device)
            self._bucket[start : start + raw.numel()].copy_(raw)
            entries.append({**entry, "offset": start})
            used = start + raw.numel()
        if entries:
            self._flush(entries, used, stats, last=True)
        else:  # nothing, or a tensor sent alone, came last
            _send_header(self.group, {"tensors": [], "last": True})
        if self.group.shared is not None:
            self.group.shared.done()
        self._bucket = None  # not kept between syncs: training needs the memory
        stats.seconds = time.perf_counter() - began
        return stats

    def _flush(self, entries: list[dict], used: int, stats: SyncStats, last: bool = False) -> None:
        if entries:
            self._broadcast(entries, self._bucket[:used], stats, last)

    def _broadcast(self, entries: list[dict], payload: torch.Tensor, stats: SyncStats, last: bool = False) -> None:
        header = {"tensors": entries, "last": last}
        shared = self.group.shared
        if shared is None:
            _send_header(self.group, header)
            self.group.broadcast(payload)
        else:
            _send_header(self.group, {**header, "handle": base64.b64encode(shared.share(payload)).decode()})
            self.group.barrier()  # every member has its copy: the bucket may be refilled
        stats.bytes += payload.numel()
        stats.buckets += 1
        stats.tensors += len(entries)


def receive(group: Group) -> Iterator[tuple[str, torch.Tensor]]:
    """A member's side: the sent tensors, in order, as their buckets arrive; ends after the last.
    Tensors are views of their bucket (no copy). Waits for the sync to begin first (`await_sender`)."""
    group.await_sender()
    last = False
    while not last:
        header = _receive_header(group)
        entries, last = header["tensors"], header["last"]
        if not entries:
            continue
        sizes = [torch.Size(e["shape"]).numel() * getattr(torch, e["dtype"]).itemsize for e in entries]
        payload = torch.empty(entries[-1]["offset"] + sizes[-1], dtype=torch.uint8, device=group.device)
        if group.shared is None:
            group.broadcast(payload)
        else:
            group.shared.copy(base64.b64decode(header["handle"]), payload)
            group.barrier()
        for e, size in zip(entries, sizes):
            part = payload[e["offset"] : e["offset"] + size]
            yield e["name"], part.view(getattr(torch, e["dtype"])).reshape(e["shape"])
