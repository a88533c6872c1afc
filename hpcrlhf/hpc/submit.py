"""`hpcrlhf submit`: the job `hpcrlhf sbatch` writes, submitted through submitit and followed.

Every Slurm task runs one `ClusterTask`. Ray jobs: task 0 checks the job against the allocation,
starts the Ray head and runs the driver (`ray_slurm driver`) as a child process; the other tasks
each run a Ray worker node until the head has gone. Other jobs: each task runs one
`hpcrlhf train` rank with the torchrun variables taken from submitit's job environment.

Requeue: submitit's `--signal=USR2@lead` reaches every process of the job. The training children
treat USR2 as a stop request (finish the step, checkpoint, exit 3); Ray's processes ignore it; task
0's submitit handler calls `ClusterTask.checkpoint`, which waits for the driver to have
checkpointed and hands submitit the same task to requeue -- at most `max_requeues` times. A run that
lost a worker or node (exit 4, hpcrlhf.errors.WorkerLost) is requeued the same way by task 0. The
requeued job resumes from the run folder's last checkpoint. So is a job whose `hpcrlhf` child was
SIGKILLed on any task (requeued by that task): its peers only see a broken collective.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from hpcrlhf.errors import HpcrlhfError
from hpcrlhf.hpc.allocation import Allocation, check_fits, node_addresses
from hpcrlhf.hpc.ray_slurm import run_node, start_node, stop_node
from hpcrlhf.hpc.sbatch import (NODES_GONE_GRACE_S, SlurmOptions, container_setup, exec_prefix, offline_env,
                                 ray_token_env)
from hpcrlhf.run.files import make_folders, require_safe
from hpcrlhf.run.signals import EXIT_LOST, EXIT_REQUEUE


def rendezvous_port(job_id: int) -> int:
    """torch.distributed's port for a non-Ray job (from the job id, below Ray's port blocks)."""
    return 15000 + job_id % 5000


@dataclass
class ClusterTask:
    argv: list[str]
    launcher: str
    max_requeues: int
    python: str = sys.executable
    requeues: int = 0

    def __post_init__(self) -> None:
        self._child: subprocess.Popen | None = None

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_child"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._child = None

    def __call__(self) -> Any:
        import submitit

        env = submitit.JobEnvironment()
        alloc = Allocation.from_env(hostnames=env.hostnames)
        print(f"hpcrlhf: task {env.global_rank}/{env.num_tasks} on {env.hostname} (attempt {self.requeues + 1})",
              flush=True)
        if self.launcher == "ray" and env.global_rank != 0:
            return run_node(alloc)
        check_fits(self.argv, alloc.nodes, alloc.gpus_per_node, launcher=self.launcher,
                   where=f"the allocation of job {alloc.job_id}", cpus_per_node=alloc.cpus_per_node)
        if self.launcher == "ray":
            head = start_node(alloc, 0)
            try:
                status = self._run([self.python, "-m", "hpcrlhf.hpc.ray_slurm", "driver", *self.argv], {}, head=head)
            finally:
                stop_node(head)
        else:
            ranks = {"RANK": env.global_rank, "WORLD_SIZE": env.num_tasks, "LOCAL_RANK": env.local_rank,
                     "LOCAL_WORLD_SIZE": env.num_tasks // env.num_nodes, "GROUP_RANK": env.node,
                     "MASTER_ADDR": node_addresses(alloc.hosts[:1])[0], "MASTER_PORT": rendezvous_port(alloc.job_id)}
            status = self._run([self.python, "-m", "hpcrlhf", *self.argv], {k: str(v) for k, v in ranks.items()})
        return self._result(status, env.global_rank)

    def _run(self, cmd: Sequence[str], env: dict[str, str], *, head: subprocess.Popen | None = None,
             grace_s: float = NODES_GONE_GRACE_S) -> int:
        """Run `cmd` to its end; its status. With `head` (the Ray head node's `ray start --block`), a head that
        ends while the driver runs ends the driver too, as the sbatch script does when the nodes' step ends:
        `grace_s` for it to notice and exit by itself (naming what died), then TERM, KILL 30 s later; lost (4)."""
        self._child = child = subprocess.Popen(list(cmd), env={**os.environ, **env}, stdin=subprocess.DEVNULL)
        while child.poll() is None:  # poll, not wait(): the signal handler polls it too
            time.sleep(0.5)
            if head is not None and head.poll() is not None and child.poll() is None:
                return self._head_gone(child, head.returncode, grace_s)
        return child.returncode

    @staticmethod
    def _head_gone(child: subprocess.Popen, head_status: int, grace_s: float) -> int:
        print(f"hpcrlhf: the Ray head node ended (status {head_status}) while the driver was running", flush=True)
        deadline = time.monotonic() + grace_s
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        if child.poll() is None:
            print(f"hpcrlhf: the driver still runs {grace_s:g} s later: stopping it", flush=True)
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if child.returncode in (0, EXIT_REQUEUE, EXIT_LOST):
            return child.returncode
        print(f"hpcrlhf: the Ray head node was lost (driver status {child.returncode}, taken as {EXIT_LOST})", flush=True)
        return EXIT_LOST

    def _result(self, status: int, rank: int) -> Any:
        run_dir = Path(self.argv[self.argv.index("--output-dir") + 1])
        if status == EXIT_REQUEUE:
            return {"status": "stopped", "run_dir": str(run_dir)}
        if status == -signal.SIGKILL:  # the admin, a node health check: a lost worker, as in `hpcrlhf sbatch` scripts
            print(f"hpcrlhf: rank {rank}: `hpcrlhf {self.argv[0]}` was killed (SIGKILL)", flush=True)
        if (status == -signal.SIGKILL or status == EXIT_LOST and rank == 0) and self._requeue_now():
            raise SystemExit(-1)  # as submitit's own requeue ends: no result, the job runs again
        if status != 0:
            raise HpcrlhfError(f"rank {rank}: `hpcrlhf {' '.join(self.argv)}` exited {status}; its output is above")
        summary = run_dir / "summary.json"
        return json.loads(summary.read_text()) if rank == 0 and summary.exists() else {"status": "done"}

    def _requeue_now(self) -> bool:
        """After a lost worker or node (exit 4): requeue the job with the next attempt as its task, the
        way submitit requeues on a time limit. False when it may not (--max-requeues, no scontrol)."""
        import submitit
        from submitit.core.utils import temporary_save_path

        if not self._may_requeue():
            return False
        print(f"hpcrlhf: lost a worker or node; requeueing (requeue {self.requeues + 1} of at most "
              f"{self.max_requeues}) to resume from the last checkpoint", flush=True)
        env = submitit.JobEnvironment()
        delayed = submitit.helpers.DelayedSubmission.load(env.paths.submitted_pickle)
        delayed.function = replace(self, requeues=self.requeues + 1)
        with temporary_save_path(env.paths.submitted_pickle) as tmp:
            delayed.dump(tmp)
        subprocess.run(["scontrol", "requeue", str(env.job_id)], check=True, timeout=60)
        return True

    def _may_requeue(self) -> bool:
        if self.requeues >= self.max_requeues:
            print(f"hpcrlhf: not requeued: already requeued {self.requeues} time(s) (--max-requeues)", flush=True)
            return False
        if shutil.which("scontrol") is None:  # submitit requeues with `scontrol requeue` from this task
            print("hpcrlhf: not requeued: `scontrol` is not available here (inside a container image without "
                  "Slurm's client tools?); resubmit the same command to resume from the last checkpoint, or use "
                  "`hpcrlhf sbatch --container`, whose script requeues from the host", flush=True)
            return False
        return True

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's time-limit/preemption hook (task 0): let the driver checkpoint, then requeue."""
        import submitit

        child = self._child
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGUSR1)
            print("hpcrlhf: stop requested; waiting for the current step to end and checkpoint", flush=True)
            while child.poll() is None:
                time.sleep(0.5)
        if not self._may_requeue():
            return None
        print(f"hpcrlhf: checkpointed; requeueing (requeue {self.requeues + 1} of at most {self.max_requeues})",
              flush=True)
        return submitit.helpers.DelayedSubmission(replace(self, requeues=self.requeues + 1))


