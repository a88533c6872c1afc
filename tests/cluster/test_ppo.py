"""PPO on Ray, every role on its own Ray workers as the node map says.

Two runs of 15 steps from the same half-trained policy and seed (module fixture): `ppo-tiny-ray-colocated`
(the reference) puts every role and one TP-2 engine on the same two GPUs of one node of
the local Ray cluster; `ppo-tiny-ray` spreads the roles over two nodes (actor + reference on GPU 0
of each node, the critic on GPU 1, two vLLM engines of TP 2 on GPUs 2-3) and is submitted with
`hpcrlhf submit` to the local two-node Slurm cluster, where it is stopped by the time-limit signal,
requeued after step 9 and resumed. Both have 2 ranks per role, so they sample and learn alike. A third run, the
separated layout's first steps inside hpcrlhf's CPU Apptainer image (started by the script
`hpcrlhf sbatch --container` renders), samples exactly like the colocated run.

Both learning runs start reward servers of their own (`reward.sources[i].servers`): the separated run
serves the task rule from two servers on CPU cores (one per node) and a reward model (weight 0: it is
scored and logged, and changes nothing) from a server on the critic's GPU of node 0, new ones with a
new token after the requeue; the colocated run scores the rule in the job and serves the same reward
model. So the equal steps of the two runs also show a served rule scoring as the rule in the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hpcrlhf.cluster.reservation import WORKER_SETUP
from hpcrlhf.run.metrics import read_metrics
from hpcrlhf.trainers.loop import CHECKPOINTABLE
from tests.cluster.stores import assert_stores_sealed_in_the_block, survey
from tests.hpc.slurm_jobs import TRACKED, attempts, render, slurm_log, wait_for_step
from tests.budget import long_only
from tests.launch_helpers import ROOT, cli_command, cli_env, rewind_to, run_cli
from tests.slurm_cluster import node_address
from tests.test_rewards import _make_rm
from tests.trainers.faults import WORKER_HANG

STEPS = 15
"""Steps of the learning runs: from the half-trained policy (0.53 held out) the colocated run reached 0.74 in
30 steps, the separated one 0.76 in 60 (2026-11-26; the bar is +0.05); single-machine gae, synchronous and one
step stale, held 0.70-0.73 at steps 10 and 20 (tests/trainers/ppo/test_ppo_e2e.py): the gain is made by step 10
(15 steps since 2026-11-28, for CI's minutes; 20 before)."""
REQUEUED_AFTER = 9
"""The submitted run gets the time-limit signal after this step: 6 steps run after the resume."""
REFERENCE_STEPS = STEPS  # the colocated run: the reference for steps before and after the requeue (REQUEUED_AFTER)
AHEAD_KEPT_AT = 10
"""The stale run checkpoints here: the rollout it generated ahead (step 11's) is kept in the checkpoint."""
RUN = ["--set", "log.backends=[]", "--set", "eval.every_steps=0", "--set", "log.every_steps=1",
       "--set", "task.eval_size=512", "--set", "eval.score_prompts=512", "--set", "rollout.prompts_per_step=32",
       "--set", "rollout.samples_per_prompt=4", "--set", "train.global_batch_size=64", "--set", f"train.max_steps={STEPS}"]
SEPARATED, COLOCATED = "ppo-tiny-ray", "ppo-tiny-ray-colocated"
SERVED_COLOCATE = {SEPARATED: "[[actor, ref], [critic, reward_server]]",
                   COLOCATED: "[[actor, critic, ref, vllm, reward_server]]"}
PHASES = ("timing/generate", "timing/reward", "timing/make_experience", "timing/train_actor", "timing/train_critic",
          "timing/weight_sync", "timing/step", "throughput/samples_per_sec", "throughput/tokens_per_sec")


@pytest.fixture(scope="module")
def runs(ray_cluster, policy_model, tmp_path_factory, request) -> dict:
    """The colocated run on the local Ray cluster; the separated run submitted with `hpcrlhf submit`
    to the local Slurm cluster (2 nodes x 4 GPUs) and interrupted by the time-limit signal after
    step 9 (REQUEUED_AFTER) -- or, where Slurm cannot run (no root, outside CI), straight through on the local Ray
    cluster."""
    rm = _make_rm(policy_model, tmp_path_factory.mktemp("rm") / "rm", seed=5, mean=0.1, std=2.0)
    out: dict = {"rm": rm}
    folder = tmp_path_factory.mktemp(COLOCATED) / "run"
    run_cli(["train", "ppo", "--config", COLOCATED, "-o", str(folder), *served(COLOCATED, policy_model, rm),
             "--set", f"train.max_steps={REFERENCE_STEPS}"], env={"RAY_ADDRESS": ray_cluster.address}, timeout=1200)
    out[COLOCATED] = folder
    args = served(SEPARATED, policy_model, rm) + TRACKED  # the Ray driver logs to MLflow and W&B too
    folder = tmp_path_factory.mktemp(SEPARATED) / "run"
    out[SEPARATED] = folder
    try:
        slurm = request.getfixturevalue("slurm_cluster")
    except pytest.skip.Exception:
        run_cli(["train", "ppo", "--config", SEPARATED, "-o", str(folder), *args],
                env={"RAY_ADDRESS": ray_cluster.address}, timeout=1200)
        out["node_ips"] = ray_cluster.node_ips
        return out
    out["node_ips"] = [node_address(1), node_address(2)]
    out["submit"] = submit_interrupted(slurm, folder, args)
    return out


def served(recipe: str, policy_model: str, rm: str) -> list[str]:
    """The learning runs' settings: the task rule served by two servers (separated) or scored in the job
    (colocated), the reward model at weight 0 served in both; the critic from the policy, as without."""
    rule = "{rule: task, servers: 2}" if recipe == SEPARATED else "{rule: task}"
    return ["--set", f"model.path={policy_model}", *RUN, "--set", f"critic.path={policy_model}",
            "--set", f"reward.sources=[{rule}, {{model: {rm}, servers: 1, weight: 0.0}}]",
            "--set", f"placement.colocate={SERVED_COLOCATE[recipe]}"]


def submit_interrupted(slurm, folder, args) -> dict:
    """`hpcrlhf submit` (following the job), the time-limit signal submitit asks Slurm for sent
    after step REQUEUED_AFTER, and the requeued job let start at once. Returns the follower's output and status."""
    console = folder.parent / "submit.out"
    cmd = cli_command(["submit", SEPARATED, "-o", str(folder), "--time", "30", "--poll-s", "2", *args])
    with open(console, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(SLURM_CONF=str(slurm.conf)), stdout=sink,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"submitted job (\d+)", console.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, console.read_text()
            time.sleep(0.5)
        job = int(m.group(1))
        while logged_steps(folder) < REQUEUED_AFTER:
            assert proc.poll() is None, console.read_text()
            time.sleep(1)
        slurm.run("scancel", "--signal=USR2", str(job))  # what --signal=USR2@lead delivers at the time limit
        slurm.start_now(job)
        status = proc.wait(timeout=1500)
    finally:
        proc.kill()
    return {"job": job, "status": status, "console": console.read_text(),
            "log": "".join((folder / "submitit" / f"{job}_0_log.{kind}").read_text() for kind in ("out", "err"))}


def summary(folder) -> dict:
    return json.loads((folder / "summary.json").read_text())


def train_rows(folder) -> list[dict]:
    return [m for m in read_metrics(folder) if "rollout/score" in m]


def logged_steps(folder) -> int:
    """Training steps a running job has logged so far (0 before its metrics file exists)."""
    return len(train_rows(folder)) if (folder / "metrics.jsonl").exists() else 0


@pytest.mark.slow
def test_ppo_on_ray_learns_the_task_like_single_machine_ppo(runs):
    """The bar of tests/trainers/ppo/test_ppo_e2e.py's single-machine gae run, on the spread layout."""
    s = summary(runs[SEPARATED])
    before, after = s["before"]["eval/task_score"], s["after"]["eval/task_score"]
    assert 0.3 < before < 0.7, s
    assert after > before + 0.05, s
    rows = train_rows(runs[SEPARATED])
    assert len(rows) == STEPS
    assert all(key in rows[-1] for key in PHASES), sorted(rows[-1])
    # each role's busy time (its workers' own clocks) fits in the step, and so its idle share is a share
    for role in ("actor", "critic", "ref", "vllm"):
        for r in rows:
            assert 0 < r[f"timing/busy_{role}"] <= r["timing/step"] and 0 <= r[f"util/{role}_idle"] < 1, (role, r)
            assert r[f"util/{role}_idle"] == pytest.approx(1 - r[f"timing/busy_{role}"] / r["timing/step"])
    # the engines work while generating and loading weights, and only then
    assert all(r["timing/busy_vllm"] >= r["timing/generate"] * 0.5 for r in rows)
    assert rows[-1]["train/value_loss"] < rows[0]["train/value_loss"]  # the critic learns the returns
    # the engines' log-probs (TP 2, weights synced from the actor) are the actor's own
    assert max(r["rollout/logprob_max_diff"] for r in rows) < 1e-4


@pytest.mark.slow
def test_one_step_stale_ray_ppo_generates_the_next_rollout_while_it_trains_and_learns_alike(ray_cluster, policy_model,
                                                                                          runs, tmp_path):
    """rollout.max_staleness 1 on the spread layout: while the roles score and train on step n, the
    engines (on their own GPUs) already generate step n+1's rollout with the weights step n started
    from; the first step is the synchronous run's own, and its steps learn as the synchronous run's
    did from the same model (by hand, 2026-11-26: 0.53 -> 0.76 stale in 60 steps; single-machine gae one
    step stale 0.53 -> 0.68 in 30; the synchronous run's bar is +0.05)."""
    folder = tmp_path / "run"
    run_cli(["train", "ppo", "--config", SEPARATED, "-o", str(folder), "--set", f"model.path={policy_model}", *RUN,
             "--set", "rollout.max_staleness=1", "--set", f"checkpoint.every_steps={AHEAD_KEPT_AT}"],
            env={"RAY_ADDRESS": ray_cluster.address}, timeout=1200)
    rows, sync = train_rows(folder), train_rows(runs[SEPARATED])
    assert [r["rollout/staleness"] for r in rows] == [0] + [1] * (STEPS - 1)
    assert rows[0]["rollout/score"] == pytest.approx(sync[0]["rollout/score"], abs=1e-6)
    assert rows[0]["rollout/logprob_max_diff"] < 1e-4 < min(r["rollout/logprob_max_diff"] for r in rows[1:])
    assert all(r["timing/overlap"] > 0 for r in rows[:-1]) and rows[-1]["timing/overlap"] == 0, rows
    s, s_sync = summary(folder), summary(runs[SEPARATED])
    assert s["status"] == "done"
    before, after = s["before"]["eval/task_score"], s["after"]["eval/task_score"]
    assert before == s_sync["before"]["eval/task_score"]  # the same model, the same held-out problems
    assert after > before + 0.05 and after > s_sync["after"]["eval/task_score"] - 0.1, (s, s_sync)
    # the driver keeps the rollout generated ahead in the checkpoint (step 11's, at step 10; none after the last)
    import torch

    (ahead,) = torch.load(folder / "checkpoints" / f"step_{AHEAD_KEPT_AT:06d}" / "ahead_rank0.pt",
                          weights_only=False)["ahead"]
    assert (ahead["step"], ahead["launched_at"]) == (AHEAD_KEPT_AT, AHEAD_KEPT_AT - 1) and len(ahead["generations"]) == 32
    assert all(len(g) == 4 for g in ahead["generations"])
    assert not (folder / "checkpoints" / f"step_{STEPS:06d}" / "ahead_rank0.pt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("resume", [False, pytest.param(True, marks=long_only(
    200, "the same run's checkpoint holding the batch under way, tests/cluster/test_engines.py's engine actor "
    "suspend/relaunch and the local partial resume in tests/trainers/ppo/test_ppo_e2e.py"))])
