"""Graceful stop on a scheduler's signal: finish the step, checkpoint, exit for requeue.

Slurm sends SIGUSR1 (hpcrlhf's sbatch scripts, `--signal=B:USR1@lead`) or SIGUSR2 (submitit's
`--signal=USR2@lead`) before a time limit, and SIGTERM on preemption. The handler
only sets a flag; the trainer checks it between steps (ranks agree through an all-reduce), so a
checkpoint is never written mid-step.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
EXIT_REQUEUE = 3
"""Exit status of a run that stopped on request after checkpointing (so launchers can requeue)."""
EXIT_LOST = 4
"""Exit status of a run that lost a worker or a node (hpcrlhf.errors.WorkerLost): launchers requeue
it too; it resumes from its last checkpoint."""


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

    def install(self) -> "StopFlag":
        if _early:
            self.signal = _early.pop()
            _early.clear()
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signal = signum

    @property
    def requested(self) -> bool:
        return self.signal is not None
