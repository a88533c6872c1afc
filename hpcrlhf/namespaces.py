"""Linux namespaces from Python, with no privilege: unshare(2) with its refusals in words, this
user mapped to itself in a new user namespace, loopback brought up in a new network namespace.

Two users: a job's private network for its local Ray cluster (`hpcrlhf.cluster.netns`) and the
sandbox that runs generated programs (`hpcrlhf.rewards.sandbox`). The sandbox's launcher runs
without site-packages (`python -I -S`), so this module imports the standard library only.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914
IFF_UP = 0x1

REFUSALS = {
    errno.ENOSPC: "the kernel allows no more user namespaces here (sysctl user.max_user_namespaces is 0 or reached)",
    errno.EPERM: ("the kernel refuses unprivileged user namespaces here (kernel.unprivileged_userns_clone=0, "
                  "kernel.apparmor_restrict_unprivileged_userns=1, or a seccomp filter of a container)"),
    errno.EUSERS: "user namespaces are nested too deeply here",
}
"""What unshare(2)'s errors mean for this use, in words (ENOSPC reads 'No space left on device')."""


def unshare(flags: int) -> None:
    """unshare(2) of this process; OSError with the reason in words where the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(ctypes.c_int(flags)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, REFUSALS.get(code, f"unshare(2) failed: {os.strerror(code)}"))


def map_self(uid: int, gid: int) -> None:
    """Map this user and group to themselves in the new user namespace (what `unshare
    --map-current-user` does): files keep their owner, no other identity exists inside."""
    Path("/proc/self/setgroups").write_text("deny")  # required before an unprivileged gid_map
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def loopback_up() -> None:
    """Bring `lo` up (a new network namespace starts with it down): SIOCSIFFLAGS, as `ip link set
    lo up` would, without needing the `ip` program."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        name = struct.pack("16s", b"lo")
        flags = struct.unpack_from("h", fcntl.ioctl(s, SIOCGIFFLAGS, name + bytes(24)), 16)[0]
        fcntl.ioctl(s, SIOCSIFFLAGS, name + struct.pack("h", flags | IFF_UP) + bytes(22))
