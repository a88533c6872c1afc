"""PPO on the two-node local Ray cluster, every role on its own Ray workers as the node map says.

Two runs from the same half-trained policy and seed (module fixture, ~4 min each):
`ppo-tiny-ray` spreads the roles over both nodes (actor + reference on GPU 0 of each node, the
critic on GPU 1, two vLLM engines of TP 2 on GPUs 2-3); `ppo-tiny-ray-colocated` puts every role
and one TP-2 engine on the same two GPUs of one node. Both have 2 ranks per role.
"""

from __future__ import annotations

import json

import pytest

from hpcrlhf.metrics import read_metrics
from tests.launch_helpers import run_cli

STEPS = 60
RUN = ["--set", "log.tensorboard=false", "--set", "eval.every_steps=0", "--set", "log.every_steps=1",
       "--set", "task.eval_size=512", "--set", "eval.score_prompts=512", "--set", "rollout.prompts_per_step=32",
       "--set", "rollout.samples_per_prompt=4", "--set", "train.global_batch_size=64", "--set", f"train.max_steps={STEPS}"]
SEPARATED, COLOCATED = "ppo-tiny-ray", "ppo-tiny-ray-colocated"
PHASES = ("timing/generate", "timing/reward", "timing/make_experience", "timing/train_actor", "timing/train_critic",
          "timing/weight_sync", "timing/step", "throughput/samples_per_sec", "throughput/tokens_per_sec")


@pytest.fixture(scope="module")
def runs(ray_cluster, policy_model, tmp_path_factory) -> dict:
    out = {}
    for recipe in (SEPARATED, COLOCATED):
        folder = tmp_path_factory.mktemp(recipe) / "run"
        run_cli(["train", "ppo", "--config", recipe, "-o", str(folder), "--set", f"model.path={policy_model}", *RUN],
                env={"RAY_ADDRESS": ray_cluster.address}, timeout=1200)
        out[recipe] = folder
    return out


def summary(folder) -> dict:
    return json.loads((folder / "summary.json").read_text())


def train_rows(folder) -> list[dict]:
    return [m for m in read_metrics(folder) if "rollout/score" in m]


@pytest.mark.slow
def test_ppo_on_ray_learns_the_task_like_single_machine_ppo(runs):
    """The bar of tests/trainers/test_ppo_e2e.py's single-machine gae run, on the spread layout."""
    s = summary(runs[SEPARATED])
    before, after = s["before"]["eval/task_score"], s["after"]["eval/task_score"]
    assert 0.3 < before < 0.7, s
    assert after > before + 0.05, s
    rows = train_rows(runs[SEPARATED])
    assert len(rows) == STEPS
    assert all(key in rows[-1] for key in PHASES), sorted(rows[-1])
    assert rows[-1]["train/value_loss"] < rows[0]["train/value_loss"]  # the critic learns the returns
    # the engines' log-probs (TP 2, weights synced from the actor) are the actor's own
    assert max(r["rollout/logprob_max_diff"] for r in rows) < 1e-4


@pytest.mark.slow
def test_every_worker_runs_where_the_plan_puts_it(runs, ray_cluster, policy_model):
    """Placement read back from the workers (node address, visible GPUs) == `hpcrlhf plan --json`."""
    plan = json.loads(run_cli(["plan", SEPARATED, "--json", "--set", f"model.path={policy_model}"]).stdout)
    ips = ray_cluster.node_ips
    expected = {(role, rank): (ips[d["node"]], str(d["gpu"]))
                for role, r in plan["roles"].items() for rank, d in enumerate(r["ranks"])}
    for i, engine in enumerate(plan["vllm"]["engines"]):
        (node,) = {d["node"] for d in engine["devices"]}
        expected[("vllm", i)] = (ips[node], ",".join(str(d["gpu"]) for d in engine["devices"]))
    workers = json.loads((runs[SEPARATED] / "placement.json").read_text())["workers"]
    found = {(w["role"], w["rank"]): (w["node_ip"], w["visible_devices"]) for w in workers}
    assert found == expected
    assert {ip for ip, _ in found.values()} == set(ips)  # both nodes hold ranks of every role
    assert len({w["pid"] for w in workers}) == len(workers)  # one process per rank and engine


@pytest.mark.slow
def test_colocated_and_separated_layouts_learn_alike(runs):
    sep, col = train_rows(runs[SEPARATED]), train_rows(runs[COLOCATED])
    assert len(sep) == len(col) == STEPS
    # same prompts, same per-prompt sampling seeds (whatever the engine count), same ranks per role
    for key, tol in (("rollout/score", 0.05), ("rollout/kl", 0.02), ("train/value_loss", 0.02)):
        diffs = [abs(a[key] - b[key]) for a, b in zip(sep, col)]
        assert sum(diffs) / STEPS < tol, (key, diffs)
    a, b = summary(runs[SEPARATED])["after"], summary(runs[COLOCATED])["after"]
    assert abs(a["eval/task_score"] - b["eval/task_score"]) < 0.04, (a, b)