def test_partial_rollouts_two_steps_ahead_on_ray_generate_on_engine_loops_beside_the_step(ray_cluster, policy_model,
                                                                                          runs, tmp_path, resume):
    """rollout.partial with max_staleness 2 on the spread layout: each engine actor drives its engine on an engine
    loop -- the batches of the steps ahead share it, a sync pauses what runs and it goes on under the new weights
    (tests/cluster/test_engines.py shows a pause token by token). The first step is the synchronous run's own;
    later samples lag at most min(s, 2) updates (a batch launched after a sync may get its first token after the
    next one); a checkpoint holds both batches ahead -- ended ones whole, one still under way as far as each engine
    got (`EngineFleet.suspend`: the checkpoint does not wait for it) -- and (`resume`) a run resumed from it goes
    on (each engine continues its part, `EngineFleet.relaunch`) to the end with every sample at most min(s, 2) old."""
    import torch

    folder = tmp_path / "run"
    args = ["train", "ppo", "--config", SEPARATED, "-o", str(folder), "--set", f"model.path={policy_model}", *RUN,
            "--set", "train.max_steps=4", "--set", "rollout.max_staleness=2", "--set", "rollout.partial=true",
            "--set", "ppo.tis_cap=2", "--set", "checkpoint.every_steps=2"]
    run_cli(args, env={"RAY_ADDRESS": ray_cluster.address}, timeout=1200)
    rows, sync = train_rows(folder), train_rows(runs[SEPARATED])
    staleness = [r["rollout/staleness"] for r in rows]
    assert len(rows) == 4 and staleness[0] == 0 and max(staleness) > 1, staleness  # two ahead
    assert all(0 <= a <= min(s, 2) for s, a in enumerate(staleness)), staleness
    assert rows[0]["rollout/score"] == pytest.approx(sync[0]["rollout/score"], abs=1e-6)
    assert all(0 <= r["rollout/partial_share"] <= 1 for r in rows) and all(r["timing/overlap"] > 0 for r in rows[:-2])
    assert summary(folder)["status"] == "done"
    ahead = torch.load(folder / "checkpoints" / "step_000002" / "ahead_rank0.pt", weights_only=False)["ahead"]
    assert [a["step"] for a in ahead] == [2, 3], ahead
    for a in ahead:
        if a.get("generations") is not None:  # ended by the checkpoint
            assert len(a["generations"]) == 32 and all(len(g) == 4 for g in a["generations"])
        else:  # under way: each engine's part as far as it got, the groups already received kept
            state = a["under_way"]
            assert len(state.prompts) == 32 and sorted(state.parts) == [0, 1] and state.under_way, state
            assert all(b.count == 16 for b in state.under_way.values())
    if resume:
        rewind_to(folder, 2)
        run_cli(args, env={"RAY_ADDRESS": ray_cluster.address}, timeout=1200)
        resumed = train_rows(folder)
        assert [r["step"] for r in resumed] == [1, 2, 3, 4] and summary(folder)["status"] == "done"
        assert all(0 <= r["rollout/staleness"] <= min(s, 2) for s, r in enumerate(resumed)), resumed


