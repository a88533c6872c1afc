"""A sandbox for running generated programs (the `code` rule's tests) next to a training job.

A run (`Sandbox.run`) is one program with its files and its stdin, in a process tree of its own
(started by `sandbox_launch.py`, standard library only). What it guarantees:

- limits per process, which the program cannot raise: CPU time (RLIMIT_CPU), address space
  (RLIMIT_AS), file size (RLIMIT_FSIZE; its stdout is a file and counts), no core files;
- a process count (RLIMIT_NPROC) for the run alone: the run has a user namespace of its own, in
  which Linux (>= 5.14) counts its processes apart from every other process of the same user, so a
  fork bomb stops at `processes` and the job's own processes are untouched. (RLIMIT_NPROC does not
  bind root: started as root, the run drops to the user nobody first.)
- a wall-clock timeout: past it the run's whole process group is killed (SIGKILL);
- nothing left behind: the program runs as PID 1 of a PID namespace of its own, and when it ends
  (or is killed with its launcher) the kernel kills every other process in the namespace, daemons
  and processes that left the group included; System V and POSIX IPC objects live in an IPC
  namespace of its own and go with it;
- a private filesystem: every mount is read-only to the program (Linux >= 5.12) except a fresh
  tmpfs at /tmp (also seen at /var/tmp and /dev/shm) holding the run's files, of at most
  `file_size_mb` in all: its working folder, HOME and TMPDIR. What it writes lives in memory and
  is gone when its last process ends; the host folder the files came from (under $TMPDIR) is
  removed afterwards. A minimal environment (PATH, HOME, TMPDIR, a UTF-8 locale, one thread for
  numeric libraries): nothing of the job's (tokens, paths) reaches it; Python starts isolated (`-I`);
- no network: the run has a network namespace of its own with only loopback. Where the kernel
  cannot make one (unprivileged user namespaces off, and not root), the sandbox refuses to start --
  the job fails when it builds the rule, naming the reason -- unless `rules.code.allow_host_network`
  is set; the run then also has no PID, IPC or mount namespace: it runs in its host folder, only
  its process group is killed, what it writes elsewhere stays, and RLIMIT_NPROC counts the user's
  other processes too.
- programs as root: never. Started as root, a run becomes the user nobody, with no groups (so the
  interpreter, `rules.code.python`, must be one nobody can run: not one under /root).

What it does NOT protect against (run generated code you do not trust on nodes you can lose):
- kernel exploits: the namespaces and limits are the kernel's; a kernel bug can break out;
- reads: a program may read every file its user may read (no network to send them anywhere, but
  what it prints goes into the job's rewards and logs); run as yourself, that is your files;
- writes on kernels older than 5.12 (no read-only view of the host's mounts): there a program may
  write outside /tmp wherever its user may (run as yourself, into your own files), and that stays;
- side channels and contention: runs share the node's CPUs, caches, memory bandwidth and page
  cache with the job (`rules.workers` bounds how many run at once, not what each one costs);
- memory outside RLIMIT_AS: its /tmp (up to `file_size_mb` per run, counted in the job's memory),
  kernel memory, and the time a busy node takes to kill a run;
- a program that inspects its test harness in memory (an assert-style test passes when the harness
  prints a per-run secret after the tests: early exits do not pass, but code that reads the
  harness's variables could).
"""

from __future__ import annotations

import json
import os
import pwd
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping

LAUNCHER = Path(__file__).with_name("sandbox_launch.py")
REFUSED, CANNOT_RUN = 125, 127  # sandbox_launch's exit statuses
END_GRACE_S = 10.0
"""How long a run's launcher has to end its PID namespace after its timeout."""
PIPE_SAFE = 4096
"""Bytes of stdin that fit in any pipe's buffer (one page): written before the program starts
without blocking; more goes through an unnamed file instead."""
PROGRAM_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""The program's environment, with HOME and TMPDIR (its folder) added by the launcher."""


