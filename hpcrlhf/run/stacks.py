"""The Python stacks of a process that seems stuck, written where people will look for them.

`dump_stacks(path)`: every thread of this process (`faulthandler`, which needs no lock and works while
other threads wait in C code). `py_spy(pid)`: another process on this host, read from outside with
py-spy (`py-spy dump --nonblocking`: it does not stop the process), when py-spy is installed and
ptrace is allowed; the reason otherwise."""

from __future__ import annotations

import faulthandler
import os
import shutil
import subprocess
from pathlib import Path

from hpcrlhf.run.files import make_folders, replacing

PY_SPY_TIMEOUT_S = 20.0
"""How long `py_spy` waits for py-spy's answer."""


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
    exe = shutil.which("py-spy")
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