def executor(o: SlurmOptions):
    import submitit

    # submitit's script: the same environment (offline, caches, the image and its checks, Ray's token)
    # as `hpcrlhf sbatch` writes, then `srun <python> -m submitit.core._submit`, inside the image if any.
    ex = submitit.AutoExecutor(folder=Path(o.run_dir) / "submitit", cluster="slurm",
                               slurm_max_num_timeout=o.max_requeues, slurm_python=exec_prefix(o))
    params: dict[str, Any] = dict(
        nodes=o.nodes, tasks_per_node=o.tasks_per_node, gpus_per_node=o.gpus_per_node, timeout_min=o.time_minutes,
        name=o.job_name, slurm_signal_delay_s=o.signal_lead_s,
        slurm_srun_args=["--kill-on-bad-exit=1"], slurm_additional_parameters={"requeue": True})
    params.update({f"slurm_{k}": v for k in ("partition", "account", "qos") if (v := getattr(o, k))})
    if o.cpus_per_gpu:
        params["slurm_cpus_per_gpu"] = o.cpus_per_gpu
    params["slurm_setup"] = offline_env(o) + container_setup(o) + (ray_token_env(o) if o.launcher == "ray" else [])
    ex.update_parameters(**params)
    return ex


def submit(argv: Sequence[str], o: SlurmOptions):
    """Queue `hpcrlhf <argv>` with options `o`; returns submitit's job handle."""
    make_folders(Path(o.run_dir), "--output-dir")
    require_safe(Path(o.run_dir) / "submitit", "folder")  # submitit writes the job's pickle into it by path
    task = ClusterTask(list(argv), o.launcher, o.max_requeues, python=o.python)
    return executor(o).submit(task)


