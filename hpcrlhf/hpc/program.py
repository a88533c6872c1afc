"""Run a Python program (`python -m MODULE ARGS`) inside this process, once a launcher has set the
stage: the MPI launcher after discovering its rank, the Ray driver of a Slurm job after its
cluster formed. Staying in-process keeps what the launcher set up (MPI, signal handlers, the
environment) and the PID Slurm signals; the program is found by module name at run time, so a
launcher depends on no command's code -- `hpcrlhf` (the CLI) is just the usual program."""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence

CLI = "hpcrlhf"
"""The `hpcrlhf` command as a module (hpcrlhf/__main__.py)."""


def run_module(module: str, args: Sequence[str]) -> int:
    """Run `python -m module args` here, as runpy would; returns its exit status."""
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0
