"""What the sandbox tests share: the interpreter programs run with, and hostile programs whose
processes and files can be looked for afterwards."""

from __future__ import annotations

import os
import sys
import uuid

PYTHON = "/usr/bin/python3" if os.geteuid() == 0 else sys.executable
"""Run as root, programs run as the user nobody, who cannot run a Python under /root."""
TOKEN = f"hpcrlhf-sandbox-test-{uuid.uuid4().hex[:12]}"
"""In the command line of every process a hostile program leaves running, and the name of every
file it writes: what the checks look for afterwards."""


def tagged(code: str) -> str:
    """A program that becomes `python -c code TOKEN`: every process it forks carries TOKEN."""
    return f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {code!r}, {TOKEN!r}])\n"


def processes_with_token() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if TOKEN.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found
