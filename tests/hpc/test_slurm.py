"""Jobs on the real local Slurm cluster (tests/slurm_cluster.py): the cluster itself, and jobs from
scripts rendered by `hpcrlhf sbatch` -- MPI SFT across two nodes, its requeue on the time-limit
signal, an agent PPO job's requeue, and a job too big for its allocation. (`hpcrlhf submit` of Ray PPO: tests/cluster/test_ppo.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time

import pytest

from hpcrlhf.hpc.sbatch import NODES_GONE_GRACE_S
from hpcrlhf.run.metrics import read_metrics
from tests.hpc.slurm_jobs import SFT, TRACKED, kill_task, losses, render, run_rendered, slurm_log, wait_for_step
from tests.launch_helpers import run_cli
from tests.slurm_cluster import UNDER_WAY, node_address


def test_two_nodes_with_their_own_names_addresses_and_gpus(slurm_cluster, tmp_path):
    script = tmp_path / "where.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH -N2 --gpus-per-node=2 -o {tmp_path}/where.out\n"
                      "srun -l bash -c 'echo $(hostname) $(hostname -i) $CUDA_VISIBLE_DEVICES $SLURM_NODEID'\n")
    job = slurm_cluster.sbatch(script)
    assert slurm_cluster.wait(job, 120) == "COMPLETED"
    lines = sorted((tmp_path / "where.out").read_text().split("\n"))[-2:]
    assert lines == [f"0: n1 {node_address(1)} 0,1 0", f"1: n2 {node_address(2)} 0,1 1"]


HANG_WATCH = ["--set", "watchdog.factor=3", "--set", "watchdog.floor_s=20"]
"""A step may take 3 x its median + 20 s (its first ones: watchdog.first_s)."""


@pytest.fixture(scope="module")
def sft_requeued(slurm_cluster, tmp_path_factory):
    """The rendered 2-node MPI SFT script stopped by the time-limit signal after step 20 (requeued by
    the script itself, resumed from its checkpoint), then, after step 40, its rank 1 SIGKILLed (a
    lost rank: requeued again, resumed from the same checkpoint), then, after step 45 of that attempt,
    its rank 1 SIGSTOPped (a rank that hangs alive: rank 0's watchdog ends its step's wait with 4,
    the job requeues and resumes once more)."""
    run = tmp_path_factory.mktemp("sft-requeued") / "run"
    script = render(run, "--kind", "sft", "--launcher", "mpi", "--nodes", "2", "--gpus-per-node", "1", *SFT, *TRACKED,
                    *HANG_WATCH)
    job = slurm_cluster.sbatch(script)
    wait_for_step(run, 20)
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", str(job))  # what --signal=B:USR1@lead sends
    slurm_cluster.start_now(job)
    wait_for_step(run, 40)
    kill_task(job, 1)
    slurm_cluster.start_now(job)
    wait_for_step(run, 45)  # metrics.jsonl reached 40 in the attempt before
    stopped = kill_task(job, 1, sig=signal.SIGSTOP)
    try:
        slurm_cluster.start_now(job)
        return run, slurm_cluster.wait(job, 900), job
    finally:
        for pid in stopped:  # Slurm kills a stopped task with its step; were it left, it would stay forever
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.distributed
def test_a_requeued_job_continues_one_tracked_run_and_sends_no_step_twice(sft_requeued):
    from tests.run.test_trackers import mlflow_history, wandb_rows

    run, state, job = sft_requeued
    assert state == "COMPLETED", slurm_log(run, job)[-4000:]
    ledger = json.loads((run / "trackers.json").read_text())
    logged = mlflow_history(run, ledger)  # one MLflow run across the four attempts
    want = [(m["step"], m["train/loss"]) for m in read_metrics(run) if "train/loss" in m]
    assert logged["train/loss"] == [(s, pytest.approx(v, rel=1e-5)) for s, v in want]
    fragments = wandb_rows(run, ledger["wandb"]["id"])
    assert len(fragments) == 4, list((run / "wandb").iterdir())  # one offline fragment per attempt, one id
    steps = [row["_step"] for fragment in fragments for row in fragment]
    assert steps == sorted(set(steps)) and steps[-1] == 60, steps


@pytest.mark.distributed
def test_rendered_mpi_sft_job_across_two_nodes_learns(sft_straight):
    run, state, job = sft_straight
    log = slurm_log(run, job)
    assert state == "COMPLETED", log[-4000:]
    assert "the job fits the allocation (2 node(s) x 1 GPU(s))" in log and "2 rank(s) x 16 rows" in log
    loss = losses(run)
    assert sorted(loss) == list(range(5, 61, 5)) and loss[60] < 0.5 * loss[5], loss


@pytest.mark.distributed
def test_time_limit_signal_checkpoints_requeues_and_resumes_like_an_uninterrupted_run(sft_straight, sft_requeued):
    (straight, _, _), (run, state, job) = sft_straight, sft_requeued
    log = slurm_log(run, job)
    assert state == "COMPLETED", log[-4000:]
    assert "checkpointed on request (status" in log
    assert f"requeueing job {job}" in log and log.count("the job fits the allocation") == 4  # four attempts, one log (--open-mode=append)
    rows = [m["step"] for m in read_metrics(run) if "train/loss" in m]
    assert len(rows) == len(set(rows)), "a step was logged twice: the resumed run repeated samples"
    # every logged step trains on the uninterrupted run's samples; the one logging window the stop
    # split averages only its steps after the resume (the step it checkpointed at is in the log)
    stop = int(re.search(r"checkpointed at step (\d+)", log).group(1))
    split = {-(-stop // 5) * 5} if stop % 5 else set()
    same = {k: v for k, v in losses(run).items() if k not in split}
    assert sorted(losses(run)) == sorted(losses(straight)) and len(same) >= 11
    assert same == pytest.approx({k: losses(straight)[k] for k in same}, rel=1e-5)
    final = {k: v for k, v in read_metrics(run)[-1].items() if k.startswith("eval/")}
    assert final and final == pytest.approx({k: read_metrics(straight)[-1][k] for k in final}, rel=1e-5)


@pytest.mark.distributed
def test_a_killed_rank_is_a_lost_worker_the_job_requeues_and_resumes(sft_requeued):
    """srun exits 143 whether a rank was killed or failed (it TERMinates the others): the script
    tells them apart by srun's first task line and requeues only a lost rank (the resumed steps are
    checked against the uninterrupted run above)."""
    run, state, job = sft_requeued
    log = slurm_log(run, job)
    assert state == "COMPLETED", log[-4000:]
    # 143 when srun TERMinated rank 0, 137 when rank 0 failed on its own first (gloo: "Connection closed by peer")
    assert re.search(r"hpcrlhf: n2: task 1: Killed: a rank was lost \(srun status 1(37|43), taken as 4\)", log), log[-4000:]
    assert f"hpcrlhf: lost a worker or node (status 4); requeueing job {job} to resume" in log
    assert log.count("resumed from") == 3, log[-4000:]  # this and the next test's interruption


@pytest.mark.distributed
def test_a_rank_that_hangs_alive_ends_the_attempt_by_its_peers_watchdog_and_the_job_resumes(sft_requeued):
    """Rank 1 SIGSTOPped (alive, answering nothing): rank 0 waits for it in its step's collective until its
    watchdog's deadline, exits 4 naming the hung step, the script takes the attempt as lost and requeues it,
    and the job resumes from its last checkpoint (the losses are checked against the uninterrupted run above)."""
    run, state, job = sft_requeued
    log = slurm_log(run, job)
    assert state == "COMPLETED", log[-4000:]
    hung = re.search(r"hpcrlhf: error: step (\d+) hung: (\w+) did not finish within [\d.]+ s \(watchdog: 3 x median"
                     r"[^;]*; still waiting for rank 1 \(n2, pid \d+\): no heartbeat for \d+ s", log)
    assert hung and int(hung[1]) > 45, log[-4000:]  # the peer named by its silence (heartbeats)
    # rank 0 waits inside gloo's all-reduce, where no signal reaches: it ends soon after, not grace_s later
    assert "the main thread did not take the interruption within 10 s (stuck in a collective" in log, log[-4000:]
    assert "n1: task 0: Exited with exit code 4: a rank hung or lost a worker (srun status" in log, log[-4000:]
    assert log.count("requeueing job") == 3 and log.count("the job fits the allocation") == 4, log[-4000:]


@pytest.mark.distributed
def test_an_eval_job_on_two_nodes_answers_with_the_runs_last_checkpoint(slurm_cluster, sft_straight, tmp_path):
    """`hpcrlhf sbatch --kind eval` of the two-node SFT run: one MPI rank per node, each answering its batches
    of the held-out prompts; the result is the run's own final (greedy) task score."""
    run, _, _ = sft_straight
    out, state, job = run_rendered(slurm_cluster, tmp_path / "eval", "--kind", "eval", "--launcher", "mpi", "--nodes",
                                   "2", "--gpus-per-node", "1", "--set", f"run={run}", "--set", "eval.batch_size=8")
    log = slurm_log(out, job)
    assert state == "COMPLETED", log[-4000:]
    assert "the job fits the allocation (2 node(s) x 1 GPU(s))" in log
    results = json.loads((out / "results.json").read_text())
    assert [t["name"] for t in results["targets"]] == ["step_000060"]
    assert sorted(p.name for p in (out / "samples" / "step_000060").iterdir()) == ["held_out.rank0.jsonl",
                                                                                   "held_out.rank1.jsonl"]
    after = json.loads((run / "summary.json").read_text())["after"]["eval/task_score"]
    # in-run, each rank answered 16 prompts in one batch; here batches of 8: padding may flip an answer or two
    assert results["results"]["step_000060"]["held_out"]["eval/task_score"] == pytest.approx(after, abs=2 / 32)


