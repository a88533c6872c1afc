"""DeepSpeed's JIT-built ops (CPU Adam for optimizer offload) load safely on a shared machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from hpcrlhf.cache import cache_dir

LOAD = ("from deepspeed.ops.op_builder import CPUAdamBuilder; "
        "from hpcrlhf.engines.deepspeed_engine import load_jit_op; "
        "op = load_jit_op(CPUAdamBuilder()); print('loaded', op.__name__)")
HOLD = ("import fcntl, sys, time; from pathlib import Path; d = Path(sys.argv[1]); "
        "guard = open(d / '.hpcrlhf-build.flock', 'w'); fcntl.flock(guard, fcntl.LOCK_EX); "
        "(d / 'cpu_adam').mkdir(exist_ok=True); (d / 'cpu_adam' / 'lock').touch(); print('building', flush=True); "
        "time.sleep(600)")


def test_a_build_killed_midway_neither_hangs_nor_races_the_next_load():
    """A process 'building' the op (holding hpcrlhf's build lock and torch's lock file) makes a
    second loader wait without touching the lock file; once the builder is SIGKILLed, leaving the
    lock file behind (what made a CI run hang for 600 s inside torch's FileBaton.wait), the second
    loader removes it, says so, and loads the op."""
    extensions = cache_dir("torch_extensions")
    lock = extensions / "cpu_adam" / "lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(extensions)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "building"
        loader = subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd(),
                                                                 "TORCH_EXTENSIONS_DIR": str(extensions)})
        time.sleep(15)  # long enough to import deepspeed and reach the build lock
        assert loader.poll() is None, f"a live build must be waited for: {loader.communicate()}"
        assert lock.exists(), "a live build's lock file must not be removed"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    out, err = loader.communicate(timeout=600)
    assert loader.returncode == 0, err[-3000:]
    assert "loaded cpu_adam" in out
    assert f"removing {lock}, left by a process killed while building cpu_adam" in err
    assert not lock.exists()
