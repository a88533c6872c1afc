"""Process-group setup and the few collectives trainers need.

Rank, world size and rendezvous come from the launcher's environment (torchrun / the deepspeed
launcher set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; hpcrlhf's own MPI and Ray
launchers set the same variables). A plain `python`/`hpcrlhf` call is a world of one.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from hpcrlhf.engines.rendezvous import launched_store, local_store
from hpcrlhf.errors import HpcrlhfError

T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_dist_env() -> DistEnv:
    env = os.environ
    return DistEnv(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


def device_for(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed(timeout_minutes: float = 30.0) -> DistEnv:
    """Join (or create, for a world of one) the default process group; idempotent."""
    env = read_dist_env()
    if dist.is_initialized():
        return env
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
    # A finite timeout turns a dead peer into an error instead of a hang until the job's time limit.
    timeout = timedelta(minutes=timeout_minutes)
    if env.world_size == 1:
        _init_world_of_one(backend, timeout)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent serves the store
        dist.init_process_group(backend, timeout=timeout)
    else:
        _init_launched(backend, env, timeout)
    return env


_STORE: list = []
"""The default group's store, kept: torch holds only the C++ half of a store written in Python."""


def _init_launched(backend: str, env: DistEnv, timeout: timedelta) -> None:
    """The default group of ranks started by hpcrlhf's launchers (MPI, `hpcrlhf submit`): its store on
    MASTER_ADDR only, sealed where the launcher made a secret (hpcrlhf.engines.rendezvous)."""
    _STORE[:] = [launched_store(env.rank, timeout.total_seconds())]
    dist.init_process_group(backend, store=_STORE[0], rank=env.rank, world_size=env.world_size, timeout=timeout)


def _init_world_of_one(backend: str, timeout: timedelta) -> None:
    """A process group of this process alone, with nothing listening beyond loopback: its store in
    memory (`local_store`: torch's env:// store would listen on every interface, on a port the
    system picks), and gloo's devices -- this group's and those libraries make later (DeepSpeed
    clones the world group) -- on loopback (GLOO_SOCKET_IFNAME=lo unless set: by default gloo
    listens on the host name's address, open to other hosts). Every member of any group this
    process forms is on this host. torchrun's variables are set for libraries that look for them."""
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1", "GLOO_SOCKET_IFNAME": "lo"}.items():
        os.environ.setdefault(key, value)
    dist.init_process_group(backend, store=local_store(), rank=0, world_size=1, timeout=timeout)


def leave_process_group() -> None:
    """Destroy the default process group (and every group made from it) before the process exits.
    Left to the interpreter's exit, the groups' threads can be destroyed while still joinable, and
    the C++ runtime aborts a rank whose run had finished ("terminate called without an active
    exception", exit -6: seen on a DSChat-style ZeRO-3 run under torchrun, now and then), failing a
    job that succeeded."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few numbers over all ranks (float64 on the CPU: exact for counts)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_tensor(t: torch.Tensor) -> torch.Tensor:
    """Element-wise sum of a tensor over all ranks (returns a new tensor on t's device)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t.clone()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    out = t.to(device).clone()
    dist.all_reduce(out)
    return out.to(t.device)


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` (picklable) on every rank; `obj` itself without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank; [obj] without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def on_main_rank(action: Callable[[], T], is_main: bool, share: bool = True) -> T | None:
    """`action()` on the main rank; an HpcrlhfError it raises is raised on every rank (none is left waiting
    in a collective for a rank that failed). Returns its result on every rank (`share`: it must be
    picklable), or on the main rank only (`share=False`; None elsewhere)."""
    outcome: tuple[HpcrlhfError | None, Any] = (None, None)
    if is_main:
        try:
            outcome = (None, action())
        except HpcrlhfError as e:
            outcome = (e, None)
    error, shared = broadcast_object((outcome[0], outcome[1] if share else None))
    if error is not None:
        raise error
    return shared if share else outcome[1]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