def rank_1_exits(slurm_cluster, tmp_path, code: int) -> str:
    """A 2-node MPI SFT job whose rank 1 exits `code` at once (injected by the Python it runs), never requeued
    (--max-requeues 0): its log once it has failed."""
    python = tmp_path / "python"
    python.write_text("#!/bin/bash\n"
                      f"if [ \"$SLURM_PROCID $2\" = \"1 hpcrlhf.hpc.mpi\" ]; then echo '(injected) rank 1 exits {code}' >&2; "
                      f"exit {code}; fi\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    run = tmp_path / "run"
    job = slurm_cluster.sbatch(render(run, "--kind", "sft", "--launcher", "mpi", "--nodes", "2", "--gpus-per-node", "1",
                                      "--python", str(python), "--max-requeues", "0", *SFT))
    state, log = slurm_cluster.wait(job, 180), slurm_log(run, job)
    assert state == "FAILED", log[-4000:]
    return log


def test_a_rank_that_fails_is_not_requeued(slurm_cluster, tmp_path):
    """The other side of the test above: rank 1 exits 1 (a bug, bad data: rerunning repeats it), srun
    also exits 143, and the job fails without a requeue."""
    log = rank_1_exits(slurm_cluster, tmp_path, 1)
    assert "srun: error: n2: task 1: Exited with exit code 1" in log, log[-4000:]
    assert "a rank was lost" not in log and "hung" not in log and "not requeued" not in log, log[-4000:]


def test_a_rank_that_exits_4_counts_as_lost(slurm_cluster, tmp_path):
    """A rank's watchdog ends a hang with exit 4 (rank 1 exits 4): the MPI script takes the job as lost (4),
    the status it requeues (not here: --max-requeues 0)."""
    log = rank_1_exits(slurm_cluster, tmp_path, 4)
    assert "n2: task 1: Exited with exit code 4: a rank hung or lost a worker (srun status" in log, log[-4000:]
    assert "hpcrlhf: not requeued: already requeued 0 time(s) (--max-requeues)" in log, log[-4000:]


def test_a_dead_ray_node_step_ends_the_job_instead_of_holding_the_allocation(slurm_cluster, tmp_path):
    """A Ray job whose nodes' step ends while its driver still runs (injected: every node's Ray exits 1 after 3 s;
    the driver waits forever, as one would on a cluster that is gone): the script gives the driver its grace, stops
    it, and the job ends as a lost node (4) about a minute later, not requeued here (--max-requeues 0)."""
    python = tmp_path / "python"
    python.write_text("#!/bin/bash\n"
                      "case \"$2 $3\" in\n"
                      "  'hpcrlhf.hpc.ray_slurm node') sleep 3; echo '(injected) this node lost its Ray processes' >&2; exit 1;;\n"
                      "  'hpcrlhf.hpc.ray_slurm driver') exec sleep 600;;\n"
                      f"esac\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    run = tmp_path / "run"
    started = time.monotonic()
    job = slurm_cluster.sbatch(render(run, "ppo-tiny-ray", "--python", str(python), "--max-requeues", "0"))
    state, log = slurm_cluster.wait(job, 180), slurm_log(run, job)
    assert state == "FAILED" and time.monotonic() - started < NODES_GONE_GRACE_S + 60, (state, log[-4000:])
    # srun's status: 1 (a node's Ray exited 1), or 143 when srun ended the other node's task first (seen under load)
    assert re.search(r"hpcrlhf: the Ray nodes' step ended \(status (1|143)\) while the driver was running", log), log
    assert f"hpcrlhf: the driver still runs {NODES_GONE_GRACE_S} s later: stopping it" in log, log
    assert "hpcrlhf: a Ray node was lost (driver status 143, taken as 4)" in log, log
    assert "hpcrlhf: not requeued: already requeued 0 time(s) (--max-requeues)" in log, log


@pytest.mark.distributed
def test_an_agent_job_stopped_by_the_time_limit_requeues_and_resumes_like_an_uninterrupted_run(slurm_cluster, tmp_path):
    """The rendered PPO job with multi-turn rollouts (the local runtime, one MPI rank, the hf backend; the
    environment's trajectories generated one update ahead): the time-limit signal after step 2 checkpoints it
    with its trajectories ahead, the script requeues it, and its steps equal those of the run never stopped (had
    the resumed run generated them again, with the weights of its checkpoint, they would differ)."""
    from tests.trainers.ppo.test_agent_e2e import assert_same_steps, train_rows, wordy_job

    args = [*wordy_job(tmp_path), "--set", "rollout.max_staleness=1", "--set", "train.max_steps=16",
            "--set", "log.progress=false"]  # 16: its steps take a fraction of a second, the signal comes a few later
    run = tmp_path / "run"
    job = slurm_cluster.sbatch(render(run, "--kind", "ppo", "--launcher", "mpi", "--nodes", "1", "--gpus-per-node", "1",
                                      *args))
    wait_for_step(run, 2)
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", str(job))  # what --signal=B:USR1@lead sends
    slurm_cluster.start_now(job)
    state, log = slurm_cluster.wait(job, 600), slurm_log(run, job)
    assert state == "COMPLETED" and f"requeueing job {job}" in log, log[-4000:]
    stop = int(re.search(r"checkpointed at step (\d+)", log).group(1))
    assert 2 <= stop < 16 and f"step_{stop:06d} at step {stop}" in log, log[-4000:]  # resumed from there
    whole = tmp_path / "whole"
    run_cli(["train", "ppo", *args, "-o", str(whole)])
    resumed = train_rows(run)
    assert [r["step"] for r in resumed] == list(range(1, 17)) and max(r["agent/turns"] for r in resumed) > 1, resumed
    assert_same_steps(train_rows(whole), resumed, "requeued")


def test_a_job_bigger_than_its_allocation_fails_before_the_driver_starts(slurm_cluster, tmp_path):
    """The script asks for 2 x 4 GPUs (what ppo-tiny-ray's node map needs); submitted with 2 GPUs per
    node instead (sbatch's command line overrides #SBATCH lines), it must stop at the fit check."""
    run = tmp_path / "run"
    script = render(run, "ppo-tiny-ray")
    job = slurm_cluster.sbatch(script, "--gpus-per-node=2")
    state = slurm_cluster.wait(job, 180)
    log = slurm_log(run, job)
    assert state == "FAILED", log
    assert f"the node map needs 2 node(s) x 4 GPU(s) (placement.nodes / placement.gpus_per_node) but the allocation " \
           f"of job {job} has 2 node(s) x 2 GPU(s)" in log
    assert "Ray head" not in log and "Ray worker" not in log and not (run / "metrics.jsonl").exists()


def test_a_submitted_job_that_lost_a_worker_requeues_itself_and_resumes(slurm_cluster, tmp_path):
    """`hpcrlhf submit`: a run that exits 4 (EXIT_LOST: a worker or node died; injected here by the
    Python the job runs, on its first attempt only) is requeued by task 0 through submitit, and the
    second attempt trains to the end."""
    python = tmp_path / "python"
    python.write_text("#!/bin/bash\n"
                      "if [ \"${SLURM_RESTART_COUNT:-0}\" = 0 ] && [ \"$1 $2\" = \"-m hpcrlhf\" ]; then\n"
                      "  echo 'hpcrlhf: error: (injected) critic rank 1 died' >&2; exit 4\n"
                      f"fi\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    run = tmp_path / "run"
    out = run_cli(["submit", "--kind", "sft", "-o", str(run), "--python", str(python), "--time", "10", "--no-follow",
                   "--set", "train.max_steps=6", "--set", "eval.every_steps=0", "--set", "log.backends=[]",
                   "--set", "log.progress=false", "--set", "task.train_size=512"],
                  env={"SLURM_CONF": str(slurm_cluster.conf)}).stdout
    job = int(re.search(r"submitted job (\d+)", out).group(1))
    log = run / "submitit" / f"{job}_0_log.out"
    deadline = time.monotonic() + 300
    while not (log.exists() and "requeueing" in log.read_text()):
        assert time.monotonic() < deadline and slurm_cluster.state(job) in UNDER_WAY, \
            log.read_text()[-3000:] if log.exists() else slurm_cluster.state(job)
        time.sleep(0.5)
    slurm_cluster.start_now(job)
    assert slurm_cluster.wait(job, 600) == "COMPLETED", log.read_text()[-3000:]
    text = log.read_text()
    assert "lost a worker or node; requeueing (requeue 1 of at most 3) to resume from the last checkpoint" in text
    assert "(attempt 2)" in text
    assert [m["step"] for m in read_metrics(run) if "train/loss" in m][-1] == 6


@pytest.mark.distributed
def test_a_submitted_job_whose_rank_was_killed_requeues_itself_and_resumes(slurm_cluster, sft_straight, tmp_path):
    """`hpcrlhf submit`, 2 tasks: rank 1's `hpcrlhf train` SIGKILLed after step 25; its task requeues
    the job (rank 0 only sees gloo's broken collective), which resumes from its last checkpoint
    (every 10 steps) and logs the uninterrupted run's losses, each step once."""
    run = tmp_path / "run"
    out = run_cli(["submit", "--kind", "sft", "-o", str(run), "--nodes", "2", "--gpus-per-node", "1", "--time", "10",
                   "--no-follow", *SFT, "--set", "checkpoint.every_steps=10"],
                  env={"SLURM_CONF": str(slurm_cluster.conf)}).stdout
    job = int(re.search(r"submitted job (\d+)", out).group(1))
    wait_for_step(run, 25)
    kill_task(job, 1, "-m", "hpcrlhf", "train")
    log = run / "submitit" / f"{job}_1_log.out"
    deadline = time.monotonic() + 120
    while "requeueing" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    slurm_cluster.start_now(job)
    assert slurm_cluster.wait(job, 600) == "COMPLETED", log.read_text()[-3000:]
    text = log.read_text()
    assert "hpcrlhf: rank 1: `hpcrlhf train` was killed (SIGKILL)" in text, text[-3000:]
    assert "lost a worker or node; requeueing (requeue 1 of at most 3)" in text and "(attempt 2)" in text
    resumed = re.search(r"resumed from \S+/step_\d+ at step (\d+)", (run / "submitit" / f"{job}_0_log.err").read_text())
    assert resumed and int(resumed.group(1)) in (20, 30, 40, 50)  # the last checkpoint before the kill
    rows = [m["step"] for m in read_metrics(run) if "train/loss" in m]
    assert len(rows) == len(set(rows)) and losses(run) == pytest.approx(losses(sft_straight[0]), rel=1e-5)
