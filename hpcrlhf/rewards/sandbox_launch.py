"""The sandbox's launcher: `python -I -S sandbox_launch.py SPEC` makes the process a sandbox, then
runs the program in it (`hpcrlhf.rewards.sandbox` starts it and says what it guarantees).

It runs between fork and the program: standard library only (no site-packages, nothing of the job
imported but `hpcrlhf.namespaces`), single-threaded (a user namespace can only be entered so). SPEC
is JSON: `argv` and `env` of the program, `uid`/`gid` to run as when started as root, `limits`
(`cpu_s`, `memory_bytes`, `file_bytes`, `processes`), `allow_host_network`, and `status_fd`, a
pipe on which it writes one JSON line before the program starts: `{"isolation": {...}}` (what it
got), or `{"refused": why}` (exit status REFUSED, the program not run).

Steps, in this order because each needs the one before:
1. Started as root: new network, PID, mount and IPC namespaces while root may make them, the
   private filesystem (step 3) made, then the user `uid` (nobody) with no supplementary groups:
   the program has no privilege over the host.
2. A new user namespace (the caller's user mapped to itself): the kernel then counts the run's
   processes apart from every other process of that user, so RLIMIT_NPROC bounds this run alone
   (Linux >= 5.14); not root-started, the network, PID, mount and IPC namespaces come with it.
   Where the kernel refuses (unprivileged user namespaces off), a root-started run goes on (its
   processes counted with every other process of `uid`); any other is refused unless
   `allow_host_network`, and then runs on the host's network and filesystem with no namespace, in
   the folder it was started in.
3. With a mount namespace, a private filesystem: every mount read-only (mount_setattr, Linux >=
   5.12), then /tmp a new tmpfs of at most the file size limit (and 4096 files), also seen at
   /var/tmp and /dev/shm; the run's files are copied there and it is the program's working folder,
   HOME and TMPDIR. What the program writes can only go there, and the tmpfs is gone when the run's
   last process ends: nothing is left on the host's disks.
4. Limits: CPU time, address space, file size, no core files, process count (set after step 2: a
   limit set before would also bound the user's processes outside).
5. With a PID namespace: fork; the child is its init (PID 1) and becomes the program, dying with
   this launcher (PR_SET_PDEATHSIG). When PID 1 ends, the kernel kills every process left in the
   namespace, so a daemon the program started cannot outlive the run. This launcher waits and exits
   with the program's status (128 + N for a program killed by signal N) once the namespace is empty;
   SIGTERM makes it kill the program first (the run's timeout). Without a PID namespace, it becomes
   the program itself.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this hpcrlhf (-I -S: no other path)

from hpcrlhf.namespaces import (CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWUSER,  # noqa: E402
                                MS_BIND, MS_NODEV, MS_NOSUID, MS_PRIVATE, MS_REC, loopback_up, map_self, mount,
                                set_read_only, unshare)

REFUSED = 125
"""Exit status of a launcher that refused to run the program (the reason on the status pipe)."""
CANNOT_RUN = 127
"""Exit status when the program could not be started (as a shell says it)."""
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
PRIVATE = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC
"""The namespaces a run gets besides its user namespace."""
FOLDER, ALSO_FOLDER = "/tmp", ("/var/tmp", "/dev/shm")
"""The run's folder in a private filesystem, and the other places programs expect to write, which show it too."""
FOLDER_FILES = 4096
"""Files and folders the run's folder may hold (each costs kernel memory)."""


class Refused(Exception):
    """The sandbox cannot be made as asked: the program is not run."""


