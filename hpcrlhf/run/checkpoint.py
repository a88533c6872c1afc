"""Resumable checkpoints in a run folder: atomic, verified, kept by a retention policy.

`checkpoints/step_000120/` holds the engine's shards (model, optimizer, scheduler), the trainer's
client state (step, data position) and every rank's RNG state. A save is atomic: the main rank
makes `step_000120.partial/` afresh, private (0700) while written; every rank writes into it;
after all have finished, the main rank writes
`manifest.json` (every file's size, and its SHA-256 with `checkpoint.verify: sha256`), gives the
folder the umask's modes, renames it to `step_000120/` and then points `checkpoints/latest` at it
(write aside, rename). Nothing is written through a link (hpcrlhf.run.files).
An interrupted save leaves only a `.partial` folder, which is never loaded and is removed by the
next save. On resume the newest checkpoint is verified against its manifest; a missing, truncated
or (sha256) altered file makes it fall back to the previous complete checkpoint, with a warning
naming the file. Damage its sizes cannot show (same-size garbage under `checkpoint.verify: size`)
shows in training: a checkpoint whose first step after loading is NaN/Inf is marked damaged
(`mark_damaged`: a `DAMAGED` file saying why), and is never loaded again. A checkpoint without a manifest is checked by the structure of its files (a
torch.save shard cut short has no closing directory), and a `latest` that names no checkpoint
folder (binary garbage after a crash) is read as missing: the newest folder that verifies is
used. `keep_last` complete checkpoints are kept.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import hashlib
import json

import numpy as np
import torch

from hpcrlhf.formats import file_problem
from hpcrlhf.logs import get_logger
from hpcrlhf.run.files import ensure_folder, fresh_folder, publish, replace_file, replace_folder

log = get_logger()

_STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
PARTIAL = ".partial"
DAMAGED = "DAMAGED"
"""A file in a checkpoint folder that training found damaged (`CheckpointDir.mark_damaged`): why."""


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path, *, sha256: bool) -> dict[str, Any]:
    """Record every file under `folder` (relative path -> size, and SHA-256 when asked)."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        entry: dict[str, Any] = {"bytes": path.stat().st_size}
        if sha256:
            entry["sha256"] = file_digest(path)
        files[str(path.relative_to(folder))] = entry
    manifest = {"version": 1, "files": files}
    replace_file(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def verify_checkpoint(folder: Path) -> list[str]:
    """What is wrong with `folder` against its manifest (empty: it is intact). A folder without a
    manifest (saved before manifests existed, or its manifest lost) is checked by structure alone
    (`structure_problems`). A folder marked damaged by training (`DAMAGED`) is damaged."""
    marked = folder / DAMAGED
    if marked.is_file():
        return [f"marked damaged: {marked.read_text(errors='replace').strip()}"]
    path = folder / MANIFEST
    if not path.exists():
        return structure_problems(folder)
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{MANIFEST} is unreadable ({e})"]
    problems = []
    for name, entry in files.items():
        f = folder / name
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif f.stat().st_size != entry["bytes"]:
            problems.append(f"{name} has {f.stat().st_size} bytes, the manifest says {entry['bytes']}")
        elif "sha256" in entry and file_digest(f) != entry["sha256"]:
            problems.append(f"{name} does not match its SHA-256")
    return problems


def structure_problems(folder: Path) -> list[str]:
    """What a look at the files themselves finds wrong with a checkpoint folder: no files, or a
    torch.save shard (or safetensors file) cut short or empty (`hpcrlhf.formats`)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not files:
        return ["the folder holds no files"]
    return [f"{p.relative_to(folder)} {problem}" for p in files if (problem := file_problem(p))]


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

    def __init__(self, root: Path, keep_last: int = 2, sha256: bool = False):
        self.root = root
        self.keep_last = keep_last
        self.sha256 = sha256

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def staging_for(self, step: int) -> Path:
        """Where the ranks write step `step`'s checkpoint before it is committed."""
        return self.root / f"step_{step:06d}{PARTIAL}"

    def latest(self) -> Path | None:
        """The checkpoint `latest` names (not verified: see `latest_intact`); None when it names none."""
        return self._read_latest()[0]

    def _read_latest(self) -> tuple[Path | None, str | None]:
        """(the checkpoint folder `latest` names, else None; what is wrong with `latest`, else None).
        The marker is one line, `step_000120`, written by `mark_latest`: anything else (binary
        garbage from a crash, a path elsewhere) names no checkpoint."""
        marker = self.root / "latest"
        if not marker.exists():
            return None, "is missing"
        try:
            name = marker.read_bytes().decode("ascii").strip()
        except (OSError, UnicodeDecodeError) as e:
            return None, f"is unreadable ({e.strerror if isinstance(e, OSError) else 'not text'})"
        if not _STEP_DIR.match(name):
            shown = name if len(name) <= 40 else name[:37] + "..."
            return None, f"holds {shown!r}, not the name of a checkpoint folder (step_NNNNNN)"
        path = self.root / name
        return (path, None) if path.is_dir() else (None, f"names {name}, which is missing")

    def complete(self) -> list[Path]:
        """Committed checkpoint folders, oldest first (a link named like one is not one: never loaded,
        never removed by retention)."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir() and not p.is_symlink())

    def latest_intact(self) -> Path | None:
        """The newest checkpoint that verifies against its manifest, starting from the one
        `latest` names; each one skipped is reported with a warning naming what is wrong."""
        marked, problem = self._read_latest()
        candidates = [p for p in reversed(self.complete()) if marked is None or p.name <= marked.name]
        if marked is None and candidates:
            log.warning(f"{self.root}/latest {problem}; looking at the checkpoint folders themselves")
        for folder in candidates:
            problems = verify_checkpoint(folder)
            if not problems:
                if folder != marked:
                    log.warning(f"resuming from the previous intact checkpoint {folder}")
                return folder
            log.warning(f"checkpoint {folder} is damaged ({'; '.join(problems[:3])}"
                        f"{'; ...' if len(problems) > 3 else ''}): not loading it")
        return None

    def begin(self, step: int) -> Path:
        """Main rank, before the ranks write step `step`'s checkpoint: `checkpoints/` a real folder, and
        the step's staging folder fresh and private (0700) until committed: nothing planted in it, and
        what an interrupted save left there removed (hpcrlhf.run.files)."""
        ensure_folder(self.root)
        return fresh_folder(self.staging_for(step))

    def commit(self, staging: Path, step: int) -> Path:
        """Main rank, after every rank has written `staging`: manifest, the permission policy's modes,
        rename (over the same step saved before, e.g. at the end of a resumed run), `latest`, retention."""
        write_manifest(staging, sha256=self.sha256)
        publish(staging)
        final = self.path_for(step)
        replace_folder(staging, final)
        self.mark_latest(final)
        return final

    def mark_damaged(self, folder: Path, why: str) -> None:
        """Training found `folder` damaged in a way its manifest cannot show (`why`): it is never loaded
        again (`verify_checkpoint`), and goes when a save of its step replaces it or retention drops it."""
        (folder / DAMAGED).write_text(why + "\n")

    def save_rng(self, folder: Path, rank: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), folder / f"rng_rank{rank}.pt")

    def load_rng(self, folder: Path, rank: int) -> None:
        path = folder / f"rng_rank{rank}.pt"
        if path.exists():
            set_rng_state(torch.load(path, weights_only=False))

    def mark_latest(self, folder: Path) -> None:
        """Point `latest` at `folder` atomically, then drop checkpoints beyond `keep_last`."""
        replace_file(self.root / "latest", folder.name + "\n")
        steps = self.complete()
        for old in steps[: max(0, len(steps) - self.keep_last)]:
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        for partial in self.root.glob(f"step_*{PARTIAL}"):  # interrupted saves
            if not partial.is_symlink():
                shutil.rmtree(partial, ignore_errors=True)
