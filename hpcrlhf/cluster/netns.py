"""A private network for a job's local Ray cluster: a new user + network namespace in which the
only interface is loopback.

Ray 2.60's GCS, raylets, agents and workers listen on every interface of the host whatever node
address they are given (see hpcrlhf.cluster.session), and no Ray option binds them to loopback.
A job that starts its own cluster (no RAY_ADDRESS) therefore moves itself -- before Ray or any
worker starts -- into a network namespace of its own: every port it opens is invisible to other
hosts and to other processes of this host, token or not. It needs no privilege (an unprivileged
user namespace maps the user to itself) and keeps its PID, files and signals: Slurm, `kill` and
Ctrl-C reach it as before. The price: nothing inside reaches the network either (models, data and
tokenizers must be local or in the Hugging Face cache; HF_HUB_OFFLINE is set inside).

`placement.local_network` chooses: `auto` (private where the kernel allows unprivileged user
namespaces, else the host's network with a warning), `private` (refuse to start otherwise), `host`
(the host's network: token authentication only, for jobs that must download inside the run)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from hpcrlhf.logs import get_logger
from hpcrlhf.namespaces import CLONE_NEWNET, CLONE_NEWUSER, loopback_up, map_self, unshare

log = get_logger()

MARKER = "HPCRLHF_PRIVATE_NETWORK"
"""Set (to the namespace's id) in the environment of a process that entered the private network,
so its children -- Ray nodes and workers -- and a nested call know they are inside."""
LOCAL_NETWORKS = ("auto", "private", "host")


def namespace_id(pid: int | str = "self") -> str:
    """The network namespace of process `pid` (as /proc names it, e.g. 'net:[4026531840]')."""
    return os.readlink(f"/proc/{pid}/ns/net")


def inside() -> bool:
    """Whether this process runs in the private network it (or an ancestor) entered."""
    return os.environ.get(MARKER) == namespace_id()


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def why_not() -> str | None:
    """Why this process cannot enter a private network now (None: it can try)."""
    if not Path("/proc/self/ns/net").exists():
        return "this system has no Linux namespaces (/proc/self/ns/net)"
    threads = _threads()
    if threads > 1:
        return (f"the process already runs {threads} threads (a user namespace can only be entered by a "
                "single-threaded process: run the job with the `hpcrlhf` command)")
    return None


def enter() -> None:
    """Move this (single-threaded) process into a new user + network namespace with loopback up.
    Raises OSError with the reason where the kernel refuses (unprivileged user namespaces off)."""
    reason = why_not()
    if reason:
        raise OSError(errno.EINVAL, reason)
    uid, gid = os.getuid(), os.getgid()
    unshare(CLONE_NEWUSER | CLONE_NEWNET)
    map_self(uid, gid)
    loopback_up()
    os.environ[MARKER] = namespace_id()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing outside can be reached: use the cache at once


def isolate(mode: str) -> bool:
    """Enter a private network for a job about to start its own Ray cluster, as `mode`
    (placement.local_network) asks. True: the job runs in a private network (entered now or
    before). Raises OSError for `private` where it cannot be entered; `auto` then warns and stays
    on the host's network."""
    if mode not in LOCAL_NETWORKS:
        raise ValueError(f"local network mode {mode!r}: use one of {', '.join(LOCAL_NETWORKS)}")
    if mode == "host":
        return False
    if inside():
        return True
    try:
        enter()
    except OSError as e:
        if mode == "private":
            raise
        log.warning(f"could not give the local Ray cluster a private network ({e.strerror or e}): its ports are open "
                    "on the host's interfaces, guarded by its token only (placement.local_network=host says so "
                    "without this warning; private makes it an error)")
        return False
    log.info("the local Ray cluster runs in a private network namespace: loopback only, nothing reachable from "
             "other hosts (placement.local_network=host to use the host's network)")
    return True
