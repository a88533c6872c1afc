"""Rank-aware console output: one logger that speaks on rank 0, and a progress display.

On a terminal the progress is a tqdm bar; in batch logs (Slurm, CI) it is a one-line status
every few seconds with rate and ETA, so job logs stay readable.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from tqdm import tqdm

_FORMAT = "[%(asctime)s hpcrlhf] %(message)s"


def get_logger(name: str = "hpcrlhf") -> logging.Logger:
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
        rank = int(os.environ.get("RANK", 0))
        logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return logger


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Steps done out of a total, with rate and ETA; silent off rank 0 or when disabled."""

    def __init__(self, total: int, *, initial: int = 0, desc: str = "train", enabled: bool = True,
                 status_every_s: float = 15.0):
        self.total, self.done, self.desc = total, initial, desc
        self.enabled = enabled
        self._start, self._start_step = time.monotonic(), initial
        self._last_status = self._start
        self._every = status_every_s
        self._bar = None
        if enabled and sys.stderr.isatty():
            self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def update(self, n: int = 1, **postfix: float) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last_status >= self._every or self.done == self.total:
            self._last_status = now
            get_logger().info(self.status_line(now, postfix))

    def status_line(self, now: float, postfix: dict[str, float]) -> str:
        rate = (self.done - self._start_step) / max(now - self._start, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        extra = " ".join(f"{k}={v:.4g}" for k, v in postfix.items())
        eta_s = format_duration(eta) if eta != float("inf") else "?"
        return f"{self.desc} {self.done}/{self.total} [{rate:.2f} step/s, ETA {eta_s}] {extra}".rstrip()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
