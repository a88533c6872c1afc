"""hpcrlhf's vLLM plugin (entry point group `vllm.general_plugins`, see setup.cfg), which vLLM
loads in each of its processes: the engine's own, its engine core and every worker. It does three
things.

**The engine's processes die with their parent.** vLLM's engine core is a process of its own; its
workers leave when it dies (a pipe tells them), but the core itself outlives the process that
started it when that process is killed (SIGKILL: Ray's out-of-memory killer taking an engine
actor, `ray stop --force`, a job step's kill): each orphaned TP-2 engine kept ~4 GiB of a CPU
host (its weights, KV cache, three Python processes) until the next job ran out of memory.
In the engine core and each worker, the plugin asks Linux for SIGKILL when the parent dies
(`prctl(PR_SET_PDEATHSIG)`), or exits at once when it died already.

**The engine's processes leave the job's stop signals to their owner.** Ctrl-C at a terminal and
`kill -TERM -PGID` (a launcher, Slurm's preemption of a step) signal the whole process group, and
Slurm's time-limit signals (SIGUSR1/SIGUSR2 without `B:`) every process of the step: the trainer
then finishes its step, checkpoints and exits 3 -- but vLLM's engine core shuts down on SIGTERM
and SIGINT, and SIGUSR1/2 end any process that does not handle them, so the trainer's next
request failed with EngineDeadError (exit 1, no checkpoint). The engine core and its workers
therefore start a session of their own (`setsid`: no signal to the trainer's process group or
terminal reaches them) and ignore SIGUSR1/SIGUSR2; their owner closes them (`VLLMRollout.close`,
signalling them one by one), and they die with it (above). A SIGTERM sent to each process of a
step one by one (Slurm's preemption under proctrack/cgroup) still reaches them, as it reaches
Ray's processes.

**Short idle spins on CPU hosts.**

vLLM's shared-memory queue readers busy-wait 1 s after each read (yielding only with
`sched_yield`) before they sleep on a socket: the workers waiting for the next request, and the
engine core waiting for its workers' answers -- during a weight sync too, for as long as the
broadcast takes when the last read was under a second before. On a GPU node that is a core per
process nobody misses; on a CPU host it is the cores the broadcast itself, the trainer and Ray
need (two TP-2 engines on 2 cores: a sync took 0.25 s instead of 0.03 s with one engine).
`VLLMRollout` sets HPCRLHF_VLLM_IDLE_SPIN_S on CPU hosts before an engine starts; with it set,
every reader in the engine's processes busy-waits that long instead. A request arriving later
still wakes a sleeping reader at once, through its socket.
"""

from __future__ import annotations

import os
import signal
import sys

IDLE_SPIN_ENV = "HPCRLHF_VLLM_IDLE_SPIN_S"
CHILD_PROCESSES = ("EngineCore", "VllmWorker")
"""Names vLLM gives (`multiprocessing` process names) to the processes it starts: its engine core
(`EngineCore`, `EngineCore_DP<i>`) and the workers of a multiprocessing executor (`VllmWorker-<rank>`)."""
PR_SET_PDEATHSIG = 1  # linux/prctl.h


IGNORED = (signal.SIGUSR1, signal.SIGUSR2)
"""Slurm's time-limit signals, for the trainer only (vLLM handles neither: they would end the process)."""


def register() -> None:
    """Called by vLLM in each process (possibly more than once)."""
    if started_by_vllm():
        die_with_parent()
        leave_the_callers_signals()
    shorten_idle_spins()


def started_by_vllm() -> bool:
    """Whether this is a process vLLM started (its engine core, a worker), not the trainer or an engine actor."""
    import multiprocessing

    return (multiprocessing.parent_process() is not None
            and multiprocessing.current_process().name.startswith(CHILD_PROCESSES))


def leave_the_callers_signals() -> None:
    """A session of this process's own (the workers the engine core starts next inherit it), and
    SIGUSR1/SIGUSR2 ignored (inherited too)."""
    try:
        os.setsid()
    except OSError:  # a session or group leader already (called before)
        pass
    import threading

    if threading.current_thread() is threading.main_thread():  # Python sets handlers there only
        for sig in IGNORED:
            signal.signal(sig, signal.SIG_IGN)


def die_with_parent() -> bool:
    """In a process vLLM started: SIGKILL when the parent dies (Linux), and exit now if it is gone
    already. Returns whether it was set."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent.pid:  # the parent died before the request: nobody would kill this process
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def shorten_idle_spins() -> None:
    """Queue readers made from now on busy-wait HPCRLHF_VLLM_IDLE_SPIN_S seconds; nothing when it
    is not set."""
    seconds = os.environ.get(IDLE_SPIN_ENV)
    if seconds is None:
        return
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    if getattr(SpinCondition, "hpcrlhf_idle_spin_s", None) is not None:
        return
    init = SpinCondition.__init__

    def shorter_spin(self, is_reader, context, notify_address, busy_loop_s: float = 1, *args, **kwargs):
        init(self, is_reader, context, notify_address, float(seconds) if is_reader else busy_loop_s, *args, **kwargs)

    SpinCondition.__init__ = shorter_spin
    SpinCondition.hpcrlhf_idle_spin_s = float(seconds)
