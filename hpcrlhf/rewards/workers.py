"""Checking answers in parallel, each check in a process a deadline can kill.

A check of a model's answer can run forever inside C code that no signal interrupts: sympy raising
9 to the 9^9-th power holds the interpreter for hours, and SIGALRM -- what `hpcrlhf.run.usercode` and
math-verify's own timeouts use -- waits for it. So the built-in rules check in other processes and
the job only waits, with a deadline per check:

- `run_parallel(fn, items, workers, abort)`: `fn(item)` for every item, `workers` at a time in
  threads of this process that each wait on one process or server (a sandboxed test run, a
  worker's answer, a reward server's); a stop request (`hpcrlhf.run.signals.interruptible`) or an error
  calls `abort` (which kills the processes), drops the items not begun, and is raised at once.
- `WorkerPool`: long-lived worker processes (a checker that imports sympy once, not per answer)
  answering one JSON request at a time over pipes; a worker past the deadline is killed and a new
  one started for the next request, its answer counted as None. A worker is a `serve(handle)` loop.

`default_workers()` is the `rules.workers` default: the CPU cores this process may use, shared
among the training processes of its node.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from collections.abc import Callable, Iterable, Sequence

from hpcrlhf.run.signals import interruptible

T = TypeVar("T")
R = TypeVar("R")

READY = "ready"
"""What a worker prints once it can answer (its imports done)."""


def default_workers() -> int:
    """The CPU cores this process may use (its affinity: Slurm's cpuset), divided among the training
    processes of its node (LOCAL_WORLD_SIZE, set by every launcher), at least 1."""
    cores = len(os.sched_getaffinity(0))
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, cores // local)


def run_parallel(fn: Callable[[T], R], items: Sequence[T], workers: int, abort: Callable[[], None]) -> list[R]:
    """[fn(item) for item in items], `workers` at a time; on a stop request or an error (raised in
    this thread), `abort()` ends what runs, the items not begun are dropped, and it is raised."""
    if not items:
        return []
    pool = ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="hpcrlhf-check")
    try:
        futures = [pool.submit(fn, item) for item in items]
        with interruptible():
            results = [f.result() for f in futures]
    except BaseException:
        abort()
        pool.shutdown(wait=False, cancel_futures=True)  # what `abort` cannot cut short ends by its own deadline
        raise
    pool.shutdown()
    return results


class WorkerError(RuntimeError):
    """A worker could not start (it printed why on its stderr, given here)."""


class _Worker:
    """One worker process: a JSON line in, a JSON line out."""

    def __init__(self, argv: list[str], env: dict[str, str], start_timeout_s: float):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, text=True, bufsize=1)
        line = self._line(start_timeout_s)
        if line != READY:
            self.kill()
            why = self.proc.stderr.read() if line is None else line  # None: it ended, or never said it was ready
            raise WorkerError((why or f"no answer within {start_timeout_s:g} s").strip()[-2000:])
        self.proc.stderr.close()  # a ready worker writes no more there (serve sends it to /dev/null)

    def _line(self, timeout_s: float) -> str | None:
        """The next line the worker writes, or None when it ends or `timeout_s` passes first."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = self.proc.stdout.readline()  # the worker writes each answer whole, in one write
        return line.rstrip("\n") if line else None

    def ask(self, request: Any, timeout_s: float) -> Any | None:
        """The worker's answer to `request`, or None when it did not answer within `timeout_s` (or died)."""
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError:  # BrokenPipeError: it died (its memory limit, say)
            return None
        line = self._line(timeout_s)
        return None if line is None else json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class WorkerPool:
    """Up to `size` worker processes started from `argv`, asked in parallel (`ask_all`). Workers start
    when first needed and stay until `close()` (or until this process ends: a worker ends at the end
    of its input)."""

    def __init__(self, argv: list[str], size: int, timeout_s: float, env: dict[str, str] | None = None,
                 start_timeout_s: float = 120.0):
        self.argv, self.size, self.timeout_s, self.start_timeout_s = argv, size, timeout_s, start_timeout_s
        self.env = dict(os.environ if env is None else env)
        self.idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(size):
            self.idle.put(None)  # a slot: a worker is started in it when first needed
        self.busy: set[_Worker] = set()
        self.lock = threading.Lock()

    def _ask(self, request: Any) -> Any | None:
        worker = self.idle.get()  # run_parallel runs at most `size` at once: never waits
        try:
            if worker is None or worker.proc.poll() is not None:
                worker = _Worker(self.argv, self.env, self.start_timeout_s)
            with self.lock:
                self.busy.add(worker)
            answer = worker.ask(request, self.timeout_s)
            if answer is None:  # past its deadline (or dead): a new one takes its place
                worker.kill()
                worker = None
            return answer
        finally:
            if worker is not None:
                with self.lock:
                    self.busy.discard(worker)
            self.idle.put(worker)

    def ask_all(self, requests: Sequence[Any]) -> list[Any | None]:
        """Each request's answer, or None for one not answered within `timeout_s`. Raises WorkerError
        when a worker cannot start."""
        return run_parallel(self._ask, requests, self.size, self._kill_busy)

    def _kill_busy(self) -> None:
        with self.lock:
            for worker in list(self.busy):
                worker.kill()

    def close(self) -> None:
        self._kill_busy()
        while True:
            try:
                worker = self.idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()


def serve(handle: Callable[[Any], Any], lines: Iterable[str] = sys.stdin) -> None:
    """A worker's loop: `handle(request)` for each JSON line of stdin, its answer as one JSON line on
    stdout (`{"error": ...}` when `handle` raises). Says READY first; from then on what the worker
    would write on stderr (warnings of the libraries it runs) goes nowhere."""
    out = sys.stdout
    print(READY, file=out, flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    for line in lines:
        try:
            answer = handle(json.loads(line))
        except Exception as e:  # a library's bug on one input: that input's answer, not the worker's end
            answer = {"error": f"{type(e).__name__}: {e}"[:500]}
        out.write(json.dumps(answer) + "\n")
        out.flush()