@pytest.mark.slow
def test_arrival_order_on_ray_trains_every_planned_group_once_within_k(ray_cluster, policy_model, tmp_path):
    """rollout.stream_order arrival on the spread layout (2 engines x TP 2), k = 2 without partial rollouts: each
    group goes alone to the engine with the fewest under way (every engine on an engine loop; a sync drains them),
    each step trains the first 32 groups that end. No group trained more than min(s, 2) updates old; over the run
    every planned group is trained exactly once (the final checkpoint's ledger); the step-2 checkpoint waited for
    the groups under way and holds them ended."""
    import torch

    folder, steps, per_step = tmp_path / "run", 3, 32
    run_cli(["train", "ppo", "--config", SEPARATED, "-o", str(folder), "--set", f"model.path={policy_model}", *RUN,
             "--set", f"train.max_steps={steps}", "--set", "rollout.max_staleness=2", "--set", "ppo.tis_cap=2",
             "--set", "rollout.stream_order=arrival", "--set", "checkpoint.every_steps=1"],
            env={"RAY_ADDRESS": ray_cluster.address}, timeout=1200)
    rows = train_rows(folder)
    staleness = [r["rollout/staleness"] for r in rows]
    assert len(rows) == steps and staleness[0] == 0 and all(0 <= a <= min(s, 2) for s, a in enumerate(staleness))
    assert rows[0]["stream/admitted_groups"] == 3 * per_step and all("stream/dropped_groups" in r for r in rows)
    ledger = torch.load(folder / "checkpoints" / f"step_{steps:06d}" / "stream_rank0.pt", weights_only=False)["ledger"]
    assert sorted((t, i) for t, i, *_ in ledger["trained"]) == [(t, i) for t in range(steps) for i in range(per_step)]
    assert all(s - head <= 2 for *_, head, s in ledger["trained"])
    kept = torch.load(folder / "checkpoints" / "step_000002" / "stream_rank0.pt", weights_only=False)
    assert kept["groups"] and all(g["generations"] is not None and len(g["generations"]) == 4 for g in kept["groups"])
    assert summary(folder)["status"] == "done"


def placement(folder, ips, args) -> tuple[dict, dict]:
    """(where `hpcrlhf plan --json` with the run's settings `args` puts each rank, engine and reward
    server, where the workers say they ran): {(role, rank): (node address, visible GPUs)}."""
    plan = json.loads(run_cli(["plan", SEPARATED, "--json", *args]).stdout)
    expected = {(role, rank): (ips[d["node"]], str(d["gpu"]))
                for role, r in plan["roles"].items() for rank, d in enumerate(r["ranks"])}
    for i, engine in enumerate(plan["vllm"]["engines"]):
        (node,) = {d["node"] for d in engine["devices"]}
        expected[("vllm", i)] = (ips[node], ",".join(str(d["gpu"]) for d in engine["devices"]))
    for server in plan["reward_servers"]:  # on CPU cores: no GPU
        expected[("reward_server", server["server"])] = (ips[server["node"]], str(server["device"]["gpu"])
                                                         if server["device"] else "")
    workers = json.loads((folder / "placement.json").read_text())["workers"]
    assert len({w["pid"] for w in workers}) == len(workers)  # one process per rank and engine
    return expected, {(w["role"], w["rank"]): (w["node_ip"], w["visible_devices"]) for w in workers}


