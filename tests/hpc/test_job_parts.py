"""The pieces of a cluster job that need no cluster: the allocation read from Slurm's variables,
the submitit task's requeue bookkeeping, and the follower's metrics line."""

from __future__ import annotations

import json
import pickle

import pytest

from hpcrlhf.errors import ConfigError
from hpcrlhf.hpc.allocation import Allocation
from hpcrlhf.hpc.submit import ClusterTask, latest_metrics


def test_allocation_from_slurm_variables():
    env = {"SLURM_JOB_ID": "417", "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_ON_NODE": "96",
           "SLURM_TASKS_PER_NODE": "1(x4)", "SLURM_RESTART_COUNT": "2"}
    a = Allocation.from_env(env, hostnames=["gpu07", "gpu08", "gpu11", "gpu12"])
    assert (a.job_id, a.nodes, a.gpus_per_node, a.cpus_per_node, a.tasks_per_node, a.restart_count) == (417, 4, 8, 96, 1, 2)
    assert a.hosts[0] == "gpu07" and a.shape() == "4 node(s) x 8 GPU(s)"
    # without SLURM_GPUS_ON_NODE the visible devices count
    b = Allocation.from_env({"SLURM_JOB_ID": "1", "CUDA_VISIBLE_DEVICES": "0,1,2"}, hostnames=["n1"])
    assert b.gpus_per_node == 3


def test_outside_a_job_the_allocation_says_so():
    with pytest.raises(ConfigError, match="SLURM_JOB_ID"):
        Allocation.from_env({}, hostnames=["n1"])


def test_checkpoint_requeues_the_same_task_until_the_limit():
    pytest.importorskip("submitit")
    task = ClusterTask(["train", "sft", "--output-dir", "/r"], "mpi", max_requeues=2)
    again = task.checkpoint()
    assert again.function.requeues == 1 and again.function.argv == task.argv
    last = again.function.checkpoint().function
    assert last.requeues == 2 and last.checkpoint() is None  # --max-requeues reached: not requeued
    assert pickle.loads(pickle.dumps(last)).requeues == 2  # submitit pickles it (without its child process)


def test_latest_metrics_line(tmp_path):
    assert latest_metrics(tmp_path) is None
    rows = [{"step": 1, "train/loss": 2.0}, {"step": 2, "train/loss": 1.23456, "rollout/score": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "tra')
    assert latest_metrics(tmp_path) == "step 2: train/loss=1.235 rollout/score=0.5"
