"""What stops a local Ray cluster when the process that started it dies without stopping it
(`kill -9`, the out-of-memory killer): a small watcher process.

The cluster's daemons (GCS, raylets, agents) run in sessions of their own, so that Ctrl-C and a
scheduler's signals to the driver's process group do not reach them; a killed driver therefore
left them running (~600 MB), with the /dev/shm files of the vLLM engines its actors held (the
engines die with their actor, killed by Ray, and leave their shared memory behind: 25-250 MB per
run). The watcher is started with the cluster, in its own session too, and holds the read end of a
pipe whose write end only the driver has: it learns of the driver's death the moment the kernel
closes that end. Then it stops every process of the cluster (SIGTERM, then SIGKILL), removes the
/dev/shm files they had mapped and the cluster's token, and says so on the driver's stderr. A
driver that stops its cluster tells the watcher first ("done"), which then leaves without
touching anything.

The cluster's processes are its `family`: those whose environment holds the cluster's MARKER
(given to the nodes' `ray start`: the GCS, raylets and agents), every member of their process
groups, and all their descendants (Ray's workers, the vLLM engines they start). The marker alone
is not enough: a process that sets its title (Ray's workers, vLLM's) overwrites the memory
/proc/PID/environ shows. Once the driver is gone Ray kills its actors, and their children are
handed to init: so the watcher records the family, and the /dev/shm files it maps, every few
seconds while the driver lives, each process by pid and start time (a pid reused later is not
taken for it).
"""

from __future__ import annotations

import os
import select
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Callable, Iterable

MARKER = "HPCRLHF_LOCAL_CLUSTER"
"""Environment variable (`MARKER=<id>`) of the processes that start a local cluster's nodes."""
SCAN_S = 3.0
"""How often the watcher records the cluster's processes and the /dev/shm files they have mapped."""
GRACE_S = 5.0
"""How long the cluster's processes get to end on SIGTERM before SIGKILL."""
DONE = b"done\n"

Identity = tuple[int, int]
"""A process: (pid, start time in clock ticks since boot) -- unique, unlike a pid."""


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, parent pid, process group, start time) of a process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def carrying(variable: str) -> list[int]:
    """The processes (of this user: others' cannot be read) whose environment holds `variable`
    (`NAME=value`), this one excepted; a process that has exited (a zombie) has none."""
    word = variable.encode()
    found = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            if word in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:  # gone, or another user's
            continue
    return found


def family(variable: str, spare: Iterable[int] = ()) -> set[Identity]:
    """The processes carrying `variable`, the other members of their process groups (but the groups
    in `spare`), and every descendant of all of them -- living ones, zombies excepted."""
    table = {pid: info for pid in _pids() if (info := _stat(pid)) is not None and info[0] != "Z"}
    roots = [pid for pid in carrying(variable) if pid in table]
    groups = {table[pid][2] for pid in roots} - set(spare)
    found = set(roots) | {pid for pid, info in table.items() if info[2] in groups}
    found.discard(os.getpid())
    grew = True
    while grew:  # descendants, generation by generation
        children = {pid for pid, info in table.items() if info[1] in found and pid not in found}
        grew = bool(children - {os.getpid()})
        found |= children - {os.getpid()}
    return {(pid, table[pid][3]) for pid in found}


def alive(processes: Iterable[Identity]) -> list[int]:
    """The pids of `processes` that still run (same start time: not a reused pid; not a zombie)."""
    return [pid for pid, start in processes if (info := _stat(pid)) is not None and info[3] == start and info[0] != "Z"]


def shm_mapped(pids: Iterable[int]) -> dict[str, int]:
    """/dev/shm files mapped by `pids`: path -> inode (a file of that name made later is not theirs)."""
    files = {}
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/") and not fields[5].endswith(" (deleted)"):
                files[fields[5]] = int(fields[4])
    return files


def terminate(send: Callable[[int], None], running: Callable[[], bool], grace_s: float) -> None:
    """`send(SIGTERM)`, wait up to `grace_s` for `running()` to turn false, then the same with SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        send(sig)
        deadline = time.monotonic() + grace_s
        while running() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not running():
            return


def stop(processes: set[Identity], grace_s: float = GRACE_S) -> None:
    """SIGTERM every process of `processes` still running, SIGKILL those left after `grace_s`."""
    def send(sig: int) -> None:
        for pid in alive(processes):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    terminate(send, lambda: bool(alive(processes)), grace_s)


def remove_shm(files: dict[str, int]) -> list[str]:
    """Unlink each recorded /dev/shm file that is still the same regular file of this user: the names removed."""
    removed = []
    for path, inode in sorted(files.items()):
        try:
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_ino == inode and info.st_uid == os.getuid():
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    return removed


def watch(cluster_id: str, owner_pid: int, root: str, token: str | None, pipe: int = 0) -> int:
    """Wait for the owner on file descriptor `pipe`: "done" ends the watch quietly; its end of the
    pipe closing without it (the owner died) stops and cleans the cluster."""
    variable = f"{MARKER}={cluster_id}"
    spare = {os.getpgid(0)}  # never this watcher's group, nor the owner's (its shell's job)
    try:
        spare.add(os.getpgid(owner_pid))
    except ProcessLookupError:
        pass
    seen: set[Identity] = set()
    files: dict[str, int] = {}

    def record() -> None:
        seen.update(family(variable, spare))
        files.update(shm_mapped(alive(seen)))

    said = b""
    while True:
        ready, _, _ = select.select([pipe], [], [], SCAN_S)
        if not ready:
            record()
            continue
        data = os.read(pipe, len(DONE))
        said += data
        if said == DONE:
            return 0
        if not data:
            break  # EOF: the owner is gone
    record()
    count = len(alive(seen))
    stop(seen)
    stop(family(variable, spare))  # any started since the last look
    removed = remove_shm(files)
    if token:
        Path(token).unlink(missing_ok=True)
    print(f"hpcrlhf: the process (pid {owner_pid}) that started the local Ray cluster in {root} died without "
          f"stopping it: stopped its {count} remaining process(es)"
          + (f" and removed its shared memory ({', '.join(removed)})" if removed else ""), file=sys.stderr, flush=True)
    return 0


class Reaper:
    """The owner's handle on its watcher: `dismiss()` once the cluster is stopped."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    @classmethod
    def start(cls, cluster_id: str, root: Path, token: Path | None) -> Reaper:
        """The watcher of the cluster whose nodes carry MARKER=cluster_id, in a session of its own, with
        this process's stderr."""
        env = {k: v for k, v in os.environ.items() if k != MARKER}
        proc = subprocess.Popen([sys.executable, "-m", "hpcrlhf.cluster.reaper", cluster_id, str(os.getpid()),
                                 str(root), str(token or "")], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        return cls(proc)

    def dismiss(self) -> None:
        """The cluster was stopped: the watcher leaves without touching anything."""
        if self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(DONE)
            self.proc.stdin.close()
        except OSError:  # it died already
            pass
        self.proc.stdin = None
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main(argv: list[str] | None = None) -> int:
    cluster_id, owner, root, token = (sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the driver, which dismisses this
    return watch(cluster_id, int(owner), root, token or None)


if __name__ == "__main__":
    sys.exit(main())