@pytest.mark.slow
def test_every_worker_runs_where_the_plan_puts_it(runs, policy_model):
    """Placement read back from the workers (node address, visible GPUs) == `hpcrlhf plan --json`:
    on the Slurm nodes n1, n2 when the run was submitted there."""
    expected, found = placement(runs[SEPARATED], runs["node_ips"], served(SEPARATED, policy_model, runs["rm"]))
    assert found == expected
    assert {ip for ip, _ in found.values()} == set(runs["node_ips"])  # both nodes hold ranks of every role
    servers = {rank: where for (role, rank), where in found.items() if role == "reward_server"}
    assert servers == {0: (runs["node_ips"][0], ""), 1: (runs["node_ips"][1], ""), 2: (runs["node_ips"][0], "1")}


@pytest.mark.slow
def test_colocated_and_separated_layouts_learn_alike(runs):
    sep, col = train_rows(runs[SEPARATED]), train_rows(runs[COLOCATED])
    assert len(sep) == STEPS and len(col) == REFERENCE_STEPS
    # same prompts, same per-prompt sampling seeds (whatever the engine count), same ranks per role
    for key, tol in (("rollout/score", 0.05), ("rollout/kl", 0.02), ("train/value_loss", 0.02)):
        diffs = [abs(a[key] - b[key]) for a, b in zip(sep, col)]
        assert sum(diffs) / REFERENCE_STEPS < tol, (key, diffs)


@pytest.mark.slow
def test_submitted_job_requeued_at_its_time_limit_resumes_without_losing_a_sample(runs):
    """`hpcrlhf submit`: the job checkpointed on the signal, was requeued, resumed from the checkpoint,
    and every step 1..15 ran exactly once; every step (6 of them after the resume) drew the samples
    an uninterrupted run drew (the colocated run: same ranks per role, same per-prompt seeds)."""
    if "submit" not in runs:
        pytest.skip("the separated run was not submitted to Slurm (no local Slurm cluster here)")
    sub = runs["submit"]
    assert sub["status"] == 0, sub["console"][-3000:]
    assert f"submitted job {sub['job']}" in sub["console"] and f"job {sub['job']}: COMPLETED" in sub["console"]
    assert re.search(r"  step \d+: ", sub["console"])  # the follower showed metrics lines
    assert "checkpointed; requeueing (requeue 1 of at most 3)" in sub["log"] and "(attempt 2)" in sub["log"]
    sep, col = train_rows(runs[SEPARATED]), train_rows(runs[COLOCATED])
    assert [r["step"] for r in sep] == list(range(1, STEPS + 1))
    assert [r["rollout/score"] for r in sep[:REFERENCE_STEPS]] == pytest.approx([r["rollout/score"] for r in col],
                                                                                abs=1e-6)
    assert [r["train/value_loss"] for r in sep[:REFERENCE_STEPS]] == pytest.approx(
        [r["train/value_loss"] for r in col], abs=1e-6)


def test_the_ray_driver_continues_one_tracked_run_across_the_requeue(runs):
    """The separated run's MLflow run holds every number of its metrics.jsonl once; W&B wrote one offline
    fragment per attempt, one run id."""
    from tests.run.test_trackers import mlflow_history, wandb_rows

    folder = runs[SEPARATED]
    ledger = json.loads((folder / "trackers.json").read_text())
    logged = mlflow_history(folder, ledger)
    records = read_metrics(folder)
    for key in ("rollout/score", "train/value_loss", "timing/step"):
        assert logged[key] == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records if key in r], key
    fragments = wandb_rows(folder, ledger["wandb"]["id"])
    assert len(fragments) == (2 if "submit" in runs else 1)
    steps = [row["_step"] for fragment in fragments for row in fragment]
    assert steps == sorted({r["step"] for r in records}), steps


@pytest.mark.slow
def test_the_jobs_reward_servers_score_as_the_job_does_and_their_token_stays_in_its_file(runs):
    """The served task rule (two servers, new ones after the requeue) scored every step as the rule in
    the colocated job; the served reward model gave both runs the same values; each start wrote a new
    token to its 0600 file, in no other file of the run nor in the job's logs."""
    sep, col = train_rows(runs[SEPARATED]), train_rows(runs[COLOCATED])
    assert [r["reward/rule_task"] for r in sep] == pytest.approx([r["reward/rule_task"] for r in col], abs=1e-6)
    rm = [r["reward/model1_rm"] for r in sep]
    assert rm == pytest.approx([r["reward/model1_rm"] for r in col], abs=1e-5) and len(set(rm)) > 1
    assert all(r["timing/busy_reward_server"] > 0 for r in sep)
    # the prompts' groups scored as the engines finished them (reward.overlap): some scoring went on while
    # the engines still generated, and the step waited for the rest only
    assert all(r["timing/reward_overlap"] >= 0 and r["timing/reward"] >= 0 for r in sep)
    assert sum(r["timing/reward_overlap"] for r in sep) > 0, [r["timing/reward_overlap"] for r in sep]
    token_file = runs[SEPARATED] / "reward_servers" / "token"
    assert oct(token_file.stat().st_mode & 0o777) == "0o600"
    token = token_file.read_text().strip()
    files = [p for p in runs[SEPARATED].rglob("*") if p.is_file() and p != token_file]
    assert files and not [p for p in files if token.encode() in p.read_bytes()]
    if "submit" in runs:
        sub = runs["submit"]
        assert token not in sub["console"] and token not in sub["log"]
        assert sub["log"].count("reward servers healthy: ") == 2  # one start per attempt
        assert "reward server 2 (model1_rm, node 0 gpu 1) on http://" in sub["log"]


