"""A watchdog for the waits of a job: a hang ends as a clear, requeueable error, never a silent one.

Every phase a process waits in (`Watchdog.phase(kind)`: a step, a generation, a weight sync, a
checkpoint, ...) gets a deadline from how long that kind took before in this attempt: `factor` x the
median of its last `history` durations + `floor_s`, or `first_s` while it has none
(`WatchdogConfig.deadline`).
Kinds measured per step (`per_step`: a step may generate several times) are timed by their total in
the current step, closed by `step_done`. One daemon thread sleeps until the earliest deadline. When
one passes it writes the stacks of every thread of this process (`hpcrlhf.run.stacks`), logs which
wait hung, for how long and whom it still waited for (`waiting_for`), and interrupts the main thread
with `WATCHDOG_SIGNAL`, whose handler raises `WaitExpired` there (a BaseException, as a stop request's
`StopRequested` is): the job can then checkpoint what is safe to keep and exit with the status the
Slurm script requeues. Polling loops call `check()` between polls to unwind at once. If the main
thread does not take the interruption within `answer_s` (stuck in a collective or other C code that
no signal reaches: it could neither checkpoint nor clean up), or the process is still alive `grace_s`
after the expiry (its checkpoint or clean-up hung), the thread ends it with `EXIT_LOST` (4).

The TRL lesson (PR #6913: an NCCL broadcast cannot be interrupted): the waiter holds the clock, not
the collective; the 30-minute collective timeouts stay as backstops beneath.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from hpcrlhf.config.schema import WatchdogConfig
from hpcrlhf.logs import get_logger
from hpcrlhf.run.heartbeats import Heartbeats
from hpcrlhf.run.signals import RUNNING_WATCHDOGS
from hpcrlhf.run.stacks import dump_stacks

WATCHDOG_SIGNAL = signal.SIGRTMIN + 6
"""Sent by the watchdog thread to the main thread when a wait expired (a real-time signal: no clash
with Slurm's USR1/USR2/TERM, the SIGALRM of `hpcrlhf.run.usercode`, Ctrl-C, Ray or vLLM)."""
ANSWER_S = 10.0
"""How long the main thread has to take the watchdog's interruption (`Watchdog.answer_s`)."""
EXIT_HUNG = 4
"""The status a process the watchdog ends itself exits with: `hpcrlhf.run.signals.EXIT_LOST`, requeued."""

log = get_logger()


@dataclass(frozen=True)
class Expiry:
    """A wait that passed its deadline."""

    kind: str
    step: int | None
    waited_s: float
    deadline_s: float
    formula: str
    parties: tuple[str, ...] = ()
    """Whom it was still waiting for (named by the code that waits: a rank, an engine, a URL)."""
    stacks: str | None = None
    """The file holding the stacks of this process's threads at the expiry."""

    def message(self) -> str:
        when = f"step {self.step} hung" if self.step is not None else "hung"
        waiting = f"; still waiting for {', '.join(self.parties)}" if self.parties else ""
        stacks = f"; stacks: {self.stacks}" if self.stacks else ""
        return (f"{when}: {self.kind} did not finish within {_seconds(self.deadline_s)} s (watchdog: {self.formula})"
                f"{waiting}{stacks}")


def _seconds(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


class WaitExpired(BaseException):
    """Raised in the thread whose wait passed its deadline (a BaseException: no `except Exception` of
    library code swallows it)."""

    def __init__(self, expiry: Expiry):
        super().__init__(expiry.message())
        self.expiry = expiry


@dataclass(eq=False)
class _Phase:
    kind: str
    per_step: bool
    start: float
    before_s: float
    """Time this kind already took in the current step (per-step kinds)."""
    thread: int
    parties: tuple[str, ...] = ()
    expired: Expiry | None = None


@dataclass
class Watchdog:
    """The watchdog of this process (see the module docstring); `start()` in the main thread, `stop()` at
    the end. `folder`: where stacks files go (None: the stacks are logged, not written)."""

    deadlines: WatchdogConfig = field(default_factory=WatchdogConfig)
    folder: Path | None = None
    clock: Callable[[], float] = time.monotonic
    exit: Callable[[int], None] = os._exit
    answer_s: float = ANSWER_S
    """How long the main thread has to take the interruption (its handler to run) before the process ends."""
    heartbeats: Heartbeats | None = None
    """This rank's heartbeats among its job's ranks (several ranks): an expiry with no one named names the
    peers gone silent."""

    def __post_init__(self) -> None:
        self.history: dict[str, list[float]] = defaultdict(list)
        self.spent: dict[str, float] = defaultdict(float)
        self.step: int | None = None
        self._phases: list[_Phase] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self._handler = None
        self._expired_at: float | None = None
        self._last: Expiry | None = None
        self._unanswered = False
        """The main thread was interrupted and its handler has not run yet."""

    # -- lifetime -------------------------------------------------------------------------------
    @classmethod
    def of_rank(cls, deadlines: WatchdogConfig, folder: Path, rank: int, world_size: int) -> Watchdog | None:
        """The started watchdog of rank `rank` of a job of `world_size` writing into `folder` (with heartbeats
        when there are several ranks), or None when `deadlines.enabled` is off."""
        if not deadlines.enabled:
            return None
        beats = Heartbeats(folder, rank, world_size) if world_size > 1 else None
        return cls(deadlines, folder, heartbeats=beats).start()

    def start(self) -> Watchdog:
        if threading.current_thread() is threading.main_thread():
            self._handler = signal.signal(WATCHDOG_SIGNAL, self._interrupt)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {WATCHDOG_SIGNAL})
        self._running = True
        self._thread = threading.Thread(target=self._watch, name="hpcrlhf-watchdog", daemon=True)
        self._thread.start()
        if self.heartbeats is not None:
            self.heartbeats.start(self._state)
        RUNNING_WATCHDOGS.append(self)
        return self

    def stop(self, *, until_exit: bool = False) -> None:
        """The job's waits are over. `until_exit`: after an expiry the grace exit stays armed until the
        process ends -- the teardown of a hung job (killing its workers, closing engines, leaving a process
        group) can hang on the same stuck party, and nothing else would end it."""
        if self in RUNNING_WATCHDOGS:
            RUNNING_WATCHDOGS.remove(self)
        if self.heartbeats is not None:
            self.heartbeats.stop()
        if until_exit and self.expired:
            return
        with self._cond:
            self._running = False
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._handler is not None:
            signal.signal(WATCHDOG_SIGNAL, self._handler)
            self._handler = None

    # -- what the job's code calls --------------------------------------------------------------
    @contextmanager
    def phase(self, kind: str, per_step: bool = True) -> Iterator[None]:
        """A wait of `kind` (timed against its deadline while the block runs)."""
        with self._cond:
            p = _Phase(kind, per_step, self.clock(), self.spent[kind] if per_step else 0.0, threading.get_ident())
            self._phases.append(p)
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._phases.remove(p)
                took = self.clock() - p.start
                if per_step:
                    self.spent[kind] += took
                elif p.expired is None:
                    self.history[kind].append(took)
                self._cond.notify_all()

    def step_done(self, step: int) -> None:
        """Step `step` is over: its per-step totals join their kinds' histories; the next step begins."""
        with self._cond:
            for kind, took in self.spent.items():
                self.history[kind].append(took)
            self.spent.clear()
            self.step = step + 1
            self._cond.notify_all()

    def waiting_for(self, *parties: str) -> None:
        """Name whom the innermost wait of this thread is blocked on (replacing earlier names)."""
        p = self._innermost(threading.get_ident())
        if p is not None:
            p.parties = tuple(parties)

    def check(self) -> None:
        """Raise WaitExpired if a wait of this thread passed its deadline (for polling loops)."""
        p = self._innermost(threading.get_ident(), expired=True)
        if p is not None:
            raise WaitExpired(p.expired)

    @property
    def expired(self) -> bool:
        """Whether a wait of this process has expired (the grace period runs)."""
        return self._expired_at is not None

    # -- the watching thread ----------------------------------------------------------------------
    def _state(self) -> dict:
        """What this rank's heartbeat says: its step and the phases it is in."""
        with self._cond:
            return {"step": self.step, "phases": [p.kind for p in self._phases]}

    def _innermost(self, thread: int, expired: bool = False) -> _Phase | None:
        with self._cond:
            mine = [p for p in self._phases if p.thread == thread and (not expired or p.expired is not None)]
        return mine[-1] if mine else None

    def _due(self, p: _Phase) -> tuple[float, float, str]:
        """(when `p` expires, its deadline, the formula)."""
        seconds, formula = self.deadlines.deadline(self.history[p.kind])
        return p.start - p.before_s + seconds, seconds, formula

    def _watch(self) -> None:
        with self._cond:
            while self._running:
                now = self.clock()
                if self._expired_at is not None and now >= self._expired_at + self.deadlines.grace_s:
                    self._hard_exit(f"the process did not end within watchdog.grace_s {self.deadlines.grace_s:g} s "
                                    "of it")
                    return
                if self._unanswered and now >= self._expired_at + self.answer_s:
                    self._hard_exit(f"the main thread did not take the interruption within {self.answer_s:g} s (stuck "
                                    "in a collective or other code no signal reaches: it can neither checkpoint nor "
                                    "clean up)")
                    return
                # after an expiry the process is ending: what it still does (a checkpoint of the steps done,
                # the teardown) has until the grace exit, and is not interrupted again
                live = [(self._due(p), p) for p in self._phases if p.expired is None and self._expired_at is None]
                wake = [due for (due, _, _), _ in live]
                if self._expired_at is not None:
                    wake.append(self._expired_at + self.deadlines.grace_s)
                    if self._unanswered:
                        wake.append(self._expired_at + self.answer_s)
                if not wake:
                    self._cond.wait()
                    continue
                if min(wake) > now:
                    self._cond.wait(min(wake) - now)
                    continue
                for (due, seconds, formula), p in live:
                    if due <= now:
                        self._expire(p, now, seconds, formula)

    def _expire(self, p: _Phase, now: float, seconds: float, formula: str) -> None:
        """(holding the lock) Mark `p` expired, write the stacks, say so, interrupt its thread."""
        stacks = None
        if not p.parties and self.heartbeats is not None:  # a collective: the peers gone silent, if any
            p.parties = tuple(self.heartbeats.silent())
        if self.folder is not None:
            who = "-".join(part.split(":")[0].replace(" ", "_") for part in p.parties[:1]) or p.kind
            path = self.folder / f"hang-{time.strftime('%Y%m%d-%H%M%S')}-{who}.txt"
            stacks = str(dump_stacks(path))
        expiry = Expiry(p.kind, self.step, now - p.start + p.before_s, seconds, formula, p.parties, stacks)
        p.expired = expiry
        self._expired_at = now if self._expired_at is None else self._expired_at
        self._last = expiry
        log.error(expiry.message())
        if p.thread == threading.main_thread().ident and self._handler is not None:
            self._unanswered = True
            signal.pthread_kill(p.thread, WATCHDOG_SIGNAL)

    def _interrupt(self, signum, frame) -> None:
        """The main thread's handler of WATCHDOG_SIGNAL: raise where the expired wait still runs -- except
        inside Ray's own code (a `ray.get`/`ray.wait` runs handlers in its signal check and turns what they
        raise into a SystemError): there the wait's poll raises at its next `check()`, and a wait that
        does not poll ends with the process, `grace_s` later."""
        self._unanswered = False  # first: the thread is reachable (the watchdog need not end the process early)
        p = self._innermost(threading.main_thread().ident, expired=True)
        if p is not None and not _in_ray(frame):
            raise WaitExpired(p.expired)

    def _hard_exit(self, why: str) -> None:
        try:
            print(f"hpcrlhf: error: {self._last.message()}; {why}: ended with status {EXIT_HUNG} (requeued)", file=sys.stderr,
                  flush=True)
        finally:
            self.exit(EXIT_HUNG)


_RAY_PACKAGE = f"{os.sep}ray{os.sep}"


def watched(dog: Watchdog | None, name: str, per_step: bool = True):
    """A wait that `dog` times (`per_step`: by its total in the step; else each one alone); no watchdog: untimed."""
    return dog.phase(name, per_step) if dog is not None else nullcontext()


def _in_ray(frame, depth: int = 3) -> bool:
    """Whether the interrupted code is Ray's own (its `get`/`wait`, seen in the innermost `depth` frames)."""
    while frame is not None and depth > 0:
        if _RAY_PACKAGE in frame.f_code.co_filename:
            return True
        frame, depth = frame.f_back, depth - 1
    return False
