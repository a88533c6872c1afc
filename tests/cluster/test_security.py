"""Issue 9, security on shared nodes: a token-authenticated Ray cluster (`start_local_cluster(...,
auth_token_path=...)`, as a Slurm job's is with RAY_AUTH_MODE=token) admits only clients holding its
token, keeps the token in a file only its owner can read, and serves no dashboard. Issue 36: the
stores of a job's process groups listen in its port block, sealed, on the host's network (on Slurm
nodes: tests/cluster/test_ppo.py, the job inside the image); a SIGKILLed driver leaves no process or
shared memory of its cluster behind.

The cluster (one node) is started in a fresh process: Ray allows one driver per process and keeps
its authentication settings process-wide, and this package's shared cluster (`ray_cluster`) may
hold this process's driver. Every other client is a separate Python process, as another user's
would be: its environment has no RAY_* settings and its HOME is empty (Ray would otherwise read a
token from ~/.ray/auth_token).
"""

from __future__ import annotations

import http.client
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpcrlhf.cluster.bootstrap import PORTS_PER_NODE, RayPorts
from hpcrlhf.cluster.local import RAY_AUTH_VARS, LocalRayCluster, start_local_cluster, write_auth_token
from tests.cluster.stores import Survey, assert_stores_sealed_in_the_block, survey
from tests.launch_helpers import in_a_fresh_process

pytestmark = pytest.mark.distributed

CLIENT = ("import sys, ray; ray.init(address=sys.argv[1], log_to_driver=False); "
          "print('answer', ray.get(ray.remote(lambda: 6 * 7).remote()))")
CLIENT_TIMEOUT_S = 60.0
REFUSED = re.compile(r"InvalidAuthToken|AuthenticationError|UNAUTHENTICATED|Unauthenticated")
DASHBOARD_PORT = 8265
"""Ray's default dashboard port."""
STRAY_TOKEN = "a-token-the-caller-happened-to-export"


def _auth_vars() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in RAY_AUTH_VARS}


def start_token_cluster(root: Path) -> tuple[LocalRayCluster, bool]:
    """Run in a fresh process: a caller with an unrelated RAY_AUTH_TOKEN exported starts a 1-node
    token cluster; returns it and whether the caller's RAY_AUTH_* came back unchanged."""
    os.environ["RAY_AUTH_TOKEN"] = STRAY_TOKEN  # must neither become the cluster's token nor be lost
    before = _auth_vars()
    cluster = start_local_cluster(1, 0, cpus_per_node=1, root=root, auth_token_path=root / "token",
                                  die_with_caller=False)  # it outlives this process: the test stops it
    return cluster, _auth_vars() == before


@dataclass
class Started:
    cluster: LocalRayCluster
    env_restored: bool
    home: Path
    """An empty HOME for the clients."""


