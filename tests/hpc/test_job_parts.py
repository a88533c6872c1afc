"""The pieces of a cluster job that need no cluster: the allocation read from Slurm's variables,
the submitit task's requeue bookkeeping, and the follower's metrics line."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
import time

import pytest

from hpcrlhf.errors import ConfigError
from hpcrlhf.hpc.allocation import Allocation, expand_hostnames
from hpcrlhf.hpc.submit import ClusterTask, follow, latest_metrics, queue_state


def test_allocation_from_slurm_variables():
    env = {"SLURM_JOB_ID": "417", "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_ON_NODE": "96",
           "SLURM_TASKS_PER_NODE": "1(x4)", "SLURM_RESTART_COUNT": "2"}
    a = Allocation.from_env(env, hostnames=["gpu07", "gpu08", "gpu11", "gpu12"])
    assert (a.job_id, a.nodes, a.gpus_per_node, a.cpus_per_node, a.tasks_per_node, a.restart_count) == (417, 4, 8, 96, 1, 2)
    assert a.hosts[0] == "gpu07" and a.shape() == "4 node(s) x 8 GPU(s)"
    # without SLURM_GPUS_ON_NODE the visible devices count
    b = Allocation.from_env({"SLURM_JOB_ID": "1", "CUDA_VISIBLE_DEVICES": "0,1,2"}, hostnames=["n1"])
    assert b.gpus_per_node == 3


NODELISTS = {  # Slurm's compressed node lists, expanded by hand
    "n1": ["n1"],
    "n[1-3,07]": ["n1", "n2", "n3", "n07"],
    "gpu[008-011]": ["gpu008", "gpu009", "gpu010", "gpu011"],
    "login1,n[9-11],x": ["login1", "n9", "n10", "n11", "x"],
    "r[1-2]n[3-4]": ["r1n3", "r1n4", "r2n3", "r2n4"],
}


@pytest.mark.parametrize("nodelist", sorted(NODELISTS))
def test_node_lists_expand_like_slurm(nodelist):
    assert expand_hostnames(nodelist) == NODELISTS[nodelist]


@pytest.mark.parametrize("nodelist", sorted(NODELISTS))
def test_node_lists_expand_like_scontrol(nodelist, slurm_cluster):
    assert expand_hostnames(nodelist) == slurm_cluster.run("scontrol", "show", "hostnames", nodelist).split()


@pytest.mark.parametrize("nodelist, why", [("n[1-", "unbalanced"), ("n[a-b]", "'a-b' is not N or N-M"),
                                           ("n[3-1]", "'3-1' is not"), ("", "no host names")])
def test_unreadable_node_lists_are_named(nodelist, why):
    with pytest.raises(ConfigError, match=re.escape(f"SLURM_JOB_NODELIST {nodelist!r} cannot be read: ") + ".*" + re.escape(why)):
        expand_hostnames(nodelist)


def test_outside_a_job_the_allocation_says_so():
    with pytest.raises(ConfigError, match="SLURM_JOB_ID"):
        Allocation.from_env({}, hostnames=["n1"])


def test_checkpoint_requeues_the_same_task_until_the_limit(monkeypatch):
    pytest.importorskip("submitit")
    monkeypatch.setattr("hpcrlhf.hpc.submit.shutil.which", lambda name: f"/usr/bin/{name}")
    task = ClusterTask(["train", "sft", "--output-dir", "/r"], "mpi", max_requeues=2)
    again = task.checkpoint()
    assert again.function.requeues == 1 and again.function.argv == task.argv
    last = again.function.checkpoint().function
    assert last.requeues == 2 and last.checkpoint() is None  # --max-requeues reached: not requeued
    assert pickle.loads(pickle.dumps(last)).requeues == 2  # submitit pickles it (without its child process)


def test_without_scontrol_the_task_says_it_cannot_requeue(monkeypatch, capsys):
    pytest.importorskip("submitit")
    monkeypatch.setattr("hpcrlhf.hpc.submit.shutil.which", lambda name: None)  # an image without Slurm's tools
    assert ClusterTask(["train", "sft", "--output-dir", "/r"], "mpi", max_requeues=2).checkpoint() is None
    assert "not requeued: `scontrol` is not available here" in capsys.readouterr().out


def test_latest_metrics_line(tmp_path):
    assert latest_metrics(tmp_path) is None
    rows = [{"step": 1, "train/loss": 2.0}, {"step": 2, "train/loss": 1.23456, "rollout/score": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "tra')
    assert latest_metrics(tmp_path) == "step 2: train/loss=1.235 rollout/score=0.5"


@pytest.mark.parametrize(("index", "head_there", "status", "said"), [
    (1, True, 1, "ended by itself (status 7): the job has lost it"),  # a worker's Ray died: its task fails
    (0, True, 1, "ended by itself (status 7): the job has lost it"),  # the head's
    (1, False, 0, "has gone; stopping this node"),  # the head went first: it says why, this node just stops
])
def test_a_ray_node_that_ends_by_itself_fails_its_task(monkeypatch, capsys, index, head_there, status, said):
    """`ray_slurm node` (one per allocated node, one srun step): a Ray node that ends on its own fails its
    task (status 7 here; srun then ends the step and the script stops the driver); a worker whose head has
    gone stops cleanly. Real child processes stand in for `ray start --block`."""
    import subprocess
    import sys

    from hpcrlhf.hpc import ray_slurm

    import socket

    alloc = Allocation(job_id=5, hosts=(socket.gethostname(),) * 2, gpus_per_node=1, cpus_per_node=2)
    monkeypatch.setenv("SLURM_NODEID", str(index))
    monkeypatch.setattr(ray_slurm, "start_node", lambda a, i: subprocess.Popen(
        [sys.executable, "-c", "import time, sys; time.sleep(0.5 if sys.argv[1] == 'die' else 30); sys.exit(7)",
         "die" if head_there else "live"], start_new_session=True))
    monkeypatch.setattr(ray_slurm, "_port_open", lambda address: head_there)
    assert ray_slurm.run_node(alloc, poll_s=0.1) == (7 if status else 0)
    assert said in capsys.readouterr().out


@pytest.mark.parametrize(("driver", "status", "said"), [
    ("import time; time.sleep(60)", 4, "the driver still runs 4 s later: stopping it"),  # waits on a gone cluster
    ("import sys, time; time.sleep(2); sys.exit(4)", 4, None),  # notices by itself, names what died
    ("import sys, time; time.sleep(2); sys.exit(1)", 4, "was lost (driver status 1, taken as 4)"),  # fails on it
])
def test_a_ray_head_that_ends_while_the_driver_runs_ends_the_driver(capsys, driver, status, said):
    """`hpcrlhf submit`'s task 0 of a Ray job watches its head node beside the driver, as the sbatch script
    watches the nodes' step: a head that ends gives the driver its grace, then stops it; the job is lost (4)."""
    task = ClusterTask(["train", "ppo", "--output-dir", "run"], "ray", 0)
    head = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(7)"])
    started = time.monotonic()
    assert task._run([sys.executable, "-c", driver], {}, head=head, grace_s=4.0) == status
    assert time.monotonic() - started < 20
    out = capsys.readouterr().out
    assert "hpcrlhf: the Ray head node ended (status 7) while the driver was running" in out, out
    assert said is None or said in out, out


