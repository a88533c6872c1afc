"""Graceful stop on a scheduler's signal: finish the step, checkpoint, exit for requeue.

Slurm sends SIGUSR1 (via `--signal`) before a time limit and SIGTERM on preemption. The handler
only sets a flag; the trainer checks it between steps (ranks agree through an all-reduce), so a
checkpoint is never written mid-step.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
EXIT_REQUEUE = 3
"""Exit status of a run that stopped on request after checkpointing (so launchers can requeue)."""


class StopFlag:
    def __init__(self) -> None:
        self.signal: int | None = None

    def install(self) -> "StopFlag":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signal = signum

    @property
    def requested(self) -> bool:
        return self.signal is not None
