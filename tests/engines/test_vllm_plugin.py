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


OWNER = """
import os, sys, time
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if (os.cpu_count() or 1) > 1 else "0|0"
from hpcrlhf.engines.rollout.vllm import VLLMRollout
from hpcrlhf.models.tiny import resolve_model_path
engine = VLLMRollout(str(resolve_model_path("builtin:tiny-llama")), tensor_parallel_size=2, kv_cache_bytes=1 << 26,
                     distributed_executor_backend="mp")
print("ready", flush=True)
time.sleep(600)
"""


def _children(pid: int) -> dict[int, int]:
    """Every process under `pid` (its children, theirs, ...): {pid: parent pid}."""
    from pathlib import Path

    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                found[child] = ppid
                frontier.append(child)
    return found


def _alive(pid: int) -> bool:
    from pathlib import Path

    try:  # a zombie has exited: only its parent's wait is missing
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_engines_processes_die_when_its_owner_is_killed(tmp_path):
    """SIGKILL the process that owns a TP-2 engine (as Ray's memory killer or `ray stop --force`
    does to an engine actor): its engine core and both workers go too, instead of keeping their
    memory as orphans."""
    import signal
    import time

    log = (tmp_path / "owner.log").open("w")
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, stderr=log, text=True)
    engine: dict[int, int] = {}
    try:
        assert any(line.strip() == "ready" for line in iter(owner.stdout.readline, "")), \
            (tmp_path / "owner.log").read_text()[-3000:]
        engine = _children(owner.pid)
        assert len(engine) >= 3, engine  # the engine core and its 2 workers (and whatever else vLLM starts)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in engine) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [pid for pid in engine if _alive(pid)], "the engine's processes outlived their owner"
    finally:
        owner.kill()
        for pid in engine:  # left behind when the test fails
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
