"""A multi-node Ray cluster on this one machine: one Ray node per loopback address (127.0.0.2,
127.0.0.3, ...), each with its own ports and declared (fake) GPUs, so that placement across
nodes is exercised for real without a cluster.

Ray rewrites 127.0.0.1 and localhost to the machine's external address, so the nodes use other
loopback addresses. Each node runs in its own session and is stopped by process group: `ray
stop` would kill every Ray process on the machine, other users' included.

With `auth_token_path`, the cluster uses Ray's token authentication (RAY_AUTH_MODE=token): a fresh
random token is written to that file (mode 0600) and only clients given it (`client_env()`) can
attach, as on a shared Slurm node (hpcrlhf.hpc.sbatch.ray_token_env).

A watcher process (hpcrlhf.cluster.reaper) stops the cluster and removes the shared memory its
processes held when the process that started it dies without stopping it (`kill -9`).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator

from hpcrlhf.cluster.bootstrap import PORTS_PER_NODE, RayPorts, private_temp_dir, ray_start_args, wait_for_nodes
from hpcrlhf.cluster.reaper import MARKER, Reaper, terminate
from hpcrlhf.errors import HpcrlhfError
from hpcrlhf.logs import get_logger
from hpcrlhf.run.files import write_secret


log = get_logger()

LOCAL_PORT_BASE = 30000
RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
"""Ray's token-authentication settings (read from the environment only)."""


def free_port_block(size: int, start: int = 20000, end: int = 60000, host: str = "127.0.0.1") -> int:
    """The first port of `size` consecutive ports from `start` that are all free on `host` right now."""
    for base in range(start, end - size, size):
        socks = []
        try:
            for port in range(base, base + size):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise HpcrlhfError(f"no block of {size} free ports between {start} and {end}")


PICK_LOCK = Path(tempfile.gettempdir()) / "hpcrlhf-port-pick.lock"
"""Held (flock) by a process from picking a local cluster's port block until its nodes listen there."""
PICK_LOCK_WAIT_S = 120.0


@contextmanager
def port_pick_lock(path: Path = PICK_LOCK, wait_s: float = PICK_LOCK_WAIT_S) -> Iterator[None]:
    """No other process on this host picks a port block while the caller holds this, so that two
    local clusters starting at once (two jobs, two test workers) cannot both find the same block free
    before either listens on it. Best effort: where the lock file cannot be opened (another user's
    file of another kind, a symbolic link) or stays held past `wait_s`, the caller goes on without it,
    with a warning."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # read-only suffices for flock
    except OSError as e:
        log.warning(f"cannot open the port-pick lock {path} ({e.strerror}); picking ports without it")
        yield
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning(f"the port-pick lock {path} was held for more than {wait_s:g} s; picking ports "
                                "without it")
                    break
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


@dataclass
class LocalRayCluster:
    """Handles of a running local cluster; `stop()` ends every process it started."""

    address: str
    """The head's GCS address (ip:port), for `ray.init(address=...)`."""
    node_ips: list[str]
    """Node addresses in node-map order (the head first)."""
    temp_dir: Path
    groups: list[int] = field(default_factory=list)
    """Process group of each node's `ray start` (the node's daemons inherit it)."""
    auth_token_path: Path | None = None
    """The token file of a token-authenticated cluster (None: no authentication)."""
    reaper: Reaper | None = field(default=None, repr=False, compare=False)
    """The watcher that stops the cluster if the process that started it dies first (hpcrlhf.cluster.reaper)."""

    def client_env(self) -> dict[str, str]:
        """Ray's authentication variables a client of this cluster needs (none without a token); a
        client must also lack RAY_AUTH_TOKEN, which Ray prefers to the file."""
        return ray_auth_env(self.auth_token_path)

    def stop(self, timeout_s: float = 5.0) -> None:
        stop_process_groups(self.groups, timeout_s)
        if self.reaper is not None:
            self.reaper.dismiss()
            self.reaper = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "reaper": None}  # the watcher stays with the process that started it

    def __enter__(self) -> LocalRayCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies do not count: a leader this process
    started is reaped here, orphans wait for an init that may never reap them)."""
    try:
        os.waitpid(pgid, os.WNOHANG)
    except ChildProcessError:  # not our child, or reaped already
        pass
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if group == str(pgid) and state != "Z":
            return True
    return False


def stop_process_groups(groups: list[int], timeout_s: float = 5.0) -> None:
    """SIGTERM every process group, SIGKILL what is left after `timeout_s` (daemons started in their
    own sessions: only what this process started is touched)."""
    def send(sig: int) -> None:
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass

    terminate(send, lambda: any(_group_alive(g) for g in groups), timeout_s)


def ray_executable() -> str:
    """The `ray` command of this Python environment (its bin folder first, then PATH): the nodes
    must run the same Ray, and their workers the same Python, as this process."""
    found = shutil.which("ray", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if found is None:
        raise HpcrlhfError(f"no `ray` command next to {sys.executable} or on PATH: install ray[default]")
    return found


def ray_auth_env(token_path: Path | None) -> dict[str, str]:
    """RAY_AUTH_* settings for token authentication with the token in `token_path`, or for none.
    "None" is said explicitly: with RAY_AUTH_MODE unset, Ray 2.60's `ray start --head` turns token
    authentication on by itself when a token file exists (~/.ray/auth_token, which any local
    `ray.init()` writes), while the other nodes' `ray start` does not, so they could not join."""
    if token_path is None:
        return {"RAY_AUTH_MODE": "disabled"}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}


