"""Resumable checkpoints in a run folder.

`checkpoints/step_000120/` holds the engine's shards (model, optimizer, scheduler), the trainer's
client state (step, data position) and every rank's RNG state; `checkpoints/latest` names the
newest complete one and is written last, so an interrupted save is never picked up.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointDir:
    """The `checkpoints/` folder of a run."""

    def __init__(self, root: Path, keep_last: int = 2):
        self.root = root
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def latest(self) -> Path | None:
        marker = self.root / "latest"
        if not marker.exists():
            return None
        path = self.root / marker.read_text().strip()
        return path if path.is_dir() else None

    def save_rng(self, folder: Path, rank: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), folder / f"rng_rank{rank}.pt")

    def load_rng(self, folder: Path, rank: int) -> None:
        path = folder / f"rng_rank{rank}.pt"
        if path.exists():
            set_rng_state(torch.load(path, weights_only=False))

    def mark_latest(self, folder: Path) -> None:
        """Point `latest` at `folder` atomically, then drop checkpoints beyond `keep_last`."""
        tmp = self.root / "latest.tmp"
        tmp.write_text(folder.name + "\n")
        os.replace(tmp, self.root / "latest")
        steps = sorted(p for p in self.root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))
        for old in steps[: max(0, len(steps) - self.keep_last)]:
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
