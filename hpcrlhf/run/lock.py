"""One job per run folder: `run.lock` names the process that owns the folder while it trains.

Two jobs writing one run folder destroy each other's work (each deletes the other's staging
checkpoints, duplicate steps in metrics.jsonl, retention removing a checkpoint the other just
verified), so the first job to start owns the folder until it ends, and a second is refused with
the owner's host, pid and Slurm job id.

How ownership is decided, in order:
1. `flock` on `run.lock`. The kernel drops the lock when its holder dies (kill -9 included), so a
   live holder on this host always wins and a dead one never blocks. On shared filesystems whose
   locks are cluster-wide (NFS v3 with lockd / NFS v4, GPFS/Spectrum Scale, CephFS, Lustre mounted
   with `-o flock`, BeeGFS with global file locks), the same holds across nodes.
2. The record in the file: host, pid, Slurm job id, start and heartbeat (rewritten every
   `HEARTBEAT_S` seconds by the owner; emptied when it ends cleanly). On filesystems whose locks are
   node-local (Lustre `localflock`, BeeGFS's default, some NFS setups without lockd) `flock` cannot
   see a holder on another node, so a record from another host whose heartbeat is younger than
   `STALE_S` refuses the start. An older heartbeat is a dead job's: taken over with a warning, so a
   job that died on a failed node never blocks its rerun for more than `STALE_S`. A record of the
   same Slurm job id is an earlier attempt of this job (Slurm requeues only after every task of the
   old attempt has ended): taken over at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcrlhf.errors import ConfigError
from hpcrlhf.logs import get_logger
from hpcrlhf.run.diskspace import out_of_space_is_an_error
from hpcrlhf.run.files import open_in_place, os_error_reason

log = get_logger()

LOCK_NAME = "run.lock"
HEARTBEAT_S = 30.0
"""How often the owner rewrites its heartbeat."""
MAX_RECORD_BYTES = 1 << 16
"""More than any record: a lock file larger than this is not one hpcrlhf wrote (read no further)."""
STALE_S = 180.0
"""A record from another host older than this is a dead job's (several missed heartbeats, with
room for clock skew between nodes)."""


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    slurm_job_id: str | None
    started: float
    heartbeat: float

    @classmethod
    def here(cls) -> Owner:
        now = time.time()
        return cls(socket.gethostname(), os.getpid(), os.environ.get("SLURM_JOB_ID"), now, now)

    def describe(self) -> str:
        job = f", Slurm job {self.slurm_job_id}" if self.slurm_job_id else ""
        return (f"pid {self.pid} on {self.host}{job}, started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))}")


FIELDS = {"host": (str,), "pid": (int,), "slurm_job_id": (str, type(None)), "started": (int, float),
          "heartbeat": (int, float)}
"""An owner record's fields and their JSON types."""
_TYPE_NAMES = {str: "text", int: "a whole number", float: "a number", type(None): "null"}