IMAGE_STEPS = 20
"""Steps of the run inside the image: its first STEPS are compared with the colocated run's."""
FAILED_AFTER_STEP = 4  # node n2 fails then; the run checkpoints every 3 steps: it resumes from step 3
SURVEYED_AT_STEP = 8
"""What the second attempt's processes listen on is surveyed after this step: with the steps left for the
survey (a few seconds) to finish before the job ends."""


@pytest.fixture(scope="module")
def ppo_in_image(slurm_cluster, in_image, policy_model, tmp_path_factory):
    """The separated layout's first steps inside hpcrlhf's CPU image: the script `hpcrlhf sbatch
    --container` renders (Ray head and workers, vLLM engines and every role inside the image).
    After step 4 node n2 fails (every process on it, slurmd included, killed at once) and reboots:
    the run must end (exit 4), the script requeue the job, and the job resume from step 3. After step 8
    what the job's processes listen on is surveyed (its stores, for issue 36)."""
    run = tmp_path_factory.mktemp("ppo-in-image") / "run"
    script = render(run, SEPARATED, *in_image, "--set", f"model.path={policy_model}", *RUN,
                    "--set", f"train.max_steps={IMAGE_STEPS}", "--set", "checkpoint.every_steps=3")
    job = slurm_cluster.sbatch(script)
    try:
        wait_for_step(run, FAILED_AFTER_STEP)
        killed = slurm_cluster.fail_node("n2")
        failed = time.monotonic()
        while "requeueing job" not in slurm_log(run, job):
            assert time.monotonic() - failed < 300, slurm_log(run, job)[-4000:]
            time.sleep(0.5)
        requeued_s = time.monotonic() - failed
        slurm_cluster.boot_node("n2")  # the node reboots; the requeued job waits for it (this cluster has 2 nodes)
        slurm_cluster.start_now(job, timeout=180)
        wait_for_step(run, SURVEYED_AT_STEP)  # the second attempt's (the first ended before step 6)
        started = time.monotonic()
        listeners = survey([pid for node in slurm_cluster.nodes for pid in slurm_cluster.node_processes(node)])
        surveyed = {"listeners": listeners, "survey_s": time.monotonic() - started, "steps_then": logged_steps(run)}
        return run, slurm_cluster.wait(job, 900), job, {"killed": killed, "requeued_s": requeued_s, **surveyed}
    except BaseException:
        slurm_cluster.run("scancel", str(job))  # not left running beside the next tests
        raise


@pytest.mark.slow
def test_ray_ppo_inside_the_image_places_and_samples_like_the_host_run(ppo_in_image, runs, cpu_image, policy_model):
    run, state, job, _ = ppo_in_image
    log = slurm_log(run, job)
    assert state == "COMPLETED", log[-4000:]
    assert all(a["container"] == cpu_image and a["python"] == "/opt/venv/bin/python" for a in attempts(run))
    ips = [node_address(1), node_address(2)]
    expected, found = placement(run, ips, ["--set", f"model.path={policy_model}"])  # where the last attempt ran
    assert found == expected and {ip for ip, _ in found.values()} == set(ips)
    rows, host = train_rows(run), train_rows(runs[COLOCATED])
    assert [r["step"] for r in rows] == list(range(1, IMAGE_STEPS + 1)) and len(host) == STEPS
    rows = rows[:STEPS]
    # the same prompts, seeds and updates as on the host, before and after the failure: the same scores
    assert [r["rollout/score"] for r in rows] == pytest.approx([r["rollout/score"] for r in host], abs=1e-6)
    assert [r["train/value_loss"] for r in rows] == pytest.approx([r["train/value_loss"] for r in host], abs=1e-6)
    assert max(r["rollout/logprob_max_diff"] for r in rows) < 1e-4  # weight sync into the engines works


@pytest.mark.slow
def test_a_failed_node_ends_the_attempt_promptly_and_the_job_requeues_and_resumes(ppo_in_image):
    """Ray's health checks find the dead node (10-30 s), the run names it and the workers it held and
    exits 4, the script requeues the job, and the second attempt resumes from the last checkpoint."""
    run, state, job, failure = ppo_in_image
    log = slurm_log(run, job)
    assert failure["killed"] >= 5, failure  # slurmd, its step daemon, the Ray node's processes
    assert failure["requeued_s"] < 90, failure  # never a hang until the time limit
    assert (f"hpcrlhf: error: ppo on Ray: node 1 (n2, {node_address(2)}) died (Ray's health checks declared it dead) "
            "and took actor rank 1, critic rank 1, ref rank 1, vLLM engine 1 with it") in log, log[-4000:]
    assert "rerun the same command to resume from the last checkpoint (step_000003)" in log
    assert f"hpcrlhf: lost a worker or node (status 4); requeueing job {job} to resume" in log
    assert [a["slurm_restart_count"] for a in attempts(run)] == [0, 1]
    assert "resumed from" in log and "Traceback" not in log, log[-4000:]
    assert state == "COMPLETED", log[-4000:]


@pytest.mark.slow
def test_a_slurm_jobs_stores_listen_in_its_block_sealed(ppo_in_image):
    """Issue 36 on Slurm nodes (tests/cluster/stores.py): the three roles' groups and the weight-sync group
    of the job inside the image listen on its nodes' blocks, sealed."""
    surveyed = ppo_in_image[3]
    listeners = surveyed["listeners"]
    # The stores read below were read from the job's live listeners, so the survey ran while the job did
    # (`steps_then`: the steps logged once it ended; on a fast host the job can end during the survey's
    # reading, 7-10 s, after its listeners were taken -- seen 2026-11-28).
    assert len(listeners.blocks) == 2, surveyed  # one per node
    assert_stores_sealed_in_the_block(listeners, stores=4)


# -- fault injection: a worker killed mid-run ends the run promptly and clearly; the rerun resumes
KILL_CHECKPOINT_EVERY = 3