def latest_metrics(run_dir: Path, keys: int = 6) -> str | None:
    """The run's latest metrics line, shortened to its step and first `keys` values."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    lines = path.read_text().strip().splitlines()
    if not lines:
        return None
    try:
        row = json.loads(lines[-1])
    except json.JSONDecodeError:  # a line being written
        row = json.loads(lines[-2]) if len(lines) > 1 else {}
    values = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "step"][:keys]
    return f"step {row.get('step', '?')}: " + " ".join(values)


ENDED_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE")
"""Slurm's final job states; sacct may add who cancelled ("CANCELLED by 1000"): `follow` reads the first word."""
UNKNOWN_FOR_S = 300.0
"""How long `follow` goes on while Slurm's accounting does not know the job and the queue no longer holds it (a
job just submitted is briefly in neither; slurmdbd can lose one)."""


def queue_state(job_id: str) -> str | None:
    """The job's state in Slurm's queue (`squeue`), or None when the queue does not hold it (ended) or
    cannot be asked."""
    try:
        proc = subprocess.run(["squeue", "--noheader", "--jobs", str(job_id), "--format", "%T"], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    states = proc.stdout.split() if proc.returncode == 0 else []
    return states[0] if states else None


def follow(job, run_dir: str, *, poll_s: float = 10.0, out=sys.stdout, unknown_for_s: float = UNKNOWN_FOR_S) -> int:
    """Print the job's state changes and latest metrics line until it ends; 0 when it completed. The
    state is Slurm's accounting's (submitit: sacct); where it does not know the job, the queue's; where
    neither does for `unknown_for_s`, following stops with a line that says where to look (1)."""
    last_state, last_line, unknown_since = None, None, None
    while True:
        state = job.watcher.get_state(job.job_id, mode="force")
        if state == "UNKNOWN":
            state = queue_state(job.job_id) or state
        unknown_since = (unknown_since or time.monotonic()) if state == "UNKNOWN" else None
        line = latest_metrics(Path(run_dir))
        if state != last_state:
            print(f"job {job.job_id}: {state}", file=out, flush=True)
            last_state = state
        if line and line != last_line:
            print(f"  {line}", file=out, flush=True)
            last_line = line
        if state.split(" ")[0] in ENDED_STATES:
            break
        if unknown_since is not None and time.monotonic() - unknown_since >= unknown_for_s:
            print(f"job {job.job_id}: neither Slurm's accounting (sacct) nor its queue (squeue) has known it for "
                  f"{unknown_for_s:.0f} s; stopped following. Its log: {job.paths.stdout}; its metrics: {run_dir}/metrics.jsonl",
                  file=out, flush=True)
            return 1
        time.sleep(poll_s)
    if state == "COMPLETED":
        return 0
    print(f"job {job.job_id} ended {state}; its log: {job.paths.stdout}", file=out, flush=True)
    return 1
