"""Where hpcrlhf keeps things it builds once and reuses (tokenizer, tiny models).

The root is ``$HPCRLHF_CACHE`` when set, otherwise ``~/.cache/hpcrlhf``. Entries are built in a
temporary sibling folder and renamed into place only when complete (`atomic_dir`), so a crash
or a concurrent builder never leaves a half-written entry that a later run would trust.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path

from hpcrlhf.run.files import staged_folder

ENV_VAR = "HPCRLHF_CACHE"


def cache_root() -> Path:
    """The cache root (not created)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "hpcrlhf"


def cache_dir(*parts: str) -> Path:
    """``cache_root()/part1/part2/...``, created if missing."""
    path = cache_root().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_dir(final: Path) -> AbstractContextManager[Path]:
    """Yield an empty temporary folder next to `final`; rename it to `final` on success.

    The temporary folder lives in the same parent so the rename is atomic (same filesystem).
    On an exception it is removed and `final` is untouched. If `final` appeared meanwhile
    (another process won the race) their copy is kept and ours is discarded: both were
    built from the same inputs, so either is fine (hpcrlhf.run.files.staged_folder).
    """
    return staged_folder(final, keep_existing=True)
