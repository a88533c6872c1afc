"""hpcrlhf's vLLM plugin (entry point group `vllm.general_plugins`, see setup.cfg), which vLLM
loads in each of its processes: the engine's own, its engine core and every worker.

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

IDLE_SPIN_ENV = "HPCRLHF_VLLM_IDLE_SPIN_S"


def register() -> None:
    """Called by vLLM in each process (possibly more than once): readers made from now on
    busy-wait HPCRLHF_VLLM_IDLE_SPIN_S seconds; nothing when it is not set."""
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
