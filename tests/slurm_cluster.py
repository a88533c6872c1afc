"""A real Slurm cluster on this one machine for the tests: munge, MariaDB (socket only) for
slurmdbd's accounting (submitit reads job states with sacct), slurmctld, and one slurmd per node.

Node i is `n<i>` at address 127.0.2.<i> (an /etc/hosts entry), its slurmd in its own UTS and mount
namespaces: `hostname` says n<i>, each node has a private TmpFS (Open MPI's PMIx needs one per
node), and a job's processes on different nodes resolve to different addresses, as Ray and
torch.distributed need. Each node declares `gpus_per_node` fake GPUs through gres (character
devices), so `--gpus-per-node` is accounted and sets CUDA_VISIBLE_DEVICES like a GPU cluster.

Needs root and the Debian packages of slurm/install-test-deps.sh; `unavailable_reason()` says why
not when they are missing (the tests then skip with that reason).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpcrlhf.cluster.local import stop_process_groups

DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")
NODE_TMP = "/var/tmp/hpcrlhf-slurm-nodetmp"


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd per node in its own namespaces)"
    missing = [d for d in DAEMONS if shutil.which(d, path="/usr/sbin:/usr/bin:/sbin") is None]
    if missing:
        return f"Slurm test daemons not installed ({', '.join(missing)}): run slurm/install-test-deps.sh as root"
    return None


def node_address(i: int) -> str:
    return f"127.0.2.{i}"


UNDER_WAY = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED")
"""Job states before the job has ended (a job being requeued passes through COMPLETING and REQUEUED)."""


@dataclass
class SlurmCluster:
    base: Path
    nodes: list[str]
    gpus_per_node: int
    pids: list[int] = field(default_factory=list)
    slurmds: dict[str, int] = field(default_factory=dict)
    """Each node's slurmd pid (the first process of the node's namespaces)."""

    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    def env(self, **extra: str) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf), **extra)

    def run(self, *cmd: str, timeout: float = 60) -> str:
        proc = subprocess.run(list(cmd), env=self.env(), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def sbatch(self, script: Path, *args: str) -> int:
        return int(self.run("sbatch", "--parsable", *args, str(script)).strip().split(";")[0])

    def state(self, job_id: int) -> str:
        """The job's state from the controller (sacct once it has left the controller's memory)."""
        out = subprocess.run(["scontrol", "show", "job", str(job_id), "-o"], env=self.env(), capture_output=True,
                             text=True).stdout
        for part in out.split():
            if part.startswith("JobState="):
                return part.split("=", 1)[1]
        out = self.run("sacct", "-n", "-X", "-P", "-o", "State", "-j", str(job_id))
        return out.strip().split("\n")[0].split()[0] if out.strip() else "UNKNOWN"

    def wait(self, job_id: int, timeout: float = 600) -> str:
        """Block until the job ends; returns its final state."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state not in UNDER_WAY:
                return state
            time.sleep(1)
        self.run("scancel", str(job_id))
        raise TimeoutError(f"Slurm job {job_id} still {self.state(job_id)} after {timeout:.0f} s")

    def start_now(self, job_id: int, timeout: float = 120) -> None:
        """Once a requeued job is pending again and its nodes are idle (its previous steps gone: a
        step of the new run reuses their names), let it start now instead of after Slurm's delay."""
        deadline = time.monotonic() + timeout
        while self.state(job_id) != "PENDING" or self._steps_left(job_id):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm job {job_id} was not requeued (nodes idle) within {timeout:.0f} s")
            time.sleep(0.5)
        # slurmd refuses a credential made in the same second as its revocation of the job's previous
        # one ("Killing non-startable batch JobId=N: Job credential revoked": the job then FAILS);
        # Slurm's own delay avoids that, so this one must too.
        time.sleep(2)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def _steps_left(self, job_id: int) -> bool:
        """Whether a step daemon of the job, or its PMIx socket, is still there."""
        stepds = subprocess.run(["pgrep", "-f", rf"slurmstepd: \[{job_id}\."], capture_output=True).returncode == 0
        return stepds or any(self.base.glob(f"spool/*/stepd.slurm.pmix.{job_id}.*"))

    def node_processes(self, node: str) -> list[int]:
        """Every process running on `node`: its slurmd and all it started (job steps, their children)."""
        return _in_namespace(os.readlink(f"/proc/{self.slurmds[node]}/ns/uts"))

    def fail_node(self, node: str) -> int:
        """Power `node` off: SIGKILL its slurmd and every process of every job on it at once (what a
        crashed host leaves: no goodbye to the controller, Ray or the peers). Returns how many died."""
        killed = _kill_namespace(os.readlink(f"/proc/{self.slurmds[node]}/ns/uts"))
        self.pids.remove(self.slurmds.pop(node))
        return killed

    def boot_node(self, node: str) -> None:
        """Start `node` again (a fresh slurmd in fresh namespaces); the controller returns it to service
        (ReturnToService=2) once it registers."""
        self.slurmds[node] = _start_slurmd(self.base, node, self.env())
        self.pids.append(self.slurmds[node])

    def wait_idle(self, nodes: list[str], timeout: float = 60) -> None:
        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env(), capture_output=True,
                                 text=True).stdout
            return {line.split()[0] for line in out.splitlines() if line.endswith(" idle")} >= set(nodes)

        _wait_for(idle, f"nodes {', '.join(nodes)} to be idle (see {self.base}/log)", timeout=timeout)

    def stop(self) -> None:
        """Every node powered off first -- its slurmd and whatever its jobs still run (a job that a
        failed test never cancelled would otherwise go on beside the next tests, holding its ports) --
        then the controller's daemons."""
        for node in list(self.slurmds):
            try:
                self.fail_node(node)
            except OSError:  # its slurmd is gone already
                pass
        stop_process_groups(self.pids, timeout_s=10)
        self.pids = []
        self.slurmds = {}


