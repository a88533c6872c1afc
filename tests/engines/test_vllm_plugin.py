"""hpcrlhf's vLLM plugin, loaded the way vLLM loads it in each of its processes (engine core and
workers: `vllm.plugins.load_general_plugins`): asked by HPCRLHF_VLLM_IDLE_SPIN_S, it shortens how long
every shared-memory queue reader busy-waits; not asked, it changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpcrlhf.engines.vllm_plugin import IDLE_SPIN_ENV

PROCESS = """
import tempfile, zmq
from vllm.plugins import load_general_plugins
load_general_plugins()
load_general_plugins()  # vLLM may load plugins more than once
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
ctx, address = zmq.Context(), f"ipc://{tempfile.mkdtemp()}/notify"
writer = SpinCondition(False, ctx, address)
reader = SpinCondition(True, ctx, address)
print(reader.busy_loop_s, writer.busy_loop_s)
"""


@pytest.mark.parametrize("asked, reader", [("0.005", 0.005), (None, 1.0)])
def test_a_process_that_asks_gets_short_reader_spins(asked, reader):
    env = {k: v for k, v in os.environ.items() if k not in (IDLE_SPIN_ENV, "VLLM_PLUGINS")}
    if asked:
        env[IDLE_SPIN_ENV] = asked
    out = subprocess.run([sys.executable, "-c", PROCESS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [float(x) for x in out.stdout.split()[-2:]] == [reader, 0.0]
