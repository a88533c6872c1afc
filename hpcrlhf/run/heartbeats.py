"""Heartbeats of a job's ranks, so that a rank whose wait hangs can name the peer it waits for.

A rank stuck in a collective (torchrun or MPI ranks; gloo or NCCL) knows only that the collective
does not end; the peer that never joins it may be stopped (SIGSTOP, a node frozen by the kernel),
stuck in C code that holds Python's lock, or gone with its node. Each rank of a job of several writes
`RUN/watchdog/rank<R>.json` every `period_s` from a thread of its own -- host, pid, step, the phases
it is in, the time -- and the watchdog of a rank whose wait expired reads the others' (`silent`):
a peer whose last heartbeat is older than `silent_after_s` (or that never wrote one this attempt) is
named, with where it ran: `rank 1 (n2, pid 4242): no heartbeat for 31 s`. A peer that beats on is
not named: it is alive (waiting too, or busy), and its own watchdog says what it waits for.
Each rank also writes its own stacks when its wait expires (`hpcrlhf.run.watchdog`).

The times compared are the writers' clocks (`time.time()`), which a cluster's nodes keep in step;
`silent_after_s` is a few periods: far above their skew, below any sane deadline (watchdog.floor_s).
The files are small, rewritten in place (`replace_file`: a new file renamed over the old, never
through a link).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrlhf.run.files import make_folders, replace_file

PERIOD_S = 5.0
"""How often a rank writes its heartbeat."""
SILENT_AFTER_S = 3 * PERIOD_S
"""A heartbeat older than this is a silent rank's."""


def node_name() -> str:
    """This node's name as its scheduler knows it (Slurm's, inside a job step), else its host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


@dataclass
class Heartbeats:
    """The heartbeats of rank `rank` of `world_size` in `folder`: `start(state)` writes this rank's every
    `period_s` (`state()`: its step and phases), `silent()` names the peers gone quiet."""

    folder: Path
    rank: int
    world_size: int
    period_s: float = PERIOD_S
    silent_after_s: float = SILENT_AFTER_S
    clock: Callable[[], float] = time.time
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _started: float = field(default=0.0, init=False, repr=False)

    def path(self, rank: int) -> Path:
        return self.folder / f"rank{rank}.json"

    def start(self, state: Callable[[], dict[str, Any]]) -> Heartbeats:
        self._started = self.clock()
        make_folders(self.folder, "the watchdog's folder")
        self.beat(state())
        threading.Thread(target=self._run, args=(state,), name="hpcrlhf-heartbeat", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def beat(self, state: dict[str, Any]) -> None:
        record = {"rank": self.rank, "host": node_name(), "pid": os.getpid(), **state, "at": self.clock()}
        replace_file(self.path(self.rank), json.dumps(record) + "\n")

    def _run(self, state: Callable[[], dict[str, Any]]) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.beat(state())
            except OSError:  # a full or unreachable file system: the next beat tries again
                continue

    def silent(self) -> list[str]:
        """The peers whose last heartbeat (of this attempt: since `start`) is older than `silent_after_s`,
        named with where they ran and how long they have been silent."""
        now, named = self.clock(), []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            try:
                record = json.loads(self.path(rank).read_text())
            except (OSError, ValueError):
                record = {}
            at = record.get("at") if isinstance(record.get("at"), (int, float)) else None
            if at is not None and at >= self._started - self.period_s and now - at <= self.silent_after_s:
                continue
            if at is None or at < self._started - self.period_s:  # none, or a previous attempt's
                quiet = f"no heartbeat in this attempt's {now - self._started:.0f} s"
            else:
                quiet = f"no heartbeat for {now - at:.0f} s"
            where = f" ({record.get('host')}, pid {record.get('pid')})" if at is not None else ""
            named.append(f"rank {rank}{where}: {quiet}")
        return named
