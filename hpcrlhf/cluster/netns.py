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

import ctypes
import errno
import fcntl
import os
import socket
import struct
from pathlib import Path

from hpcrlhf.logs import get_logger

log = get_logger()

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914
IFF_UP = 0x1
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


REFUSALS = {
    errno.ENOSPC: "the kernel allows no more user namespaces here (sysctl user.max_user_namespaces is 0 or reached)",
    errno.EPERM: ("the kernel refuses unprivileged user namespaces here (kernel.unprivileged_userns_clone=0, "
                  "kernel.apparmor_restrict_unprivileged_userns=1, or a seccomp filter of a container)"),
    errno.EUSERS: "user namespaces are nested too deeply here",
}
"""What unshare(2)'s errors mean for this use, in words (ENOSPC reads 'No space left on device')."""


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(ctypes.c_int(flags)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, REFUSALS.get(code, f"unshare(2) failed: {os.strerror(code)}"))


def _map_self(uid: int, gid: int) -> None:
    """Map this user and group to themselves in the new user namespace (what `unshare
    --map-current-user` does): files keep their owner, no other identity exists inside."""
    Path("/proc/self/setgroups").write_text("deny")  # required before an unprivileged gid_map
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def _loopback_up() -> None:
    """Bring `lo` up (a new network namespace starts with it down): SIOCSIFFLAGS, as `ip link set
    lo up` would, without needing the `ip` program."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        name = struct.pack("16s", b"lo")
        flags = struct.unpack_from("h", fcntl.ioctl(s, SIOCGIFFLAGS, name + bytes(24)), 16)[0]
        fcntl.ioctl(s, SIOCSIFFLAGS, name + struct.pack("h", flags | IFF_UP) + bytes(22))


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
    _unshare(CLONE_NEWUSER | CLONE_NEWNET)
    _map_self(uid, gid)
    _loopback_up()
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