def driver_story(output: str) -> str:
    """What a failed launch's driver said: its hpcrlhf log lines about workers (restarts, deaths), then its tail."""
    said = [line for line in output.splitlines() if re.search(r"restart|died|resum|hung|error", line)]
    return "\n".join(said)[-6000:] + "\n--- tail:\n" + output[-4000:]


def run_until_killed(ray_cluster, folder, args, kills: list[tuple[int, tuple[str, int]]],
                     sig: int = signal.SIGKILL, env: dict[str, str] | None = None) -> dict:
    """Start the colocated run (with `env` added to its environment), send `sig` (SIGKILL; SIGSTOP: a worker
    that hangs alive) to the process of each victim (role, rank) once its step is logged, and wait for the
    driver to end. Returns its exit status, output, the killed pids and seconds from the last kill to the
    driver's exit."""
    placed = folder / "placement.json"
    placed.unlink(missing_ok=True)  # an earlier launch's: its workers (and pids) are gone
    said = folder.parent / f"launch-{len(list(folder.parent.glob('launch-*.log'))) + 1}.log"  # kept for a post-mortem
    with said.open("w") as sink:
        proc = subprocess.Popen(cli_command(["train", "ppo", "--config", COLOCATED, "-o", str(folder), *args]),
                                cwd=ROOT, env=cli_env(RAY_ADDRESS=ray_cluster.address, **(env or {})), stdout=sink,
                                stderr=subprocess.STDOUT)

    def output() -> str:
        proc.wait(timeout=300)
        return said.read_text()

    try:
        deadline, pids = time.monotonic() + 600, []
        for after_step, victim in kills:
            while not (placed.exists() and logged_steps(folder) >= after_step  # this launch's workers and steps
                       and (folder / "metrics.jsonl").stat().st_mtime > placed.stat().st_mtime):
                assert proc.poll() is None and time.monotonic() < deadline, driver_story(output())
                time.sleep(0.5)
            workers = json.loads(placed.read_text())["workers"]
            pids.append(next(w["pid"] for w in workers if (w["role"], w["rank"]) == victim))
            try:
                os.kill(pids[-1], sig)
            except ProcessLookupError:
                proc.kill()
                raise AssertionError(f"{victim} (pid {pids[-1]}) is gone before step {after_step}'s kill:\n"
                                     + driver_story(output())) from None
        killed = time.monotonic()
        text = output()
        return {"status": proc.returncode, "output": text, "exit_s": time.monotonic() - killed, "pid": pids[-1] if pids else None,
                "pids": pids}
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def killed_runs(ray_cluster, policy_model, tmp_path_factory) -> dict:
    """One colocated run (checkpoints every 3 steps) killed twice: its vLLM engine after step 4 (no
    restarts allowed), then, resumed from step 3 with one engine restart allowed, the engine again
    after step 5 (restarted in the job) and rank 1 of the critic after step 7."""
    folder = tmp_path_factory.mktemp("ppo-killed") / "run"
    args = ["--set", f"model.path={policy_model}", *RUN, "--set", "train.max_steps=10",
            "--set", f"checkpoint.every_steps={KILL_CHECKPOINT_EVERY}"]
    engine = run_until_killed(ray_cluster, folder, args, [(4, ("vllm", 0))])
    critic = run_until_killed(ray_cluster, folder, [*args, "--set", "placement.vllm.max_restarts=1"],
                              [(5, ("vllm", 0)), (7, ("critic", 1))])
    hung = run_until_killed(ray_cluster, folder, [*args, *HANG_WATCH], [(HUNG_AFTER, ("vllm", 0))], sig=signal.SIGSTOP)
    for pid in hung["pids"]:  # a stopped process the run did not end
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return {"folder": folder, "engine": engine, "critic": critic, "hung": hung}


HANG_WATCH = ["--set", "watchdog.floor_s=20", "--set", "watchdog.factor=3", "--set", "watchdog.first_s=600",
              "--set", "watchdog.grace_s=60"]
"""The third launch's deadlines: a generation may take 3 x its median + 20 s (its first ones: 600 s)."""
HUNG_AFTER = 8
"""The third launch (resumed from step 6) stops its engine once step 8 is logged: step 9 (or 10) hangs."""


@pytest.mark.slow
def test_an_engine_that_stops_answering_ends_the_run_with_4_naming_it(killed_runs):
    """A vLLM engine that hangs alive (SIGSTOP once step 8 is logged): the driver's wait for it -- the next
    step's generation, its weight sync, or another call of the step (where the stop lands: all seen) -- passes its watchdog deadline (a few x its
    recent median + floor), names the engine, writes the stacks and exits 4 within the deadline, instead of
    waiting for it forever; a hung generation keeps the steps done in a checkpoint (nothing of its step was
    applied), a hung weight sync may have applied part of its step: the run resumes from the last periodic one."""
    hung = killed_runs["hung"]
    out = hung["output"]
    assert hung["status"] == 4, out[-4000:]
    assert hung["exit_s"] < 20 + 3 * 30 + 60, hung  # floor + factor x a generous median + grace: never forever
    found = [m for x in out.splitlines() if (m := re.match(r"hpcrlhf: error: step (\d+) hung: (\w+) did not finish", x))]
    assert found, out[-4000:]
    line, step, phase = found[0].string, int(found[0][1]), found[0][2]
    assert step in (HUNG_AFTER + 1, HUNG_AFTER + 2), line  # the first step that needs the engine after the stop
    waiting = line.split("; still waiting for ")[1].split("; stacks: ")[0]
    assert "vLLM engine 0 (node 0 GPU 0, node 0 GPU 1)" in waiting, line
    assert list((killed_runs["folder"] / "watchdog").glob("hang-*.txt")), line  # the driver's stacks
    # the engine's own, read on its node: a stopped process writes none, and its file says so
    stacks = re.search(rf"stacks of vLLM engine 0 \(node 0 GPU 0, node 0 GPU 1\), process {hung['pid']} on [\d.]+: (\S+)", out)
    assert stacks and f"(process {hung['pid']} wrote no stacks within" in Path(stacks[1]).read_text(), out[-4000:]
    every = KILL_CHECKPOINT_EVERY  # a phase that applies nothing of its step keeps the steps done, else the periodic one
    resumes_from = step - 1 if phase in CHECKPOINTABLE else (step - 1) // every * every
    assert line.endswith(f"rerun the same command to resume from its checkpoint step_{resumes_from:06d}"), line
    assert "Traceback" not in out, out[-4000:]