def write_auth_token(path: Path) -> None:
    """A fresh random token in `path`, created readable by its owner only (0600 from the start, never
    wider even briefly: hpcrlhf.run.files.write_secret); an existing file (or link) there is
    replaced, not reused (the cluster's folder is private: only a run of this user left it)."""
    path.unlink(missing_ok=True)
    write_secret(path, secrets.token_hex(32))


def _refresh_ray_auth_state() -> None:
    """Make this process's Ray re-read RAY_AUTH_* from the environment: Ray caches the mode (in its
    config) and the token when first used. The config first, then the token (Ray's own order)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextmanager
def ray_auth_environ(settings: dict[str, str]) -> Iterator[None]:
    """This process's RAY_AUTH_* set to `settings` (the others unset) for the `with` body, then
    restored, so a driver connected inside it authenticates without leaking the settings to the
    caller (`settings` empty: nothing changes)."""
    if not settings:
        yield
        return
    saved = {k: os.environ.get(k) for k in RAY_AUTH_VARS}
    try:
        for k in RAY_AUTH_VARS:
            os.environ.pop(k, None)
        os.environ.update(settings)
        _refresh_ray_auth_state()
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _refresh_ray_auth_state()


def _node_env(auth: dict[str, str]) -> dict[str, str]:
    """The environment of the nodes' `ray start`: this process's, usage stats off, and `auth` in place
    of any RAY_AUTH_* of the caller."""
    env = {k: v for k, v in os.environ.items() if not (auth and k in RAY_AUTH_VARS)}
    return {**env, "RAY_USAGE_STATS_ENABLED": "0", **auth}


def start_local_cluster(num_nodes: int, gpus_per_node: int, *, cpus_per_node: int = 2, root: Path,
                        timeout_s: float = 120.0, auth_token_path: Path | None = None,
                        die_with_caller: bool = True) -> LocalRayCluster:
    """Start `num_nodes` Ray nodes on 127.0.0.2.. with `gpus_per_node` declared GPUs each, and wait
    until all have joined. Logs and sockets live under `root` (keep the path short: Ray's socket
    paths must fit in 107 bytes).

    With `auth_token_path`, a fresh token is written there (0600) and the nodes start with
    RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH (not the caller's RAY_AUTH_TOKEN, which Ray would
    prefer to the file). Only clients presenting the token attach: put `cluster.client_env()` in
    their environment before `ray.init`. The join check's driver in this process has those settings
    only while connected; the caller's RAY_AUTH_* are restored after it, since Ray's are process-wide
    and a later driver of this process may be for another cluster. A process that already has a Ray
    driver connected is refused before any node starts (Ray allows one per process).

    `die_with_caller`: a watcher (hpcrlhf.cluster.reaper) stops the cluster, removes the shared memory
    its processes held and its token if this process dies without stopping it (`kill -9`); False
    for a cluster handed to another process (tests)."""
    _refuse_a_second_driver()
    temp_dir = private_temp_dir(root)  # root made private (0700): Ray's own folder in it is world-writable
    ips = [f"127.0.0.{2 + i}" for i in range(num_nodes)]
    cluster_id = secrets.token_hex(8)
    with ExitStack() as picking:
        picking.enter_context(port_pick_lock())  # until the nodes listen on their block
        base = free_port_block(PORTS_PER_NODE * num_nodes, start=LOCAL_PORT_BASE)  # Slurm jobs' blocks lie below
        ports = [RayPorts.from_base(base + i * PORTS_PER_NODE) for i in range(num_nodes)]
        address = f"{ips[0]}:{ports[0].gcs}"
        cluster = LocalRayCluster(address=address, node_ips=ips, temp_dir=Path(temp_dir),
                                  auth_token_path=auth_token_path)
        if auth_token_path is not None:
            write_auth_token(auth_token_path)
        auth = cluster.client_env()
        env = {**_node_env(auth), MARKER: cluster_id}  # every process of the cluster carries it (the watcher's key)
        if die_with_caller:
            cluster.reaper = Reaper.start(cluster_id, root, auth_token_path)
        try:
            for i, (ip, p) in enumerate(zip(ips, ports)):
                _start_node(root, i, ray_start_args(node_ip=ip, ports=p, head_address=None if i == 0 else address,
                                                    num_cpus=cpus_per_node, num_gpus=gpus_per_node,
                                                    temp_dir=temp_dir if i == 0 else None),
                            {**env, **p.env()}, cluster, timeout_s)
            picking.close()  # the nodes listen: another cluster may pick its block now
            _wait_from_driver(address, ips, timeout_s, auth)
        except BaseException:
            cluster.stop()
            raise
    return cluster


def _start_node(root: Path, i: int, args: list[str], env: dict[str, str], cluster: LocalRayCluster,
                timeout_s: float) -> None:
    """Node `i`'s `ray start` (its process group kept in `cluster`), waited for; its log's end in the
    error when it fails."""
    args[0] = ray_executable()
    with open(root / f"ray_start_{i}.log", "w") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        cluster.groups.append(proc.pid)
        status = proc.wait(timeout=timeout_s)
    if status != 0:
        said = (root / f"ray_start_{i}.log").read_text(errors="replace").strip().splitlines()[-15:]
        raise HpcrlhfError(f"`{' '.join(args)}` failed; the end of {root / f'ray_start_{i}.log'}:\n" + "\n".join(said))


def _refuse_a_second_driver() -> None:
    """Refuse, before any node starts, a caller whose process already has a Ray driver connected:
    the join check needs a driver of its own, and Ray allows one per process."""
    import ray

    if ray.is_initialized():
        raise HpcrlhfError("start_local_cluster: this process already has a Ray driver connected (ray.init was "
                           "called), and the new cluster's join check needs its own; call ray.shutdown() first, "
                           "or start the cluster from another process")


def _wait_from_driver(address: str, ips: list[str], timeout_s: float, auth: dict[str, str]) -> None:
    """Connect a driver to `address` (with the `auth` settings), wait until every node in `ips` has
    joined, disconnect."""
    import ray

    with ray_auth_environ(auth):
        ray.init(address=address, log_to_driver=False)
        try:
            wait_for_nodes(ips, timeout_s)
        finally:
            ray.shutdown()
