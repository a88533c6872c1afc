"""`hpcrlhf` CLI runs forked from a warm process: the tests' ~100 single-process CLI jobs each spent
~9 s of CPU importing torch and transformers before doing anything (docs/tests.md, "Where CI's
time goes"); forked from a process that has imported them already, a job starts at once.

The warm process (`python -m tests.cli_forks`, one per test process, started at the first run and
again when the test process's environment changed) has imported torch, transformers and hpcrlhf's
CLI, and has run nothing: no thread besides its main one (checked: a fork copies only the forking
thread), no torch op (no OpenMP pool), no DeepSpeed (its import-time accelerator warning belongs in
each job's own run log). For each job it forks a child that takes the job's environment, umask,
working folder and argv, writes stdout and stderr to files the test reads, runs `hpcrlhf.cli.main`
as `python -m hpcrlhf` would, and exits with its status.

`run_cli` falls back to a fresh process where a fork cannot behave like one: several ranks
(torchrun), an environment that differs from the warm process's in a variable some library reads
when imported (only FORKABLE_ENV may differ; PYTHONPATH is applied to sys.path), or a warm process
that could not start cleanly. HPCRLHF_TEST_FORKS=0 turns forking off."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FORKABLE_ENV = {"PYTHONPATH", "SLURM_CONF", "HPCRLHF_VERBOSE", "PYTEST_CURRENT_TEST"}
"""Variables a job's environment may set differently from the warm process's: read when used (or,
PYTHONPATH, applied to sys.path in the child), never when a library is imported."""

WARM_IMPORTS = ("torch", "transformers", "transformers.modeling_utils", "hpcrlhf.cli", "hpcrlhf.models.tiny",
                "hpcrlhf.engines.distributed")


# ---------------------------------------------------------------- the warm process


def _child(request: dict) -> int:
    """In the forked child: become the job, run it, return its exit status."""
    os.setpgid(0, 0)  # (signal dispositions: the warm process's, which set none: a fresh Python's)
    os.umask(request["umask"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = extra
    if extra:
        import importlib

        importlib.invalidate_caches()
    os.chdir(request["cwd"])
    sys.argv = [str(ROOT / "hpcrlhf" / "__main__.py"), *request["args"]]
    from hpcrlhf.cli import main

    try:
        status = main()  # argv from sys.argv, as `python -m hpcrlhf` calls it (its routing of the libraries'
        # output then lasts until the process ends: their lines at exit go to the run log too)
    except SystemExit as stop:  # what the interpreter makes of it: None 0, a number itself, else printed and 1
        status = stop.code
        if status is not None and not isinstance(status, int):
            print(status, file=sys.stderr)
            status = 1
    except BaseException:  # an uncaught exception
        import traceback

        traceback.print_exc()
        status = 1
    return status or 0


def serve(answer_fd: int) -> None:
    """The warm process: requests (one JSON line each) on stdin, answers on `answer_fd`."""
    import importlib

    for name in WARM_IMPORTS:
        importlib.import_module(name)
    answers = os.fdopen(answer_fd, "w", buffering=1)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1 or threading.active_count() != 1:
        answers.write(json.dumps({"error": f"{threads} threads after the imports: forking is unsafe"}) + "\n")
        return
    answers.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                answers.close()
                status = _child(request)
            finally:
                try:
                    atexit._run_exitfuncs()
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(status & 0xFF)
        answers.write(json.dumps({"pid": pid}) + "\n")
        _, wait_status = os.waitpid(pid, 0)
        answers.write(json.dumps({"status": os.waitstatus_to_exitcode(wait_status)}) + "\n")


# ---------------------------------------------------------------- the test process's side


class WarmProcess:
    def __init__(self, env: dict[str, str]):
        self.env = env
        read, write = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_forks", str(write)], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     pass_fds=(write,), text=True, start_new_session=True)
        os.close(write)
        self.answers, self.pending = read, b""
        self.lock = threading.Lock()
        hello = self._answer(timeout=300)
        self.ready = "ready" in hello
        atexit.register(self.close)

    def _answer(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.answers], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
            chunk = os.read(self.answers, 65536)
            if not chunk:
                raise EOFError("the warm process ended")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def accepts(self, env: dict[str, str]) -> bool:
        keys = set(env) | set(self.env)
        return self.ready and self.proc.poll() is None and self.answers >= 0 and all(
            env.get(k) == self.env.get(k) for k in keys - FORKABLE_ENV)

    def run(self, args: list[str], env: dict[str, str], folder: Path, timeout: float) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of `hpcrlhf ARGS` forked with `env` in ROOT; the job is
        killed (its process group) after `timeout` s and subprocess.TimeoutExpired raised."""
        out, err = folder / "stdout", folder / "stderr"
        with self.lock:
            try:
                mask = os.umask(0)
                os.umask(mask)
                self.proc.stdin.write(json.dumps({"args": args, "env": env, "cwd": str(ROOT), "umask": mask,
                                                  "stdout": str(out), "stderr": str(err)}) + "\n")
                self.proc.stdin.flush()
                pid = self._answer(timeout=60)["pid"]
            except (OSError, TimeoutError, EOFError):
                self.close()  # the next run starts a new warm process
                raise
            try:
                status = self._answer(timeout=timeout)["status"]
            except TimeoutError:
                os.killpg(pid, signal.SIGKILL)
                self._answer(timeout=60)
                raise subprocess.TimeoutExpired(["hpcrlhf", *args], timeout, out.read_text(), err.read_text()) from None
        return status, out.read_text(errors="replace"), err.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.answers >= 0:
            os.close(self.answers)
            self.answers = -1


_warm: WarmProcess | None = None


def warm_process(env: dict[str, str]) -> WarmProcess | None:
    """This test process's warm process with environment `env` (started at the first call, and again
    when `env` changed -- a test left a variable set), or None where jobs must start fresh
    (HPCRLHF_TEST_FORKS=0, or it could not start cleanly)."""
    global _warm
    if os.environ.get("HPCRLHF_TEST_FORKS", "1") == "0" or (_warm is not None and not _warm.ready):
        return None  # (one that found threads after its imports: every later one would too)
    if _warm is not None and not _warm.accepts(env):
        _warm.close()
    if _warm is None or _warm.proc.poll() is not None or _warm.answers < 0:
        try:
            _warm = WarmProcess(env)
        except (TimeoutError, EOFError, OSError):
            return None
    return _warm if _warm.ready else None


if __name__ == "__main__":
    serve(int(sys.argv[1]))
