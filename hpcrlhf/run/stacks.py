"""The Python stacks of a process that seems stuck, written where people will look for them.

`dump_stacks(path)`: every thread of this process (`faulthandler`, which needs no lock and works while
other threads wait in C code). `py_spy(pid)`: another process on this host, read from outside with
py-spy (`py-spy dump --nonblocking`: it does not stop the process), when py-spy is installed and
ptrace is allowed; the reason otherwise.

A process that may get stuck where the one watching it cannot look (a Ray worker, on any node) arms
`dump_on_signal()` when it starts: on STACKS_SIGNAL faulthandler writes its stacks into an unnamed file
(made private and unlinked at once: nothing is left behind), which `signalled_stacks(pid, fd)` reads
on that host as /proc/PID/fd/FD; a process that writes nothing (stopped, or stuck in the kernel) is
read by py-spy instead."""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

from hpcrlhf.run.files import make_folders, replacing

PY_SPY_TIMEOUT_S = 20.0
"""How long `py_spy` waits for py-spy's answer."""
STACKS_SIGNAL = signal.SIGRTMIN + 7
"""Asks a process armed by `dump_on_signal` for its stacks (a real-time signal, as the watchdog's own)."""
SIGNALLED_WAIT_S = 2.0
"""How long `signalled_stacks` waits for the stacks a signalled process writes."""
_ARMED: list[BinaryIO] = []
"""The files `dump_on_signal` gave faulthandler (kept open for the process's life)."""


def dump_stacks(path: Path) -> Path:
    """Write the stacks of every thread of this process into `path` (its folder made); returns `path`."""
    make_folders(path.parent, "the watchdog's stacks folder")
    with replacing(path) as f:  # a new file renamed into place: never written through a link
        f.write(f"# Python stacks of every thread of process {os.getpid()}, most recent call first\n".encode())
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)
    return path


def py_spy(pid: int, *, subprocesses: bool = False, timeout_s: float = PY_SPY_TIMEOUT_S) -> str:
    """The stacks of process `pid` as py-spy reads them, or a line saying why they could not be read."""
    beside = Path(sys.executable).parent / "py-spy"  # installed with hpcrlhf in a virtual environment not on PATH
    exe = shutil.which("py-spy") or (str(beside) if os.access(beside, os.X_OK) else None)
    if exe is None:
        return f"(no stacks of process {pid}: py-spy is not installed here)"
    cmd = [exe, "dump", "--pid", str(pid), "--nonblocking"] + (["--subprocesses"] if subprocesses else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"(no stacks of process {pid}: py-spy gave no answer within {timeout_s:g} s)"
    if proc.returncode == 0:
        return proc.stdout
    why = (proc.stderr.strip().splitlines() or [f"status {proc.returncode}"])[-1]
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if scope.exists() and scope.read_text().strip() not in ("", "0"):
        why += f" (ptrace_scope is {scope.read_text().strip()}: only a parent or root may read another process)"
    return f"(no stacks of process {pid}: py-spy failed: {why})"


def dump_on_signal() -> int:
    """Arm this process to write the stacks of every thread on STACKS_SIGNAL into a file of its own,
    which has no name (created private in the temp folder and unlinked at once); returns the file's
    descriptor, by which another process of this user on this host reads it (`signalled_stacks`).
    Once per process: a second call returns the same descriptor."""
    if _ARMED:
        return _ARMED[0].fileno()
    fd, path = tempfile.mkstemp(prefix="hpcrlhf-stacks-", suffix=".txt")
    os.unlink(path)
    sink = os.fdopen(fd, "wb", buffering=0)
    faulthandler.register(STACKS_SIGNAL, file=sink, all_threads=True, chain=False)
    _ARMED.append(sink)
    return fd


def signalled_stacks(pid: int, fd: int, wait_s: float = SIGNALLED_WAIT_S) -> str:
    """The stacks of process `pid` of this host, armed by `dump_on_signal` (its file `fd`): what it writes
    on STACKS_SIGNAL, or -- when it writes nothing within `wait_s` (stopped, or stuck in the kernel) --
    py-spy's reading of it, or why there is none."""
    source = Path(f"/proc/{pid}/fd/{fd}")
    try:
        before = source.stat().st_size
        os.kill(pid, STACKS_SIGNAL)
    except (ProcessLookupError, FileNotFoundError):
        return f"(no stacks of process {pid}: it has ended)"
    except PermissionError as e:
        return f"(no stacks of process {pid}: {e})"
    deadline, size = time.monotonic() + wait_s, before
    try:
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = source.stat().st_size
            if before < size == now:  # it wrote, and has stopped writing
                break
            size = now
        if size > before:
            with source.open("rb") as f:
                f.seek(before)
                return f.read().decode(errors="replace")
    except FileNotFoundError:
        return f"(no stacks of process {pid}: it ended while asked for them)"
    return (f"(process {pid} wrote no stacks within {wait_s:g} s of signal SIGRTMIN+7: it is stopped, or "
            "stuck in the kernel; py-spy reads it from outside:)\n" + py_spy(pid))