WORKER_HANGS = {"critic": "critic:1:update:3", "engine": "vllm:0:receive_weights:3"}
"""The hangs of `hung_workers`' two launches (HPCRLHF_WORKER_HANG: role, rank, method, call)."""
HUNG_EVERY = 2
"""`hung_workers`' checkpoints: every 2 steps."""


@pytest.fixture(scope="module")
def hung_workers(ray_cluster, policy_model, tmp_path_factory) -> dict:
    """One colocated run whose Ray workers hang by the worker setup hook (`tests.trainers.faults.hang_in_worker`),
    nothing signalled from outside: critic rank 1's learner never returns from its third update (step 3); then,
    resumed, vLLM engine 0 never takes its third weight broadcast (a receiver that never joins the sync). Its
    rollouts are generated two steps ahead (rollout.max_staleness 2: two batches queued on the engine at once,
    both kept in the checkpoint)."""
    folder = tmp_path_factory.mktemp("ppo-hung-workers") / "run"
    args = ["--set", f"model.path={policy_model}", *RUN, "--set", "train.max_steps=6",
            "--set", f"checkpoint.every_steps={HUNG_EVERY}", *HANG_WATCH,
            "--set", "rollout.max_staleness=2", "--set", "ppo.tis_cap=2"]
    launches = {}
    for name, hang in WORKER_HANGS.items():
        launch = run_until_killed(ray_cluster, folder, args, [], env={WORKER_SETUP: "tests.trainers.faults:hang_in_worker",
                                                                      WORKER_HANG: hang})
        launch["workers"] = json.loads((folder / "placement.json").read_text())["workers"]
        launch["checkpoints"] = sorted(p.name for p in (folder / "checkpoints").glob("step_*"))
        launches[name] = launch
    return {"folder": folder, **launches}


def hung_line(out: str) -> tuple[str, int, str, float]:
    """The driver's watchdog line: (the line, its step, the phase that hung, its deadline in seconds)."""
    found = [m for x in out.splitlines()
             if (m := re.match(r"hpcrlhf: error: step (\d+) hung: (\w+) did not finish within ([\d.]+) s", x))]
    assert found, out[-4000:]
    return found[0].string, int(found[0][1]), found[0][2], float(found[0][3])


def stacks_of(out: str, name: str, pid: int) -> str:
    """What the driver read of worker `name`'s stacks (process `pid`) and logged the file of."""
    found = re.search(rf"stacks of {re.escape(name)}, process {pid} on [\d.]+: (\S+)", out)
    assert found, out[-4000:]
    return Path(found[1]).read_text()


@pytest.mark.slow
def test_a_role_rank_that_never_returns_from_its_update_ends_the_run_with_4_naming_it(hung_workers):
    """Critic rank 1 sleeps in its third update (its peer waits for it in the gradients' all-reduce): the
    driver's wait for the step's updates passes its deadline (3 x the median of the first two + 20 s, not the
    600 s of a first wait), names the rank, shows where it is stuck (its own stacks, read in its process) and
    exits 4 keeping no checkpoint of step 3 (the actor may have applied its update): the resume is from step 2."""
    hung = hung_workers["critic"]
    out = hung["output"]
    assert hung["status"] == 4, out[-4000:]
    line, step, phase, deadline = hung_line(out)
    assert (step, phase) == (3, "train") and deadline < 200, line
    waiting = line.split("; still waiting for ")[1].split("; stacks: ")[0]
    assert "critic rank 1 (node 0 GPU 1)" in waiting, line
    assert "no checkpoint: train may have applied part of step 3" in line, line
    assert line.endswith("rerun the same command to resume from its checkpoint step_000002"), line
    assert hung["checkpoints"] == ["step_000002"], hung["checkpoints"]
    pid = next(w["pid"] for w in hung["workers"] if (w["role"], w["rank"]) == ("critic", 1))
    stacks = stacks_of(out, "critic rank 1 (node 0 GPU 1)", pid)
    assert "hanging" in stacks and "update" in stacks, stacks  # the fault's sleep, inside the worker's update
    peer = next(w["pid"] for w in hung["workers"] if (w["role"], w["rank"]) == ("critic", 0))
    assert "all_reduce" in stacks_of(out, "critic rank 0 (node 0 GPU 0)", peer)  # its peer: waiting for it
    assert "Traceback" not in out, out[-4000:]