def test_a_driver_that_ends_first_leaves_the_head_alone():
    task = ClusterTask(["train", "ppo", "--output-dir", "run"], "ray", 0)
    head = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert task._run([sys.executable, "-c", "import sys; sys.exit(3)"], {}, head=head, grace_s=1.0) == 3
        assert head.poll() is None
    finally:
        head.kill()
        head.wait()


class Watched:
    """A submitit job as `follow` reads it: sacct's states in turn (the last one repeats)."""

    def __init__(self, states: list[str], stdout: str = "/runs/job.out") -> None:
        self.job_id, self.states = "4242", list(states)
        self.paths = type("Paths", (), {"stdout": stdout})()
        self.watcher = self

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        assert (job_id, mode) == (self.job_id, "force")
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]


def fake_squeue(tmp_path, monkeypatch, states: list[str]) -> None:
    """`squeue` on PATH answering `states` in turn ("" -- an ended job: slurm says 'Invalid job id', status 1)."""
    (tmp_path / "answers").write_text("\n".join(states) + "\n")
    script = tmp_path / "bin" / "squeue"
    script.parent.mkdir()
    script.write_text(f"""#!/bin/sh
answer=$(head -n 1 {tmp_path}/answers); tail -n +2 {tmp_path}/answers > {tmp_path}/rest; mv {tmp_path}/rest {tmp_path}/answers
[ -n "$answer" ] || {{ echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; }}
echo "$answer"
""")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}:{os.environ['PATH']}")


def test_follow_reads_the_queue_while_accounting_does_not_know_the_job(tmp_path, monkeypatch):
    """sacct lost the job (UNKNOWN) while it runs: squeue's RUNNING is shown, and sacct's COMPLETED ends it."""
    fake_squeue(tmp_path, monkeypatch, ["RUNNING", "RUNNING"])
    said = io.StringIO()
    status = follow(Watched(["UNKNOWN", "UNKNOWN", "COMPLETED"]), str(tmp_path), poll_s=0, out=said)
    assert status == 0
    assert said.getvalue().splitlines() == ["job 4242: RUNNING", "job 4242: COMPLETED"]


def test_follow_stops_with_where_to_look_when_no_one_knows_the_job(tmp_path, monkeypatch):
    """Neither sacct nor squeue knows the job (accounting lost it after it left the queue): following stops
    after unknown_for_s instead of polling forever."""
    fake_squeue(tmp_path, monkeypatch, ["PENDING"] + [""] * 1000)
    started, said = time.monotonic(), io.StringIO()
    status = follow(Watched(["UNKNOWN"]), str(tmp_path), poll_s=0.01, unknown_for_s=0.5, out=said)
    assert status == 1 and time.monotonic() - started < 30
    out = said.getvalue().splitlines()
    assert out[:2] == ["job 4242: PENDING", "job 4242: UNKNOWN"], out
    assert out[2] == ("job 4242: neither Slurm's accounting (sacct) nor its queue (squeue) has known it for 0 s; "
                      f"stopped following. Its log: /runs/job.out; its metrics: {tmp_path}/metrics.jsonl"), out


def test_the_queue_state_of_a_job_slurm_does_not_hold_is_none(slurm_cluster):
    assert queue_state("987654") is None  # the real squeue: 'Invalid job id specified', status 1
