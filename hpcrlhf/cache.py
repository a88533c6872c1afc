"""Where hpcrlhf keeps things it builds once and reuses (tokenizer, tiny models).

The root is ``$HPCRLHF_CACHE`` when set, otherwise ``~/.cache/hpcrlhf``. Entries are built in a
temporary sibling folder and renamed into place only when complete (`atomic_dir`), so a crash
or a concurrent builder never leaves a half-written entry that a later run would trust.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temporary folder next to `final`; rename it to `final` on success.

    The temporary folder lives in the same parent so the rename is atomic (same filesystem).
    On an exception it is removed and `final` is untouched. If `final` appeared meanwhile
    (another process won the race) their copy is kept and ours is discarded: both were
    built from the same inputs, so either is fine.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, final)
    except OSError:
        # `final` exists already (rename onto a non-empty folder fails): keep theirs.
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():
            raise
