"""What stops a local Ray cluster when the process that started it dies without stopping it
(`kill -9`, the out-of-memory killer): a small watcher process.

The cluster's daemons (GCS, raylets, agents) run in sessions of their own, so that Ctrl-C and a
scheduler's signals to the driver's process group do not reach them; a killed driver therefore
left them running (~600 MB), with the /dev/shm files of the vLLM engines its actors held (the
engines die with their actor, killed by Ray, and leave their shared memory behind: 25-250 MB per
run). The watcher is started with the cluster, in its own session too, and holds the read end of a
pipe whose write end only the driver has: it learns of the driver's death the moment the kernel
closes that end. Then it stops every process of the cluster -- found by a marker in their
environment (MARKER, given to the nodes' `ray start` and inherited by every worker and everything
a worker starts, vLLM's engine processes included), SIGTERM then SIGKILL -- removes the
/dev/shm files those processes had mapped (recorded every few seconds while the driver lived:
once the engines are killed, nothing else names them) and the cluster's token, and says so on the
driver's stderr. A driver that stops its cluster tells the watcher first ("done"), which then
leaves without touching anything.
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
from typing import Callable, Optional

MARKER = "HPCRLHF_LOCAL_CLUSTER"
"""Environment variable (`MARKER=<id>`) in every process of one local cluster."""
SCAN_S = 3.0
"""How often the watcher records the /dev/shm files the cluster's processes have mapped."""
GRACE_S = 5.0
"""How long the cluster's processes get to end on SIGTERM before SIGKILL."""
DONE = b"done\n"


def marked(cluster_id: str) -> list[int]:
    """The pids of this user's processes that carry `MARKER=cluster_id` (not this process)."""
    return carrying(f"{MARKER}={cluster_id}")


def carrying(variable: str) -> list[int]:
    """The pids of the processes (of this user: others' cannot be read) whose environment holds
    `variable` (`NAME=value`), this one excepted; a process that has exited (a zombie) has none."""
    word = variable.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if word in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or another user's
            continue
    return found


def shm_mapped(pids: list[int]) -> dict[str, int]:
    """/dev/shm files mapped by `pids`: path -> inode (a file of that name made later is not theirs)."""
    files = {}
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                files[fields[5].removesuffix(" (deleted)")] = int(fields[4])
    return files


def terminate(send: Callable[[int], None], alive: Callable[[], bool], grace_s: float) -> None:
    """`send(SIGTERM)`, wait up to `grace_s` for `alive()` to turn false, then the same with SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        send(sig)
        deadline = time.monotonic() + grace_s
        while alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not alive():
            return


def stop_marked(cluster_id: str, grace_s: float = GRACE_S) -> int:
    """SIGTERM every process of the cluster, SIGKILL those left after `grace_s`; how many there were."""
    count = len(marked(cluster_id))

    def send(sig: int) -> None:
        for pid in marked(cluster_id):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    terminate(send, lambda: bool(marked(cluster_id)), grace_s)
    return count


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


def watch(cluster_id: str, owner_pid: int, root: str, token: Optional[str], pipe: int = 0) -> int:
    """Wait for the owner on file descriptor `pipe`: "done" ends the watch quietly; its end of the
    pipe closing without it (the owner died) stops and cleans the cluster."""
    files: dict[str, int] = {}
    said = b""
    while True:
        ready, _, _ = select.select([pipe], [], [], SCAN_S)
        if ready:
            data = os.read(pipe, len(DONE))
            said += data
            if said == DONE:
                return 0
            if not data:
                break  # EOF: the owner is gone
            continue
        files.update(shm_mapped(marked(cluster_id)))
    files.update(shm_mapped(marked(cluster_id)))
    count = stop_marked(cluster_id)
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
    def start(cls, cluster_id: str, root: Path, token: Optional[Path]) -> "Reaper":
        """The watcher of the cluster `cluster_id` (its processes carry MARKER=cluster_id), in a session
        of its own, with this process's stderr."""
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


def main(argv: Optional[list[str]] = None) -> int:
    cluster_id, owner, root, token = (sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the driver, which dismisses this
    return watch(cluster_id, int(owner), root, token or None)


if __name__ == "__main__":
    sys.exit(main())