@pytest.mark.slow
def test_a_weight_sync_receiver_that_never_joins_the_broadcast_ends_the_run_with_4_naming_it(hung_workers):
    """Resumed from step 2, vLLM engine 0 never takes its third weight broadcast (actor rank 0 waits for it in the
    sync group): the step's weight sync passes its deadline, the engine is named with its stacks (stuck in
    receive_weights) and the sender's (in its broadcast), exit 4; the update was applied, so the resume is from
    the last periodic checkpoint."""
    hung = hung_workers["engine"]
    out = hung["output"]
    assert hung["status"] == 4, out[-4000:]
    assert "resumed from" in out and "at step 2" in out, out[-4000:]
    rows = train_rows(hung_workers["folder"])  # steps 1-2 of the first launch, 3.. of the resumed one
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 3
    assert [r["rollout/staleness"] for r in rows] == [min(s, 2) for s in range(len(rows))]  # the kept batches lag 2
    line, step, phase, deadline = hung_line(out)
    assert phase == "weight_sync" and step in (4, 5) and deadline < 200, line  # 4: the start's push is a receipt
    waiting = line.split("; still waiting for ")[1].split("; stacks: ")[0]
    assert "vLLM engine 0 (node 0 GPU 0, node 0 GPU 1)" in waiting, line
    resumes_from = (step - 1) // HUNG_EVERY * HUNG_EVERY
    assert line.endswith(f"rerun the same command to resume from its checkpoint step_{resumes_from:06d}"), line
    assert f"step_{step:06d}" not in hung["checkpoints"], hung["checkpoints"]
    pid = next(w["pid"] for w in hung["workers"] if (w["role"], w["rank"]) == ("vllm", 0))
    stacks = stacks_of(out, "vLLM engine 0 (node 0 GPU 0, node 0 GPU 1)", pid)
    assert "hanging" in stacks and "receive_weights" in stacks, stacks
    sender = next(w["pid"] for w in hung["workers"] if (w["role"], w["rank"]) == ("actor", 0))
    assert "broadcast_weights" in stacks_of(out, "actor rank 0 (node 0 GPU 0)", sender)  # the sender, waiting for it
    assert "Traceback" not in out, out[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("victim, name, resume_step", [("engine", "vLLM engine 0 (node 0 GPU 0, node 0 GPU 1)", 3),
                                                       ("critic", "critic rank 1 (node 0 GPU 1)", 6)])
def test_a_killed_worker_ends_the_run_promptly_with_who_and_how_to_resume(killed_runs, victim, name, resume_step):
    killed = killed_runs[victim]
    assert killed["status"] == 4, killed["output"][-4000:]  # EXIT_LOST: hpcrlhf's Slurm jobs requeue on it
    assert killed["exit_s"] < 60, killed  # never a hang until the collective timeout or the time limit
    assert f"hpcrlhf: error: ppo on Ray: {name} died (" in killed["output"], killed["output"][-4000:]
    assert f"pid: {killed['pid']}" in killed["output"]
    assert (f"rerun the same command to resume from the last checkpoint (step_{resume_step:06d})"
            in killed["output"]), killed["output"][-3000:]
    assert "Traceback" not in killed["output"], killed["output"][-4000:]


@pytest.mark.slow
def test_a_killed_engine_is_restarted_in_the_job_when_allowed(killed_runs):
    """With placement.vllm.max_restarts=1 the engine killed after step 5 is replaced on its GPUs and
    the run goes on (to the critic's kill after step 7); the samples are unchanged (next test)."""
    out = killed_runs["critic"]["output"]
    engine_pid = killed_runs["critic"]["pids"][0]
    assert ("vLLM engine 0 (node 0 GPU 0, node 0 GPU 1) died (" in out and f"pid: {engine_pid}" in out
            and "; restarting it on its GPUs (0 restart(s) left, placement.vllm.max_restarts)" in out), out[-4000:]
    assert re.search(r"vLLM engine 0 restarted in \d+ s; redoing its share", out), out[-4000:]


@pytest.mark.slow
def test_resumed_after_a_kill_matches_the_uninterrupted_run(killed_runs, runs):
    """Every step 1..8 logged exactly once, and each drew the samples and losses an uninterrupted run
    did (the colocated reference run: same layout, seeds and updates) -- steps 4..7 after the first resume,
    step 6 partly generated by the restarted engine, 7..8 after the second (before the engine hung)."""
    assert "resumed from" in killed_runs["critic"]["output"] and "at step 3" in killed_runs["critic"]["output"]
    rows = train_rows(killed_runs["folder"])  # to step 8 (the hung launch's last)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= HUNG_AFTER
    ref = train_rows(runs[COLOCATED])[:len(rows)]
    for key in ("rollout/score", "train/value_loss", "train/policy_loss"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in ref], abs=1e-6), key


@pytest.mark.slow
def test_zero3_actor_syncs_its_engine_alike_by_either_path(ray_cluster, policy_model, tmp_path):
    """ZeRO-3 with 2 actor ranks (parameters gathered chunk by chunk for the broadcast; buckets of
    1 MB so the 1.7 MB model goes in several) and an engine of TP 2: the collective path and the
    object-store fallback give the same steps, and the engine's log-probs are the actor's after
    every sync (a large lr, so that an engine left with stale weights could not pass). The
    fallback run also sleeps between phases (engines and actor taking turns, through their
    workers): a no-op for the memory on CPU, so its steps stay the same. GRPO without a KL term:
    the actor and the engine are the only workers (a critic and a reference cost two of each
    run's ~3 minutes of CPU starting, and take no part in the sync)."""
    args = ["--set", f"model.path={policy_model}", *RUN, "--set", "train.max_steps=3", "--set", "engine.zero_stage=3",
            "--set", "optim.lr=1e-3", "--set", "placement.vllm.sync_bucket_mb=1",
            "--set", "ppo.advantage_estimator=grpo", "--set", "ppo.init_kl_coef=0", "--set", "placement.critic.gpus_per_node=0",
            "--set", "placement.ref.gpus_per_node=0", "--set", "placement.colocate=[[actor, vllm]]"]
    rows = {}
    sleep = ["--set", "placement.vllm.sleep=true", "--set", "placement.actor.sleep=true"]
    for path in ("collective", "object_store"):
        folder = tmp_path / path
        run_cli(["train", "ppo", "--config", COLOCATED, "-o", str(folder), *args, *(sleep if path == "object_store" else []),
                 "--set", f"placement.vllm.weight_sync={path}"], env={"RAY_ADDRESS": ray_cluster.address}, timeout=900)
        rows[path] = train_rows(folder)
        assert all(("timing/swap" in r) == (path == "object_store") for r in rows[path])
        assert max(r["rollout/logprob_max_diff"] for r in rows[path]) < 1e-4, path
        assert max(abs(r["train/approx_kl"]) for r in rows[path]) > 1e-4  # the updates were not negligible
    assert all(r["weight_sync/buckets"] >= 2 and r["weight_sync/bytes"] > 1.6e6 for r in rows["collective"])
    assert all("weight_sync/bytes" not in r for r in rows["object_store"])
    assert all("train/value_loss" not in r for r in rows["collective"])  # no critic ran
    for key in ("rollout/score", "train/policy_loss", "train/entropy"):
        assert [r[key] for r in rows["collective"]] == pytest.approx([r[key] for r in rows["object_store"]], abs=1e-6)