def record_problem(record: object) -> str | None:
    """What makes a parsed lock record not one hpcrlhf writes (None: it is one). Pure."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    if set(record) != set(FIELDS):
        missing, extra = sorted(set(FIELDS) - set(record)), sorted(set(record) - set(FIELDS))
        return "; ".join(([f"missing {', '.join(missing)}"] if missing else [])
                         + ([f"unknown {', '.join(extra)}"] if extra else []))
    for name, types in FIELDS.items():
        value = record[name]
        if isinstance(value, bool) or not isinstance(value, types):
            return f"{name}: {value!r} is not {' or '.join(_TYPE_NAMES[t] for t in types)}"
        if types == (int, float) and not 0 <= value < 1e11:  # NaN and inf fail too; localtime() takes these
            return f"{name}: {value!r} is not a time (seconds since 1970)"
    return None


def parse_owner(text: str, path: Path) -> Owner | None:
    """The owner in a lock file's text; None when empty (released) or not JSON (a torn write: no
    owner worth protecting). JSON that is not an owner record was not written by hpcrlhf: a
    ConfigError naming the file (whoever wrote it may expect it to protect the folder)."""
    try:
        record = json.loads(text)
    except ValueError:
        return None
    problem = record_problem(record)
    if problem:
        raise ConfigError(f"{path} does not hold a record of hpcrlhf ({problem}): if no job uses {path.parent}, "
                          f"delete {path} and rerun")
    return Owner(**record)


def read_owner(path: Path) -> Owner | None:
    """The record in a lock file (see `parse_owner`); None when there is none."""
    try:
        return parse_owner(path.read_text(errors="replace"), path)
    except OSError:
        return None


def takeover_reason(previous: Owner, me: Owner, now: float) -> str | None:
    """Why a record left in the lock file (whose flock this process now holds) belongs to a job that
    is over, or None when it may still be running on another node. Pure: the policy in one place."""
    if previous.host == me.host:
        return f"its process {previous.pid} on this host ended"  # a live one would hold the flock
    if previous.slurm_job_id and previous.slurm_job_id == me.slurm_job_id:
        return f"it was an earlier attempt of this Slurm job ({me.slurm_job_id})"
    age = now - previous.heartbeat
    if age > STALE_S:
        return f"its last heartbeat is {age:.0f} s old (> {STALE_S:.0f} s)"
    return None


_HELD: set[RunLock] = set()


def release_all() -> None:
    """Release every run folder this process owns (a job's runner calls it when the job ends, however
    it ends, so a job that failed in setup does not keep its folder locked in a process that goes on,
    e.g. a test run in-process)."""
    for lock in list(_HELD):
        lock.release()


class RunLock:
    """Ownership of a run folder by this process (see the module docstring); `release()` at the end."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_NAME
        self.owner = Owner.here()
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> RunLock:
        try:  # never through a link, never a FIFO or a file with other hard links (hpcrlhf.run.files)
            fd = open_in_place(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            raise ConfigError(f"--output-dir {self.path.parent}: cannot write {LOCK_NAME} there "
                              f"({os_error_reason(e, self.path)}); use a folder you can write") from None
        try:
            self._take(fd)
        except BaseException:
            _HELD.discard(self)
            self._fd = None
            os.close(fd)  # drops the flock
            raise
        self._thread = threading.Thread(target=self._beat, name="hpcrlhf-run-lock", daemon=True)
        self._thread.start()
        return self

    def _take(self, fd: int) -> None:
        """Hold `fd`'s flock and write this process's record, or raise (the caller closes `fd`)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read(fd)
            raise ConfigError(f"--output-dir {self.path.parent} is in use by another job ("
                              f"{holder.describe() if holder else 'owner not recorded yet'}): one job per run folder; "
                              "wait for it to end, stop it, or use another --output-dir") from None
        except OSError as e:  # ENOLCK/ENOSYS/EOPNOTSUPP: a filesystem without flock (Lustre -o noflock)
            log.warning(f"{self.path}: this filesystem has no file locks ({e.strerror}); only the heartbeat "
                        "record protects the run folder from a second job")
        previous = self._read(fd)
        if previous is not None:
            reason = takeover_reason(previous, self.owner, time.time())
            if reason is None:
                age = time.time() - previous.heartbeat
                raise ConfigError(
                    f"--output-dir {self.path.parent} may be in use by another job ({previous.describe()}; its "
                    f"heartbeat is {age:.0f} s old): one job per run folder. If that job is dead (this filesystem's "
                    f"locks may not reach other nodes), rerun after {STALE_S - age:.0f} s, when its heartbeat is "
                    f"stale, or delete {self.path}")
            log.info(f"{self.path}: taking the run folder over from {previous.describe()}: {reason}")
        self._fd = fd
        _HELD.add(self)
        with out_of_space_is_an_error(self.path.parent, LOCK_NAME):
            self._write(self.owner)

    def _read(self, fd: int) -> Owner | None:
        size = os.fstat(fd).st_size
        return parse_owner(os.pread(fd, min(size, MAX_RECORD_BYTES), 0).decode(errors="replace"), self.path)

    def _write(self, owner: Owner | None) -> None:
        data = json.dumps(asdict(owner)).encode() if owner is not None else b""
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write(Owner(**{**asdict(self.owner), "heartbeat": time.time()}))
            except OSError:  # a full disk must not kill the run from here; a stale heartbeat is the cost
                pass

    def release(self) -> None:
        """Empty the record and drop the lock (idempotent)."""
        if self._fd is None:
            return
        _HELD.discard(self)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._write(None)
        except OSError:
            pass
        os.close(self._fd)  # drops the flock
        self._fd = None
