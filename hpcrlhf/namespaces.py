"""Linux namespaces from Python, with no privilege: unshare(2) with its refusals in words, this
user mapped to itself in a new user namespace, loopback brought up in a new network namespace,
and the mounts of a new mount namespace (`mount`, `set_read_only`) changed without the `mount`
program.

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
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914
IFF_UP = 0x1
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
MOUNT_ATTR_RDONLY, AT_FDCWD, AT_RECURSIVE = 0x1, -100, 0x8000
SYS_MOUNT_SETATTR = 442
"""mount_setattr(2) (Linux >= 5.12): the same number on every architecture but alpha."""

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


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, options: str | None = None) -> None:
    """mount(2) in this process's mount namespace; OSError naming the call where it fails."""
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.mount(_bytes(source), target.encode(), _bytes(fstype), ctypes.c_ulong(flags), _bytes(options)),
           f"mount {source or fstype} on {target}")


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def set_read_only(path: str, read_only: bool, recursive: bool) -> None:
    """Make the mount at `path` (and every mount below it, `recursive`) read-only or writable, in one
    call (mount_setattr(2)); OSError ENOSYS on kernels older than 5.12. A mount that came read-only
    from a more privileged namespace cannot be made writable (EPERM)."""
    attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY if read_only else 0, 0 if read_only else MOUNT_ATTR_RDONLY, 0, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), path.encode(),
                        ctypes.c_uint(AT_RECURSIVE if recursive else 0), attr, ctypes.c_size_t(ctypes.sizeof(attr))),
           f"mount_setattr {path}")