class SandboxError(RuntimeError):
    """The sandbox cannot run programs here as asked (the reason in words)."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float
    """Wall-clock time of a run."""
    cpu_time_s: int
    """CPU seconds of each process."""
    memory_mb: int
    """Address space of each process, MiB."""
    file_size_mb: int
    """Largest file, MiB."""
    processes: int
    """Processes and threads at once, the program included."""


@dataclass(frozen=True)
class Outcome:
    """How a run ended."""

    exit_status: int | None
    """The program's exit status (128 + N: killed by signal N, e.g. 137 at its CPU limit, 153 past its
    file size); None: killed at the wall-clock timeout."""
    stdout: bytes
    """What it wrote on stdout (at most the file size limit)."""
    isolation: Mapping
    """What the launcher got: network, PID namespace, filesystem, user, process counting."""


class Sandbox:
    """Runs programs with `python` under `limits` (see the module docstring). Thread-safe: runs
    started from several threads proceed in parallel; `kill_all` ends every run under way."""

    def __init__(self, python: str, limits: Limits, allow_host_network: bool = False):
        self.python, self.limits, self.allow_host_network = python, limits, allow_host_network
        self.as_user = _unprivileged_user() if os.geteuid() == 0 else None
        self.lock = threading.Lock()
        self.running: set[subprocess.Popen] = set()
        self.closed = False

    def _spec(self, argv: list[str], status_fd: int) -> str:
        mb = 1 << 20
        limits = self.limits
        return json.dumps({
            "argv": argv, "env": PROGRAM_ENV,
            "uid": self.as_user[0] if self.as_user else None, "gid": self.as_user[1] if self.as_user else None,
            "limits": {"cpu_s": limits.cpu_time_s, "memory_bytes": limits.memory_mb * mb,
                       "file_bytes": limits.file_size_mb * mb, "processes": limits.processes},
            "allow_host_network": self.allow_host_network, "status_fd": status_fd})

    def run(self, files: Mapping[str, str], args: list[str], stdin: bytes = b"") -> Outcome:
        """Run `python -I -B *args` in a fresh folder holding `files` (name -> text), with `stdin`.
        Raises SandboxError when the sandbox refuses (no network namespace) or cannot start Python."""
        workdir = tempfile.mkdtemp(prefix="hpcrlhf-sandbox-")
        try:
            for name, text in files.items():
                Path(workdir, name).write_text(text, encoding="utf-8")
            if self.as_user:
                os.chown(workdir, *self.as_user)
            return self._launch([self.python, "-I", "-B", *args], workdir, stdin)
        finally:
            shutil.rmtree(workdir, onerror=_writable_then_retry)

    def _launch(self, argv: list[str], workdir: str, stdin: bytes) -> Outcome:
        status_r, status_w = os.pipe()
        with tempfile.TemporaryFile() as out, _stdin(stdin) as source:
            try:
                with self.lock:
                    if self.closed:
                        raise SandboxError("the sandbox was closed")
                    proc = subprocess.Popen([sys.executable, "-I", "-S", str(LAUNCHER), self._spec(argv, status_w)],
                                            cwd=workdir, env={}, stdin=source, stdout=out, stderr=subprocess.DEVNULL,
                                            pass_fds=(status_w,), start_new_session=True)
                    self.running.add(proc)
            finally:
                os.close(status_w)
            deadline, report = time.monotonic() + self.limits.timeout_s, {}
            with os.fdopen(status_r) as status_pipe:
                try:
                    report = _report(status_pipe, self.limits.timeout_s)
                    status = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    status = None
                finally:
                    _end(proc, report.get("isolation", {}).get("pids", False))
                    with self.lock:
                        self.running.discard(proc)
            if "refused" in report:
                raise SandboxError(report["refused"])
            out.seek(0)
            return Outcome(status, out.read(), report.get("isolation", {}))

    def kill_all(self) -> None:
        """End every run under way (and refuse new ones until `reopen`)."""
        with self.lock:
            self.closed = True
            for proc in self.running:
                _kill_group(proc)

    def reopen(self) -> None:
        with self.lock:
            self.closed = False


def _report(status_pipe, timeout_s: float) -> dict:
    """The launcher's report: the JSON line it writes, and closes, before the program starts ({} when
    it wrote none)."""
    ready, _, _ = select.select([status_pipe], [], [], timeout_s)
    if not ready:
        raise subprocess.TimeoutExpired("sandbox_launch.py", timeout_s)
    return json.loads(status_pipe.read() or "{}")


def _end(proc: subprocess.Popen, pids: bool) -> None:
    """End a run and reap its launcher. With a PID namespace the launcher is asked (SIGTERM) to kill
    the program and returns once the kernel has ended every process of the namespace, so nothing of
    the run is left when this returns; a launcher that has not within `END_GRACE_S` is killed with its
    process group, as is a run without a PID namespace."""
    if pids and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=END_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (the launcher is its leader: start_new_session) and reap the launcher."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class _stdin:
    """A run's stdin: a pipe already holding the bytes when they fit in its buffer (read once, they
    are gone: a program cannot read them twice), else an unnamed file."""

    def __init__(self, data: bytes):
        self.data = data

    def __enter__(self):
        if len(self.data) <= PIPE_SAFE:
            r, w = os.pipe()
            os.write(w, self.data)
            os.close(w)
            self.file = os.fdopen(r, "rb")
        else:
            self.file = tempfile.TemporaryFile()
            self.file.write(self.data)
            self.file.seek(0)
        return self.file

    def __exit__(self, *exc) -> None:
        self.file.close()


def _unprivileged_user() -> tuple[int, int]:
    """(uid, gid) of the user nobody, which runs programs when hpcrlhf runs as root."""
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def _writable_then_retry(function, path, excinfo) -> None:
    """shutil.rmtree's error handler: a folder the program made unwritable is made writable, and the
    removal tried again."""
    os.chmod(os.path.dirname(path), 0o700)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, 0o700)
        shutil.rmtree(path, onerror=_writable_then_retry)
    else:
        function(path)