@pytest.fixture(scope="module")
def secure():
    root = Path(tempfile.mkdtemp(prefix="hpcrlhf-sec-", dir="/tmp"))  # short: Ray's socket paths are limited
    cluster, env_restored = in_a_fresh_process(start_token_cluster, root)
    try:
        (root / "home").mkdir()
        yield Started(cluster, env_restored, root / "home")
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Client:
    """A client process trying to attach and run a task; `finish()` waits for it (never past its deadline)."""

    proc: subprocess.Popen
    deadline: float

    def finish(self) -> tuple[int, str]:
        try:
            out, _ = self.proc.communicate(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            pytest.fail(f"the client hung for {CLIENT_TIMEOUT_S:.0f} s instead of failing or attaching:\n{out[-3000:]}")
        return self.proc.returncode, out


def client(home: Path, address: str, **auth: str) -> Client:
    """Start a client of `address` with no RAY_* settings but `auth` and an empty `home`, as another
    user's would be."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", **auth)
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, address], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return Client(proc, time.monotonic() + CLIENT_TIMEOUT_S)


def ray_client_address(cluster: LocalRayCluster) -> str:
    """The head's Ray Client server (`ray://`), the other way in."""
    host, gcs_port = cluster.address.rsplit(":", 1)
    return f"ray://{host}:{RayPorts.from_base(int(gcs_port)).client_server}"


@pytest.fixture(scope="module")
def refused(secure):
    """The clients that must be turned away, started together (Ray retries a refused connection for
    ~20 s before giving up)."""
    wrong = secure.home.parent / "wrong-token"
    write_auth_token(wrong)
    address = secure.cluster.address
    return {"no token": client(secure.home, address),
            "no token, Ray Client": client(secure.home, ray_client_address(secure.cluster)),
            "wrong token": client(secure.home, address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(wrong))}


def assert_refused(c: Client) -> None:
    status, out = c.finish()
    assert status != 0 and "answer 42" not in out, f"a client without the token attached:\n{out[-3000:]}"
    assert REFUSED.search(out), f"the client failed, but not for authentication:\n{out[-3000:]}"


def test_a_client_without_the_token_cannot_attach(refused):
    assert_refused(refused["no token"])


def test_a_ray_client_without_the_token_cannot_attach(secure, refused):
    """Through the Ray Client port (ray://) the server refuses for want of a token, but Ray's client
    only says "ray client connection timeout" (after ~30 s): the server's log says why."""
    status, out = refused["no token, Ray Client"].finish()
    assert status != 0 and "answer 42" not in out, f"a Ray Client without the token attached:\n{out[-3000:]}"
    log = secure.cluster.temp_dir / "session_latest" / "logs" / "ray_client_server.err"
    assert "Authentication required but no authorization header provided" in log.read_text()


def test_a_client_with_a_wrong_token_cannot_attach(refused):
    assert_refused(refused["wrong token"])


def test_a_client_given_the_token_attaches_and_runs_a_task(secure):
    status, out = client(secure.home, secure.cluster.address, **secure.cluster.client_env()).finish()
    assert status == 0 and "answer 42" in out, out[-3000:]


def test_the_token_file_is_owner_only_and_nothing_else_holds_the_token(secure):
    path = secure.cluster.auth_token_path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == os.getuid()
    token = path.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", token) and token != STRAY_TOKEN
    holders = [p for p in secure.cluster.temp_dir.rglob("*")
               if p != path and p.is_file() and not p.is_symlink() and token.encode() in p.read_bytes()]
    assert not holders, f"the token is written into {holders}"
    assert not [p.info["cmdline"] for p in cluster_processes(secure.cluster)
                if token in " ".join(p.info["cmdline"] or [])], "the token is on a command line (`ps` shows it)"


def test_the_caller_keeps_its_own_ray_auth_settings(secure):
    assert secure.env_restored  # its RAY_AUTH_TOKEN back, no RAY_AUTH_MODE/RAY_AUTH_TOKEN_PATH left behind


def cluster_processes(cluster: LocalRayCluster) -> list:
    """The processes of `cluster` (its nodes' process groups), with their command lines."""
    import psutil

    procs = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if os.getpgid(p.pid) in cluster.groups:
                procs.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return procs


def listening(cluster: LocalRayCluster) -> set[tuple[str, int]]:
    """The (address, port) of every TCP socket the cluster's processes listen on."""
    import psutil

    found = set()
    for p in cluster_processes(cluster):
        try:
            found |= {(c.laddr.ip, c.laddr.port) for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            pass
    return found


def answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def dashboard_api(host: str, port: int) -> bool:
    """Whether an HTTP server on host:port answers the dashboard's /api/version without a token."""
    conn = http.client.HTTPConnection(host, port, timeout=2)
    try:
        conn.request("GET", "/api/version")
        response = conn.getresponse()
        return response.status == 200 and b"ray_version" in response.read(4096)
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def test_no_dashboard_is_served(secure):
    node_ip = secure.cluster.node_ips[0]
    ports = listening(secure.cluster)
    assert ports, "found none of the cluster's listening sockets"
    assert DASHBOARD_PORT not in {port for _, port in ports}
    assert not [h for h in (node_ip, "127.0.0.1") if answers(h, DASHBOARD_PORT)], "something answers on 8265"
    reachable = {(node_ip if ip in ("0.0.0.0", "::") else ip.removeprefix("::ffff:"), port) for ip, port in ports}
    served = sorted(hp for hp in reachable if dashboard_api(*hp))
    assert not served, f"the dashboard's HTTP API answers without a token on {served}"


def test_every_port_open_to_other_hosts_is_in_the_jobs_own_block(secure):
    """Two jobs on one node never share a port, and what answers outside the host is the job's own:
    every socket the cluster's processes listen on beyond loopback lies in its port block -- the
    metrics servers of the head's autoscaler and dashboard included (Ray's fixed defaults,
    44217/44227 on all interfaces, unless moved by RayPorts.env)."""
    base = int(secure.cluster.address.rsplit(":", 1)[1])
    block = range(base, base + PORTS_PER_NODE)
    ports = listening(secure.cluster)
    outside = sorted((ip, port) for ip, port in ports
                     if port not in block and not ip.removeprefix("::ffff:").startswith("127.") and ip != "::1")
    assert not outside, f"listening outside the job's ports {block.start}-{block.stop - 1}: {outside}"
    metrics = RayPorts.from_base(base)
    assert {metrics.autoscaler_metrics, metrics.dashboard_metrics} <= {port for _, port in ports}


SESSION = textwrap.dedent("""
    import os, sys
    from hpcrlhf.config.jobspec import build_config
    from hpcrlhf.cluster.session import isolate_local_cluster, ray_session

    # what `hpcrlhf train ppo` does first, then the cluster it starts
    isolate_local_cluster("ppo", build_config("ppo", "ppo-tiny-ray-colocated", sys.argv[1:], None))
    with ray_session(1, 0) as ips:
        import ray
        print("SESSION", ray.get_runtime_context().gcs_address, os.environ.get("RAY_AUTH_TOKEN_PATH"), flush=True)
        sys.stdin.readline()
    print("ENDED", flush=True)
""")


def listening_sockets(pid: int | str) -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every TCP socket listening in the network namespace of
    process `pid`, as /proc/<pid>/net shows them (that namespace's view, like `ss -ltn` run there)."""
    import ipaddress

    found = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                hex_ip, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_ip)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian words
                found[int(fields[9])] = (str(ipaddress.ip_address(raw)), int(hex_port, 16))
    return found


def network_of(pid: int) -> tuple[str, list[str], set[tuple[str, int]]]:
    """The network namespace of process `pid`, its interfaces, and every TCP (address, port) listening in it."""
    interfaces = [line.split(":")[0].strip() for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]]
    return os.readlink(f"/proc/{pid}/ns/net"), interfaces, set(listening_sockets(pid).values())


def socket_inodes(pids) -> set[int]:
    """The inodes of every socket the processes `pids` hold open (those still running)."""
    inodes = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


@pytest.mark.parametrize("network", ["auto", "host"])
def test_a_jobs_own_local_cluster_admits_only_its_driver(tmp_path, network):
    """`hpcrlhf train ppo` without RAY_ADDRESS starts its own cluster (`ray_session`): token-
    authenticated like a Slurm job's, Ray's world-writable temp folder inside a folder only the
    user can enter, and the token gone when the run ends. Ray 2.60's servers listen on every
    interface whatever node address they get (hpcrlhf.cluster.session), so by default (auto) the job
    first moves into a private network namespace whose only interface is loopback: nothing listens
    on the host for it, and its GCS cannot be reached from the host at all. With
    placement.local_network=host the token is what keeps others out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "HPCRLHF_PRIVATE_NETWORK"}
    proc = subprocess.Popen([sys.executable, "-c", SESSION, f"placement.local_network={network}"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("SESSION "):
                break
        assert lines and lines[-1].startswith("SESSION "), "".join(lines)[-3000:]
        address, token_path = lines[-1].split()[1:]
        token = Path(token_path)
        root = token.parent
        assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(root.stat().st_mode) == 0o700
        assert [p for p in root.iterdir() if p.is_dir() and stat.S_IMODE(p.stat().st_mode) == 0o777], \
            "Ray's own temp folder (made 0777 by Ray) should sit inside the private folder"
        namespace, interfaces, ports = network_of(proc.pid)
        host, gcs_port = address.rsplit(":", 1)
        if network == "host":
            assert namespace == os.readlink("/proc/self/ns/net")
            assert_refused(client(tmp_path, address))
        else:
            assert namespace != os.readlink("/proc/self/ns/net"), "the job stayed on the host's network"
            assert interfaces == ["lo"], interfaces
            assert ("::", int(gcs_port)) in ports or (host, int(gcs_port)) in ports, ports  # the GCS, in there
            import psutil

            every = [p for p in psutil.process_iter() if str(root) in " ".join(_cmdline(p))]  # the cluster's daemons
            assert every and all(os.readlink(f"/proc/{p.pid}/ns/net") == namespace for p in every), every
            # none of the job's listening sockets is in the host's socket table (`ss -ltn` here): another
            # local cluster of this host may use the same loopback address and port, the job's are apart
            mine = socket_inodes([proc.pid, *(p.pid for p in every)])
            assert mine & set(listening_sockets(proc.pid)), "found none of the job's listening sockets"
            on_host = {inode: where for inode, where in listening_sockets("self").items() if inode in mine}
            assert not on_host, f"the job listens on the host's network: {sorted(on_host.values())}"
        proc.stdin.write("\n")
        proc.stdin.flush()
        rest = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0 and "ENDED" in rest, rest[-3000:]
        assert not token.exists(), "the token outlived its cluster"
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except Exception:  # gone, or not ours to read
        return []


@dataclass
class KilledRun:
    survey: Survey
    shared: dict[str, int]
    """The /dev/shm files the run's processes had mapped."""
    left: list[int]
    """The run's processes alive 60 s after its driver was killed."""
    log: str


@pytest.fixture(scope="module")
def host_network_run(tmp_path_factory) -> KilledRun:
    """`hpcrlhf train ppo` on its own local cluster on the host's network (placement.local_network=host:
    no private namespace), surveyed once a step is logged, then its driver killed with SIGKILL."""
    import uuid

    from hpcrlhf.cluster.reaper import alive, family, shm_mapped
    from hpcrlhf.run.metrics import read_metrics
    from tests.launch_helpers import ROOT, cli_command, cli_env

    out = tmp_path_factory.mktemp("host-network") / "run"
    tag = uuid.uuid4().hex  # in the environment of every process the run starts
    console = out.parent / "console.log"
    with open(console, "w") as sink:
        proc = subprocess.Popen(cli_command(["train", "ppo", "--config", "ppo-tiny-ray-colocated", "-o", str(out),
                                             "--set", "placement.local_network=host", "--set", "train.max_steps=300",
                                             "--set", "eval.every_steps=0", "--set", "log.every_steps=1",
                                             "--set", "log.backends=[]"]),
                                cwd=ROOT, env=cli_env(HPCRLHF_TEST_RUN=tag), stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while not ((out / "metrics.jsonl").exists() and any("rollout/score" in m for m in read_metrics(out))):
            assert proc.poll() is None and time.monotonic() < deadline, console.read_text()[-4000:]
            time.sleep(0.5)
        run = family(f"HPCRLHF_TEST_RUN={tag}")
        seen, shared = survey(alive(run)), shm_mapped(alive(run))
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60
        while alive(run) and time.monotonic() < deadline:
            time.sleep(0.5)
        return KilledRun(seen, shared, alive(run), console.read_text())
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_a_host_network_runs_stores_listen_in_its_block_sealed(host_network_run):
    """Three roles' groups and the weight-sync group (ppo-tiny-ray-colocated)."""
    assert_stores_sealed_in_the_block(host_network_run.survey, stores=4)


@pytest.mark.slow
def test_a_killed_driver_leaves_no_process_or_shared_memory_behind(host_network_run):
    """Issue 36 item 8: its local cluster's daemons, workers and vLLM engine (~600 MB) and the engine's
    /dev/shm files used to outlive a SIGKILLed driver for good (hpcrlhf.cluster.reaper)."""
    killed = host_network_run
    assert killed.shared, "the run's engine held no shared memory: nothing checked"
    assert not killed.left, f"processes of the killed run still alive 60 s later: {killed.left}"
    assert not [path for path in killed.shared if os.path.exists(path)], killed.shared
    assert re.search(r"hpcrlhf: the process \(pid \d+\) that started the local Ray cluster in \S+ died without "
                     r"stopping it: stopped its \d+ remaining process\(es\) and removed its shared memory", killed.log)
