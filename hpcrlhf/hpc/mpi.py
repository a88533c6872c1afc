"""Start hpcrlhf's torch.distributed ranks with MPI instead of torchrun.

    mpirun -n 8 python -m hpcrlhf.hpc.mpi train sft --config recipe.yaml
    srun --mpi=pmix python -m hpcrlhf.hpc.mpi train dpo --config recipe.yaml     (under Slurm)
    mpirun -n 8 python -m hpcrlhf.hpc.mpi -m some.module ARGS                    (a module's main)

Every MPI rank runs this module: mpi4py gives its rank and the world size; ranks are grouped
into nodes by host name (local rank, ranks per node, node rank); rank 0 picks the rendezvous
(MASTER_ADDR: $MASTER_ADDR if set, else its host's address; a port free there; a random secret
sealing the store it will serve on that address only: hpcrlhf.engines.rendezvous) and broadcasts
it over MPI. Then the `hpcrlhf` command runs with the variables torchrun would have set. MPI only
discovers; training talks gloo (CPU) or NCCL (GPU) as under torchrun.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from dataclasses import dataclass, field
from collections.abc import Sequence

from hpcrlhf.hpc.program import CLI, run_module


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    store_secret: str = field(default="", repr=False)
    """The secret sealing the default group's store (hpcrlhf.engines.rendezvous), made by rank 0."""

    def torch_env(self) -> dict[str, str]:
        """The environment torchrun gives a rank (and the store's secret, where there is one)."""
        from hpcrlhf.engines.rendezvous import SECRET_ENV  # torch: hpc/ modules import it only where used

        env = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
               "LOCAL_WORLD_SIZE": str(self.local_world_size), "GROUP_RANK": str(self.node_rank),
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}
        return {**env, SECRET_ENV: self.store_secret} if self.store_secret else env


def node_layout(hosts: Sequence[str], rank: int) -> tuple[int, int, int]:
    """(local rank, ranks on its node, node rank) of `rank` from every rank's host name; nodes are
    numbered in order of their first rank."""
    nodes = list(dict.fromkeys(hosts))
    same = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return same.index(rank), len(same), nodes.index(hosts[rank])


def _free_port(host: str) -> int:
    """A port free on `host` now (rank 0's store will listen there, on that address only)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def discover(comm=None) -> RankInfo:
    """This rank's place in the MPI job (collective: every rank must call)."""
    from hpcrlhf.engines.rendezvous import SECRET_BYTES, node_address  # torch, as above

    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    host = socket.gethostname()
    hosts = comm.allgather(host)
    rendezvous: tuple[str, int, str] | None = None
    if rank == 0:  # the store's address, port and secret, sent to the others over MPI only
        addr = os.environ.get("MASTER_ADDR") or socket.gethostbyname(host)
        rendezvous = (addr, _free_port(node_address(addr)), secrets.token_hex(SECRET_BYTES))
    addr, port, secret = comm.bcast(rendezvous, root=0)
    local_rank, local_size, node_rank = node_layout(hosts, rank)
    return RankInfo(rank, size, local_rank, local_size, node_rank, addr, port, secret)


def main(argv: Sequence[str] | None = None) -> int:
    """Discover the ranks, then run `hpcrlhf ARGS...` (or, given `-m MODULE ARGS...`, that module
    as `python -m` would: e.g. the benchmark's TRL system) with torchrun's variables set."""
    args = list(sys.argv[1:] if argv is None else argv)
    info = discover()
    os.environ.update(info.torch_env())
    if args[:1] == ["-m"] and len(args) > 1:
        return run_module(args[1], args[2:])
    return run_module(CLI, args)


if __name__ == "__main__":
    sys.exit(main())
