"""Graceful stop on a scheduler's signal or Ctrl-C: finish the step, checkpoint, exit for requeue.

Slurm sends SIGUSR1 (hpcrlhf's sbatch scripts, `--signal=B:USR1@lead`) or SIGUSR2 (submitit's
`--signal=USR2@lead`) before a time limit, and SIGTERM on preemption. The handler
only sets a flag; the trainer checks it between steps (ranks agree through an all-reduce), so a
checkpoint is never written mid-step.

Ctrl-C (SIGINT) at a terminal is the same request, said once on stderr; a second Ctrl-C stops at
once (KeyboardInterrupt: the CLI exits EXIT_INTERRUPTED without a new checkpoint, cleanup such as
stopping a local Ray cluster still runs). A SIGINT that was ignored when the process started (a
background job) stays ignored.
"""

from __future__ import annotations

import os
import signal

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
EXIT_REQUEUE = 3
"""Exit status of a run that stopped on request after checkpointing (so launchers can requeue)."""
EXIT_LOST = 4
"""Exit status of a run that lost a worker or a node (hpcrlhf.errors.WorkerLost): launchers requeue
it too; it resumes from its last checkpoint."""
EXIT_INTERRUPTED = 130
"""Exit status after a second Ctrl-C (or one before training began): 128 + SIGINT, as shells report it."""


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

    def install(self) -> "StopFlag":
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

    def _interrupt(self, signum, frame) -> None:
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
        self.signal = self.signal or signum
        if os.environ.get("RANK", "0") == "0":  # every rank of a terminal's job gets it; one speaks
            try:
                os.write(2, b"\nhpcrlhf: Ctrl-C: stopping after this step with a checkpoint (exit 3; the same "
                            b"command resumes). Ctrl-C again stops at once, without one.\n")
            except OSError:  # no stderr left: the request stands all the same
                pass

    @property
    def requested(self) -> bool:
        return self.signal is not None


def release_interrupt() -> None:
    """Once the command is done: a Ctrl-C during the interpreter's teardown ends the process at once
    (the default action), instead of a KeyboardInterrupt traceback out of some atexit hook. Only a
    StopFlag's handler is replaced."""
    if isinstance(getattr(signal.getsignal(signal.SIGINT), "__self__", None), StopFlag):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
