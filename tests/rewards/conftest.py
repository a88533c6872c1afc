"""Fixtures of the reward tests."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from tests.launch_helpers import ROOT
from tests.rewards.programs import TOKEN


PRIVATE_IN_THE_SANDBOX = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))
"""Folders a sandboxed program gets empty ones of its own in place of."""


def outside_the_private_folders() -> Path:
    """A folder of this host that a sandboxed program sees (read-only) and may reach: the checkout,
    or where that lies in /tmp (a CI clone) or cannot be passed through, the home folder or /var/lib."""
    for base in (ROOT, Path.home(), Path("/var/lib")):
        real = base.resolve()
        if not any(real.is_relative_to(private) for private in PRIVATE_IN_THE_SANDBOX) and os.access(real, os.W_OK) \
                and _passable(real):
            return base
    pytest.skip(f"no folder outside {', '.join(map(str, PRIVATE_IN_THE_SANDBOX))} that this user may write and a "
                "sandboxed program may reach (tried the checkout, the home folder and /var/lib)")


def _passable(folder: Path) -> bool:
    """As root, a sandboxed program runs as nobody: every folder on the way must let others through."""
    return os.geteuid() != 0 or all(p.stat().st_mode & stat.S_IXOTH for p in (folder, *folder.parents))


@pytest.fixture
def open_folder():
    """A folder outside /tmp that anyone may write: a program must not, all the same."""
    folder = outside_the_private_folders() / f".{TOKEN}"
    folder.mkdir()
    os.chmod(folder, 0o777)
    yield folder
    shutil.rmtree(folder)
