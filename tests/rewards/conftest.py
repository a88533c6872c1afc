"""Fixtures of the reward tests."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.launch_helpers import ROOT
from tests.rewards.programs import TOKEN


@pytest.fixture
def open_folder():
    """A folder outside /tmp that anyone may write: a program must not, all the same."""
    folder = ROOT / f".{TOKEN}"
    folder.mkdir()
    os.chmod(folder, 0o777)
    yield folder
    shutil.rmtree(folder)