def _in_namespace(uts: str) -> list[int]:
    """Processes in UTS namespace `uts` (a node of this cluster)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "ns" / "uts") == uts:
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            pass
    return found


def _kill_namespace(uts: str) -> int:
    """SIGKILL every process in UTS namespace `uts`, until none is left (or forked meanwhile); returns
    how many died."""
    killed: set[int] = set()
    while pids := [p for p in _in_namespace(uts) if p not in killed]:
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        killed.update(pids)
        time.sleep(0.1)
    return len(killed)


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> int:
    with open(log, "a") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True).pid


def _wait_for(check, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def _start_slurmd(base: Path, node: str, env: dict[str, str]) -> int:
    """slurmd of `node` in its own UTS (hostname) and mount (private TmpFS) namespaces."""
    script = f"hostname {node} && mount --bind {base}/nodetmp/{node} {NODE_TMP} && exec /usr/sbin/slurmd -D -N {node}"
    return _spawn(["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", script],
                  base / "log" / f"slurmd-{node}.out", env)


def _ok(*cmd: str, env: dict[str, str] | None = None) -> bool:
    return subprocess.run(list(cmd), env=env, capture_output=True).returncode == 0


def _set_hosts(nodes: list[str]) -> None:
    """/etc/hosts maps each node name to its own loopback address (replacing older lines)."""
    hosts = Path("/etc/hosts")
    keep = [line for line in hosts.read_text().splitlines() if not (line.split()[1:] and line.split()[1] in nodes)]
    hosts.write_text("\n".join(keep + [f"{node_address(i + 1)} {n}" for i, n in enumerate(nodes)]) + "\n")


def _write_configs(base: Path, nodes: list[str], gpus: int) -> None:
    cpus = os.cpu_count() or 1
    mem_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.8 / len(nodes))
    node_lines = [f"NodeName={n} NodeHostname={n} NodeAddr={node_address(i + 1)} Port={17001 + i} CPUs={cpus} "
                  f"Boards=1 SocketsPerBoard=1 CoresPerSocket={cpus} ThreadsPerCore=1 RealMemory={mem_mb} "
                  f"Gres=gpu:{gpus} State=UNKNOWN" for i, n in enumerate(nodes)]
    (base / "slurm.conf").write_text("\n".join([
        "ClusterName=hpcrlhf", "SlurmctldHost=localhost", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge", "SlurmctldPort=6817", "SlurmdPort=6818",
        f"StateSaveLocation={base}/state", f"SlurmdSpoolDir={base}/spool/%n",
        f"SlurmctldPidFile={base}/run/slurmctld.pid", f"SlurmdPidFile={base}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={base}/log/slurmctld.log", f"SlurmdLogFile={base}/log/slurmd-%n.log",
        f"TmpFS={NODE_TMP}", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/linux", "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=localhost", "AccountingStoragePort=6819", "AccountingStorageTRES=gres/gpu",
        "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "MpiDefault=none", "ReturnToService=2", "SlurmdTimeout=60", "InactiveLimit=0", "KillWait=5",
        "MinJobAge=300", "MailProg=/bin/true", "GresTypes=gpu", "JobRequeue=1",
        *node_lines,
        f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
    ]) + "\n")
    fake = base / "fakegpu"
    lines = ["AutoDetect=off"]
    for n in nodes:
        for g in range(gpus):
            dev = fake / f"{n}-gpu{g}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # a character device, like /dev/null
        lines.append(f"NodeName={n} Name=gpu File={fake}/{n}-gpu[0-{gpus - 1}]")
    (base / "gres.conf").write_text("\n".join(lines) + "\n")
    dbd = base / "slurmdbd.conf"
    dbd.write_text("\n".join([
        "AuthType=auth/munge", "DbdHost=localhost", "DbdPort=6819", "SlurmUser=root", f"LogFile={base}/log/slurmdbd.log",
        f"PidFile={base}/run/slurmdbd.pid", "StorageType=accounting_storage/mysql", "StorageHost=localhost",
        "StorageUser=slurm", "StoragePass=hpcrlhf", "StorageLoc=slurm_acct_db"]) + "\n")
    dbd.chmod(0o600)


def _start_munge() -> None:
    if _ok("munge", "-n"):
        return
    for d in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
        Path(d).mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "munge", "munge")
    key = Path("/etc/munge/munge.key")
    if not key.exists() or key.stat().st_size == 0:
        key.write_bytes(os.urandom(1024))
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
    _wait_for(lambda: _ok("munge", "-n"), "munge")


def _start_mariadb(base: Path, cluster: SlurmCluster) -> None:
    if not _ok("mariadb", "-e", "select 1"):
        data = base / "db"
        data.mkdir(exist_ok=True)
        shutil.chown(data, "mysql", "mysql")
        Path("/run/mysqld").mkdir(exist_ok=True)
        shutil.chown("/run/mysqld", "mysql", "mysql")
        if not (data / "mysql").exists():
            proc = subprocess.run(["mariadb-install-db", "--user=mysql", f"--datadir={data}",
                                   "--auth-root-authentication-method=socket"], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"mariadb-install-db failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        cluster.pids.append(_spawn(["/usr/sbin/mariadbd", "--user=mysql", f"--datadir={data}", "--skip-networking",
                                    "--socket=/run/mysqld/mysqld.sock"], base / "log" / "mariadb.out", dict(os.environ)))
        _wait_for(lambda: _ok("mariadb", "-e", "select 1"), "mariadb")
    # a fresh accounting database: job ids restart at 1 with every cluster, and sacct must never
    # answer with an earlier cluster's job of the same id
    subprocess.run(["mariadb", "-e", "DROP DATABASE IF EXISTS slurm_acct_db; CREATE DATABASE slurm_acct_db; "
                    "CREATE USER IF NOT EXISTS "
                    "'slurm'@'localhost' IDENTIFIED BY 'hpcrlhf'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
                    " FLUSH PRIVILEGES;"], check=True)


def start_slurm_cluster(base: Path, num_nodes: int = 2, gpus_per_node: int = 4) -> SlurmCluster:
    """Start the daemons under `base` and wait until every node is idle (~15 s)."""
    nodes = [f"n{i + 1}" for i in range(num_nodes)]
    os.environ["PATH"] = os.pathsep.join(["/usr/sbin", "/sbin", os.environ.get("PATH", "/usr/bin:/bin")])
    base.chmod(0o755)  # the mysql user must reach its data folder
    for sub in ("state", "spool", "log", "fakegpu", "run", "nodetmp"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    cluster = SlurmCluster(base, nodes, gpus_per_node)
    try:
        _set_hosts(nodes)
        _write_configs(base, nodes, gpus_per_node)
        env = cluster.env()
        _start_munge()
        _start_mariadb(base, cluster)
        cluster.pids.append(_spawn(["/usr/sbin/slurmdbd", "-D"], base / "log" / "slurmdbd.out", env))
        _wait_for(lambda: _ok("sacctmgr", "-n", "list", "cluster", env=env), "slurmdbd")
        subprocess.run(["sacctmgr", "-i", "add", "cluster", "hpcrlhf"], env=env, capture_output=True)
        cluster.pids.append(_spawn(["/usr/sbin/slurmctld", "-D", "-i"], base / "log" / "slurmctld.out", env))
        _wait_for(lambda: "UP" in subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True).stdout,
                  "slurmctld")
        Path(NODE_TMP).mkdir(parents=True, exist_ok=True)
        for n in nodes:
            (base / "spool" / n).mkdir(exist_ok=True)
            (base / "nodetmp" / n).mkdir(exist_ok=True)
            cluster.boot_node(n)
        cluster.wait_idle(nodes)
    except BaseException:
        cluster.stop()
        raise
    return cluster
