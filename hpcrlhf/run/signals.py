"""Graceful stop on a scheduler's signal or Ctrl-C: finish the step, checkpoint, exit for requeue.

Slurm sends SIGUSR1 (hpcrlhf's sbatch scripts, `--signal=B:USR1@lead`) or SIGUSR2 (submitit's
`--signal=USR2@lead`) before a time limit, and SIGTERM on preemption. The handler
only sets a flag; the trainer checks it between steps (ranks agree through an all-reduce), so a
checkpoint is never written mid-step.

Ctrl-C (SIGINT) at a terminal is the same request, said once on stderr; a second Ctrl-C stops at
once (KeyboardInterrupt: the CLI exits EXIT_INTERRUPTED without a new checkpoint, cleanup such as
stopping a local Ray cluster still runs). A SIGINT that was ignored when the process started (a
background job) stays ignored.

Two kinds of work do not wait for the next step: a generation ends at its next decode step
(`stop_requested_here`), and the user's own code (a reward rule, a metric), which may never return,
is interrupted: while it runs (`interruptible`), the request raises StopRequested in it. Either way
the step is dropped on every rank (`hpcrlhf.run.folder.Run.stoppable`) and the steps before it
are checkpointed.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from collections.abc import Callable, Iterator, Sequence

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
EXIT_REQUEUE = 3
"""Exit status of a run that stopped on request after checkpointing (so launchers can requeue)."""
EXIT_LOST = 4
"""Exit status of a run that lost a worker or a node (hpcrlhf.errors.WorkerLost): launchers requeue
it too; it resumes from its last checkpoint."""
EXIT_INTERRUPTED = 130
"""Exit status after a second Ctrl-C (or one before training began): 128 + SIGINT, as shells report it."""


class StopRequested(BaseException):
    """A stop request that came while the user's code ran (`interruptible`), raised in that code. A
    BaseException, so that a rule's own `except Exception` does not swallow it."""


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C the user pressed (the second one with a StopFlag; see `hpcrlhf.run.usercode` for the
    first one elsewhere): unlike a KeyboardInterrupt some code raised itself, it ends the command."""


_early: list[int] = []
"""Stop signals received before any StopFlag was installed (see `catch_early_stop_signals`)."""


def catch_early_stop_signals() -> None:
    """Remember stop signals until the trainer installs its StopFlag (launchers call this first:
    a time-limit signal during start-up would otherwise kill the process instead of stopping it)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: _early.append(signum))


class StopFlag:
    def __init__(self) -> None:
        self.signal: int | None = None
        self.interrupted = False
        """Ctrl-C was pressed once: the next one stops at once."""

    def install(self) -> StopFlag:
        if _early:
            self.signal = _early.pop()
            _early.clear()
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, self._interrupt)
        # A parent (launcher, library thread set-up) may have left these blocked in this thread, and
        # the block is inherited: the handlers above would then never run (or run late, elsewhere).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, *STOP_SIGNALS})
        return self

    def _handle(self, signum, frame) -> None:
        self.signal = signum
        _interrupt_user_code()

    def _interrupt(self, signum, frame) -> None:
        if self.interrupted:
            raise Interrupted
        self.interrupted = True
        self.signal = self.signal or signum
        if os.environ.get("RANK", "0") == "0":  # every rank of a terminal's job gets it; one speaks
            try:
                os.write(2, b"\nhpcrlhf: Ctrl-C: stopping after this step with a checkpoint (exit 3; the same "
                            b"command resumes). Ctrl-C again stops at once, without one.\n")
            except OSError:  # no stderr left: the request stands all the same
                pass
        _interrupt_user_code()

    @property
    def requested(self) -> bool:
        return self.signal is not None


_in_user_code = 0
"""How many `interruptible` blocks this process is in (the main thread runs the handlers)."""


@contextmanager
def interruptible() -> Iterator[None]:
    """A block of the user's code: a stop request raises StopRequested in it, at once if one came
    before (the flag's handlers set the flag as always)."""
    global _in_user_code
    if stop_requested_here():
        raise StopRequested
    _in_user_code += 1
    try:
        yield
    finally:
        _in_user_code -= 1


def _interrupt_user_code() -> None:
    if _in_user_code:
        raise StopRequested


RUNNING_WATCHDOGS: list = []
"""This process's running watchdog (`hpcrlhf.run.watchdog.Watchdog.start`/`stop`; at most one)."""


def active_watchdog():
    """This process's running watchdog, else None: waits far from the run (Ray gathers, reward servers) name
    whom they wait for (`waiting_for`) and poll their deadline (`check`)."""
    return RUNNING_WATCHDOGS[-1] if RUNNING_WATCHDOGS else None


WATCH_POLL_S = 1.0
"""How often a `watched_wait` looks at its watchdog's deadline while it waits."""


def watched_wait(poll: Callable[[float], bool], parties: Callable[[], Sequence[str]], *,
                 timeout: float | None = None, poll_s: float = WATCH_POLL_S) -> bool:
    """Wait until `poll(s)` -- a wait of at most s seconds that says whether what it waits for came -- says so
    (True), or `timeout` seconds passed (False; None: no bound). A wait a signal cannot interrupt (a thread's
    event, a Ray wait) stays in reach of this process's watchdog: it names `parties()` to it and checks its
    deadline between polls (its WaitExpired leaves the wait)."""
    dog = active_watchdog()
    if dog is not None:
        dog.waiting_for(*parties())
    ends = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if ends is None else max(0.0, ends - time.monotonic())
        if poll(poll_s if left is None else min(poll_s, left)):
            return True
        if ends is not None and time.monotonic() >= ends:
            return False
        if dog is not None:
            dog.check()


def watched_until(done: Callable[[], bool], parties: Callable[[], Sequence[str]], *, timeout: float | None = None,
                  poll_s: float = WATCH_POLL_S, every_s: float = 0.01) -> bool:
    """`watched_wait` for something that only says whether it is done (`done()`: a collective begun with
    `async_op`, a future), asked every `every_s` seconds."""
    def poll(seconds: float) -> bool:
        ends = time.monotonic() + seconds
        while not done():
            if time.monotonic() >= ends:
                return False
            time.sleep(min(every_s, max(0.0, ends - time.monotonic())))
        return True

    return watched_wait(poll, parties, timeout=timeout, poll_s=poll_s)


def installed_flag() -> StopFlag | None:
    """The StopFlag whose handlers this process runs (a run's, `hpcrlhf.run.folder.Run`), else None."""
    flag = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    return flag if isinstance(flag, StopFlag) else None


def stop_requested_here() -> bool:
    """Whether this process was asked to stop: what long work asks between its pieces (a generation
    between decode steps, `hpcrlhf.engines.hf_generate.StopOnRequest`) to end early. Its result is
    then incomplete; the trainer throws it away with the step (`Run.stoppable`)."""
    flag = installed_flag()
    return flag is not None and flag.requested


def release_interrupt() -> None:
    """Once the command is done: a Ctrl-C during the interpreter's teardown ends the process at once
    (the default action), instead of a KeyboardInterrupt traceback out of some atexit hook. Only a
    StopFlag's handler is replaced."""
    if isinstance(getattr(signal.getsignal(signal.SIGINT), "__self__", None), StopFlag):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