def _prctl(option: int, value: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the process that started this one ends (at once if it already has)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(REFUSED)


def _own_tasks(uid: int) -> int:
    """Processes and threads of `uid` now: what RLIMIT_NPROC counts when the run has no user namespace."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:  # ended meanwhile
                pass
    return count


def isolate(spec: dict) -> dict:
    """Steps 1 to 3: what isolation the run got (written to the status pipe)."""
    got = {"network": "host", "pids": False, "filesystem": "host", "user": "self", "processes": "per run"}
    files = {name: Path(name).read_bytes() for name in os.listdir(".")}  # the run's files, before /tmp hides them
    folder_bytes = spec["limits"]["file_bytes"]
    root_started = os.geteuid() == 0 and spec.get("uid") is not None
    if root_started:
        unshare(PRIVATE)  # root may, with or without user namespaces
        loopback_up()
        got.update(network="private", pids=True, filesystem=private_filesystem(folder_bytes, spec["uid"], spec["gid"]))
        os.setgroups([])
        os.setresgid(spec["gid"], spec["gid"], spec["gid"])
        os.setresuid(spec["uid"], spec["uid"], spec["uid"])
        _prctl(PR_SET_DUMPABLE, 1)  # a changed uid makes /proc/self root's: the identity map must be written
        got["user"] = f"uid {spec['uid']}"
    uid, gid = os.getuid(), os.getgid()
    try:
        unshare(CLONE_NEWUSER if root_started else CLONE_NEWUSER | PRIVATE)
    except OSError as e:
        if root_started:  # network, PIDs and files already private
            got["processes"] = f"shared with every process of uid {uid}"
        elif spec["allow_host_network"]:
            got["processes"] = f"added to the {_own_tasks(uid)} processes and threads of uid {uid}"
            got["why"] = e.strerror
        else:
            raise Refused(f"a run cannot get a network namespace of its own: {e.strerror}") from None
    else:
        map_self(uid, gid)
        if not root_started:
            loopback_up()
            got.update(network="private", pids=True, filesystem=private_filesystem(folder_bytes, uid, gid))
    if got["filesystem"] != "host":
        for name, data in files.items():
            Path(name).write_bytes(data)
    return got


def private_filesystem(folder_bytes: int, uid: int, gid: int) -> str:
    """Step 3, in this process's new mount namespace: the host's mounts read-only, the run's folder
    a tmpfs (`FOLDER`, owned by `uid`:`gid`), this process in it. Returns what the filesystem is."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # what happens below stays in this namespace
    try:
        set_read_only("/", True, recursive=True)
        read_only = True
    except OSError as e:
        if e.errno != errno.ENOSYS:
            raise
        read_only = False
    else:
        # /proc itself writable again: a root-started launcher writes its identity map there after this
        set_read_only("/proc", False, recursive=False)
    mount("tmpfs", FOLDER, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={folder_bytes},nr_inodes={FOLDER_FILES},mode=0700,uid={uid},gid={gid}")
    for path in ALSO_FOLDER:
        if os.path.isdir(path):
            mount(FOLDER, path, None, MS_BIND)
    os.chdir(FOLDER)
    return f"read-only but {FOLDER}" if read_only else f"writable (Linux < 5.12), {FOLDER} private"


def set_limits(limits: dict, got: dict) -> None:
    """Step 4."""
    processes = limits["processes"] + 1  # this launcher is one of them
    if got["processes"].startswith("added"):
        processes += _own_tasks(os.getuid())
    for name, value in (("RLIMIT_CPU", limits["cpu_s"]), ("RLIMIT_AS", limits["memory_bytes"]),
                        ("RLIMIT_FSIZE", limits["file_bytes"]), ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", processes)):
        resource.setrlimit(getattr(resource, name), (value, value))  # hard too: the program cannot raise them


def run(argv: list[str], env: dict, pids: bool, parent: int) -> None:
    """Step 5 (does not return)."""
    if not pids:
        _exec(argv, env)
    _die_with_parent(parent)
    child = os.fork()
    if child == 0:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a fork clears it; PID 1 has no parent to compare with
        _exec(argv, env)
    # SIGTERM (the run's timeout): kill the program, then wait for it as ever. PID 1's end is reported
    # only once the kernel has ended every other process of its namespace, so this launcher exits when
    # nothing of the run is left.
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))
    _, status = os.waitpid(child, 0)  # retried after the handler (PEP 475)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the pid is free now: never kill it again
    os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def _exec(argv: list[str], env: dict) -> None:
    try:
        os.execve(argv[0], argv, env)
    except OSError as e:
        os.write(2, f"sandbox: cannot run {argv[0]}: {e.strerror}\n".encode())
        os._exit(CANNOT_RUN)


def main() -> None:
    parent = os.getppid()
    spec = json.loads(sys.argv[1])
    with os.fdopen(spec["status_fd"], "w") as status:
        try:
            got = isolate(spec)
            if not os.access(spec["argv"][0], os.X_OK):
                raise Refused(f"{spec['argv'][0]} cannot be run by the sandbox's user ({got['user']})")
            set_limits(spec["limits"], got)
        except Exception as e:  # Refused, or a namespace or mount call the kernel refused (OSError)
            why = str(e) if isinstance(e, Refused) else f"a run cannot be isolated here: {e}"
            status.write(json.dumps({"refused": why}))
            status.flush()
            os._exit(REFUSED)
        status.write(json.dumps({"isolation": got}))
    folder = os.getcwd()  # the private /tmp, or the folder it was started in
    run(spec["argv"], {**spec["env"], "HOME": folder, "TMPDIR": folder}, got["pids"], parent)


if __name__ == "__main__":
    main()
