"""The actor's weights into the vLLM engines on Ray, by the `placement.vllm.weight_sync` path:
`collective` (actor rank 0 broadcasts to every engine worker in a process group made for it,
`hpcrlhf.engines.weight_sync`) or `object_store` (rank 0 puts the full state dict in Ray's object
store once, every engine loads it from there).
"""

from __future__ import annotations

from typing import Any

from hpcrlhf.cluster.worker_group import WorkerGroup, gather
from hpcrlhf.engines.weight_sync import SyncGroup
from hpcrlhf.logs import get_logger

log = get_logger()


class WeightPush:
    """`push(engines)`: the actor's current weights into `engines` (all the fleet's), by the
    `placement.vllm.weight_sync` path; or in two halves, `finish(start(engines))`, so that the
    push can be under way while the driver does something else. The collective path's group spans
    actor rank 0 and every worker of those engines; it is formed at the first push and again
    whenever the engines are not the ones it was formed with (an engine restarted). `last`: the
    last push's metrics."""

    def __init__(self, actor: WorkerGroup, tensor_parallel_size: int, mode: str) -> None:
        self.actor, self.tp, self.mode = actor, tensor_parallel_size, mode
        self.members: list[str] | None = None
        self.formed = 0
        self.last: dict[str, float] = {}

    def __call__(self, engines: list[Any], version: int | None = None) -> None:
        if self.mode == "collective" and self.members != self.ids(engines):
            self.form(engines)
        self.finish(self.start(engines, version))

    def start(self, engines: list[Any], version: int | None = None) -> list[Any] | None:
        """Queue the push of policy `version` (updates done; None: unnamed) on the actor's ranks and on
        `engines` (each side runs it after the work queued before: the actor sends once it has learned, each
        engine receives once it is free); the tasks to `finish`. None where the collective group must be formed
        first (the first push, a restarted engine): forming it needs the actor now."""
        if self.mode == "object_store":
            return self.actor.call_async("put_weights", engines, version)
        if self.members != self.ids(engines):
            return None
        return [*self.actor.call_async("broadcast_weights"), *[e.receive_weights.remote(version) for e in engines]]

    def finish(self, pushing: list[Any]) -> None:
        """Wait for a push `start`ed (raising what failed in it)."""
        sent = gather(pushing)[0]
        if self.mode == "collective":
            self.last = {"weight_sync/bytes": float(sent["bytes"]), "weight_sync/buckets": float(sent["buckets"]),
                         "weight_sync/broadcast_s": sent["seconds"]}

    @staticmethod
    def ids(engines: list[Any]) -> list[str]:
        return [e._actor_id.hex() for e in engines]

    def form(self, engines: list[Any]) -> None:
        self.members = None
        rank0 = self.actor.workers[0]
        (at,) = gather([rank0.serve_weight_group.remote()])
        self.formed += 1
        spec = SyncGroup(at, 1 + len(engines) * self.tp, f"hpcrlhf-weights-{self.formed}")
        chosen = gather([rank0.open_weight_group.remote(spec),
                         *[e.join_weight_group.remote(spec, 1 + i * self.tp) for i, e in enumerate(engines)]])[0]
        self.members = self.ids(engines)
        log.info(f"weight-sync group {spec.name}: actor rank 0 and {len(engines)} engine(s) x TP {self.tp} "
                 f"({spec.world_size} members, {chosen}) at {at.address}")
