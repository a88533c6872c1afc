"""PPO with multi-turn rollouts (the agent section, issue 39) on the Ray runtime: each engine actor
runs its part of a batch's trajectories beside its TP-2 vLLM engine (their environments in its
process), and the trainer learns from them as on the local runtime -- the engine's log-probs of the
model's tokens equal the actor's. With rollout.max_staleness 1 the engine actor runs the next step's
trajectories while the roles score and train. In arrival order each prompt's trajectories are a group of their
own on the engine with the fewest under way. That a batch split over engines is the batch one engine runs, and
that a group's trajectories stop where they run when it is dropped: tests/cluster/test_engines.py."""

from __future__ import annotations

import json

import pytest

from hpcrlhf.run.metrics import read_metrics
from tests.launch_helpers import run_cli
from tests.trainers.ppo.test_agent_e2e import short_turned

pytestmark = pytest.mark.slow


def ray_agent_run(ray_cluster, tmp_path, *extra: str) -> tuple:
    """`hpcrlhf train ppo` on Ray with the agent section (tests.agents.envs:Wordy, 2 turns), GRPO, 4 prompts x 4
    trajectories a step, on the colocated layout (the roles and the vLLM engines on both GPUs) and `extra`
    settings: (the run folder, its rows)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"count {i}", "id": f"row{i}"}) + "\n" for i in range(16)))
    model, out = short_turned("llama", None, tmp_path / "model"), tmp_path / "run"
    run_cli(["train", "ppo", "--config", "ppo-tiny-ray-colocated", "-o", str(out), "--set", f"model.path={model}",
             "--set", f"data.train_path={rows}", "--set", "data.apply_chat_template=true", "--set", "task.name=null",
             "--set", "ppo.advantage_estimator=grpo", "--set", "placement.critic.gpus_per_node=0",
             "--set", "placement.colocate=[[actor, ref, vllm]]", "--set", "rollout.prompts_per_step=4", "--set",
             "rollout.samples_per_prompt=4", "--set", "rollout.max_new_tokens=8",
             "--set", "train.global_batch_size=16", "--set", "train.micro_batch_size=8", "--set", "optim.lr=1e-4",
             "--set", "agent={environment: 'tests.agents.envs:Wordy', environment_args: {turns: 2}, max_turns: 3, "
                      "max_tokens: 48}", "--set", "reward.sources=[{env: true}]",
             "--set", "log.backends=[]", "--set", "log.every_steps=1", *extra],
            env={"RAY_ADDRESS": ray_cluster.address}, timeout=900)
    return out, rows


def test_ray_ppo_runs_its_trajectories_beside_the_tp_2_engine_while_it_trains_and_learns_from_them(ray_cluster, tmp_path):
    out, rows = ray_agent_run(ray_cluster, tmp_path, "--set", "train.max_steps=3", "--set", "rollout.max_staleness=1",
                              "--set", "checkpoint.every_steps=2", "--set", f"data.eval_path={tmp_path / 'rows.jsonl'}",
                              "--set", "eval.score_prompts=4", "--set", "eval.every_steps=2",
                              "--set", "eval.keep_best=eval/reward")
    steps = [m for m in read_metrics(out) if "rollout/score" in m]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["reward/env"] == pytest.approx(r["agent/episode_reward"]) and r["agent/env_tokens"] > 0, r
        assert 0 <= r["agent/engine_idle_share"] < 1 and r["agent/env_calls"] > 1
    # step 1's trajectories came from the actor's weights (the TP-2 engine's log-probs of the model's tokens are
    # the actor's); steps 2 and 3's ran in the engine actor during the step before, one update behind
    assert [r["rollout/staleness"] for r in steps] == [0, 1, 1]
    assert steps[0]["rollout/logprob_max_diff"] < 1e-4 < min(r["rollout/logprob_max_diff"] for r in steps[1:]), steps
    assert all(r["timing/overlap"] > 0 for r in steps[:-1]) and steps[-1]["timing/overlap"] == 0, steps
    assert max(r["agent/turns"] for r in steps) > 1 and steps[1]["train/policy_loss"] != 0
    # eval.keep_best: the actor's workers export the best evaluation's model (step 2's or the final one) to best/
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["step"] in (2, 3) and best == json.loads((out / "summary.json").read_text())["best"], best
    assert (out / "best" / "config.json").exists() and (out / "model" / "config.json").exists()
    # the checkpoint at step 2 keeps step 3's trajectories, run ahead, with their batch's figures (a resume scores them)
    import torch

    (ahead,) = torch.load(out / "checkpoints" / "step_000002" / "ahead_rank0.pt", weights_only=False)["ahead"]
    assert ahead["step"] == 2 and ahead["launched_at"] == 1 and [len(g) for g in ahead["generations"]] == [4] * 4
    assert all(s.episode is not None for g in ahead["generations"] for s in g)
    assert ahead["agent_batch"]["agent/env_calls"][1] == 16 and ahead["agent_batch"]["agent/env_calls"][0] > 16
    workers = json.loads((out / "placement.json").read_text())["workers"]
    assert [w["visible_devices"] for w in workers if w["role"] == "vllm"] == ["0,1"]  # the colocated TP-2 engine


def test_ray_ppo_in_arrival_order_runs_each_prompts_trajectories_as_a_group_on_the_least_loaded_engine(
        ray_cluster, tmp_path):
    """rollout.stream_order arrival with an agent section on Ray: two engines of TP 1, k = 2 with partial rollouts,
    stale groups kept (rollout.stale_groups keep). Each prompt's trajectories are one group, sent to the engine
    with the fewest under way and run in its actor beside its engine (their environments there); each step trains
    the first 4 groups whose trajectories all ended. Over the run every planned group is started once and trained
    exactly once (the final checkpoint's ledger), none dropped, each step's groups older than 2 counted; the step-2
    checkpoint waited for the trajectories under way (an environment's state cannot be kept): every group it holds
    ended, with its episodes."""
    import torch

    steps, per_step = 3, 4
    out, _ = ray_agent_run(ray_cluster, tmp_path, "--set", f"train.max_steps={steps}", "--set",
                           "rollout.max_staleness=2", "--set", "rollout.partial=true", "--set", "ppo.tis_cap=2",
                           "--set", "rollout.stream_order=arrival", "--set", "rollout.stale_groups=keep",
                           "--set", "checkpoint.every_steps=1",
                           "--set", "placement.vllm.engines=2", "--set", "placement.vllm.tensor_parallel_size=1")
    rows = [m for m in read_metrics(out) if "rollout/score" in m]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert rows[0]["stream/admitted_groups"] == 3 * per_step  # steps 0..2's groups start at once (k = 2)
    for r in rows:
        assert r["reward/env"] == pytest.approx(r["agent/episode_reward"]) and r["agent/env_calls"] > 1, r
        assert r["stream/dropped_groups"] == 0 and 0 <= r["agent/engine_idle_share"] < 1, r
    ledger = torch.load(out / "checkpoints" / f"step_{steps:06d}" / "stream_rank0.pt", weights_only=False)["ledger"]
    trained = ledger["trained"]  # (t, i, head version, step)
    assert sorted((t, i) for t, i, *_ in trained) == [(t, i) for t in range(steps) for i in range(per_step)]
    assert not ledger["dropped"] and ledger["admitted"] == steps * per_step  # each started once
    for s, r in enumerate(rows):  # the step's groups older than k: logged, as their share
        older = sum(s - head > 2 for *_, head, step in trained if step == s)
        assert r["stream/overage_groups"] == older and (r["rollout/staleness_share/older"] > 0) == (older > 0), r
    kept = torch.load(out / "checkpoints" / "step_000002" / "stream_rank0.pt", weights_only=False)["groups"]
    assert kept and all(len(g["generations"]) == 4 and all(x.episode is not None for x in g["generations"])
                        for g in kept), kept
    workers = json.loads((out / "placement.json").read_text())["workers"]
    assert sorted(w["visible_devices"] for w in workers if w["role"] == "vllm") == ["0", "1"]  # one GPU each
