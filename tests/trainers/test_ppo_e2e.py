"""PPO and its critic-free relatives end to end through the real CLI, from a half-trained SFT
model: each estimator raises the held-out task score with the exact rule, and PPO does with a
learned reward model alone; a resumed run equals an uninterrupted one; 2 ranks under ZeRO-3 run
the same loop; the vLLM engine's log-probs equal the trainer's after every weight sync."""

from __future__ import annotations

import json

import pytest

from hpcrlhf.metrics import read_metrics
from tests.launch_helpers import run_cli

QUIET = ["--set", "log.tensorboard=false", "--set", "eval.every_steps=0", "--set", "log.every_steps=1"]
RL = [*QUIET, "--set", "task.eval_size=512", "--set", "eval.score_prompts=512", "--set", "rollout.prompts_per_step=32", "--set", "train.global_batch_size=64",
      "--set", "train.micro_batch_size=64"]
PHASES = ("timing/generate", "timing/reward", "timing/make_experience", "timing/train_actor", "timing/weight_sync",
          "timing/step", "throughput/tokens_per_sec")


def summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def train_rows(out) -> list[dict]:
    return [m for m in read_metrics(out) if "rollout/score" in m]


@pytest.mark.slow
@pytest.mark.parametrize("estimator, extra", [
    ("grpo", ["--set", "rollout.samples_per_prompt=8", "--set", "ppo.init_kl_coef=0"]),
    ("dr_grpo", ["--set", "rollout.samples_per_prompt=8", "--set", "ppo.init_kl_coef=0",
                 "--set", "ppo.loss_aggregation=seq-mean-token-sum"]),  # as the paper: a constant normaliser
    ("rloo", ["--set", "rollout.samples_per_prompt=8", "--set", "ppo.init_kl_coef=0.01"]),
    pytest.param("grpo", ["--set", "rollout.samples_per_prompt=8", "--set", "ppo.init_kl_coef=0", "--set",
                          "ppo.ratio_level=sequence", "--set", "ppo.loss_aggregation=seq-mean-token-mean"], id="gspo"),
    ("reinforce++", ["--set", "rollout.samples_per_prompt=4", "--set", "ppo.kl_estimator=k2"]),
    ("reinforce_baseline", ["--set", "rollout.samples_per_prompt=4"]),
    ("gae", ["--set", "rollout.samples_per_prompt=4"]),
])
def test_estimator_with_rule_reward_raises_the_task_score(estimator, extra, policy_model, tmp_path):
    out = tmp_path / "run"
    run_cli(["train", "ppo", "-o", str(out), "--set", f"model.path={policy_model}", "--set", "train.max_steps=60",
             "--set", f"ppo.advantage_estimator={estimator}", *RL, *extra])
    s = summary(out)
    before, after = s["before"]["eval/task_score"], s["after"]["eval/task_score"]
    assert 0.3 < before < 0.7, s
    assert after > before + 0.05, s
    rows = train_rows(out)
    assert all(key in rows[-1] for key in PHASES), sorted(rows[-1])
    assert ("timing/train_critic" in rows[-1]) == (estimator == "gae")
    # the rollout engine's log-probs are the trainer's (HF generate's incremental decoding vs a full forward)
    assert max(r["rollout/logprob_max_diff"] for r in rows) < 1e-4
    if estimator == "gae":  # the critic learns to predict returns
        assert rows[-1]["train/value_loss"] < rows[0]["train/value_loss"]


@pytest.mark.slow
def test_dapo_dynamic_sampling_trains_on_informative_groups_and_raises_the_task_score(policy_model, tmp_path):
    """GRPO with DAPO's dynamic sampling on the bundled task (a 0/1 rule): groups whose 8 samples are
    all right or all wrong are replaced by further rounds' groups; the step keeps its size."""
    out = tmp_path / "run"
    run_cli(["train", "ppo", "-o", str(out), "--set", f"model.path={policy_model}", "--set", "train.max_steps=60",
             "--set", "ppo.advantage_estimator=grpo", "--set", "rollout.samples_per_prompt=8", "--set",
             "ppo.init_kl_coef=0", "--set", "ppo.dynamic_sampling=true", "--set", "ppo.dynamic_sampling_max_rounds=3",
             *RL])
    s = summary(out)
    assert s["after"]["eval/task_score"] > s["before"]["eval/task_score"] + 0.05, s
    rows = train_rows(out)
    assert len(rows) == 60
    for r in rows:
        rounds = r["rollout/generation_rounds"]
        assert rounds in (1, 2, 3) and 0 < r["rollout/informative_share"] <= 1, r
        assert r["rollout/extra_samples"] == (rounds - 1) * 32 * 8  # each refill round: a whole step's prompts
        assert r["rollout/dropped_groups"] == rounds * 32 - 32 and 0 <= r["rollout/uninformative_kept"] <= 32
        if r["rollout/informative_share"] < 1:
            assert rounds > 1 or r["rollout/uninformative_kept"] > 0, r  # never an uninformative group unasked
    assert any(r["rollout/generation_rounds"] > 1 for r in rows)
    # a step of only informative groups holds right and wrong answers: its score is strictly inside (0, 1)
    assert all(0 < r["rollout/task_score"] < 1 for r in rows if r["rollout/uninformative_kept"] == 0)


@pytest.fixture(scope="module")
def task_reward_model(full_sft_run, tmp_path_factory) -> str:
    """A reward model that tells the policy's own mistakes from right answers: trained from a fully
    trained SFT model (`full_sft_run`: task score >= 0.97, so it can add) on pairs whose rejected answer is off by 1-3
    or by 10 (`task.near_miss=offset`: what a half-trained policy gets wrong). A reward model that
    cannot see tens-digit errors gets hacked: PPO on it drifts to those errors (measured)."""
    base = tmp_path_factory.mktemp("rm_for_ppo")
    run_cli(["train", "rm", "-o", str(base / "rm"), "--set", f"model.path={full_sft_run / 'model'}", *QUIET,
             "--set", "task.near_miss=offset", "--set", "task.hard_pair_fraction=1.0", "--set", "task.train_size=160000",
             "--set", "optim.lr=3e-4", "--set", "train.max_steps=4800"])  # measured: 0.80 at step 400, 0.90 by 4800;
    # stopped at 0.88 instead, the policy learned to please it at the task's expense (0.57 -> 0.51, AMD EPYC)
    rm = summary(base / "rm")
    assert rm["after"]["eval/accuracy"] > 0.85, rm  # held-out near-miss pairs ranked right
    return str(base / "rm" / "model")


@pytest.mark.slow
def test_ppo_with_the_learned_reward_model_alone_raises_its_reward_and_keeps_the_task(task_reward_model, policy_model, tmp_path):
    out = tmp_path / "run"
    run_cli(["train", "ppo", "-o", str(out), "--set", f"model.path={policy_model}", "--set", "train.max_steps=60",
             "--set", f"reward.sources=[{{model: {task_reward_model}}}]", *RL])
    s = summary(out)
    before, after = s["before"]["eval/task_score"], s["after"]["eval/task_score"]
    assert 0.3 < before < 0.7, s
    # PPO learns what the reward model rewards. Whether that also raises the task score depends on
    # the reward model, which is trained on this CPU: measured 0.53 -> 0.63 on an Intel Xeon, 0.60 ->
    # 0.62 and 0.57 -> 0.55 on an AMD EPYC (the same code), with its reward up by 0.09-0.15 each time.
    assert s["after"]["eval/reward"] > s["before"]["eval/reward"] + 0.03, s
    assert after > before - 0.05, s  # and the task is not given up for it
    rows = train_rows(out)
    assert set(rows[-1]) >= {"reward/model0_model", "train/value_loss"}  # the RM is the only reward; critic (gae)
    assert "reward/rule_task" not in rows[-1]


@pytest.mark.slow
def test_rejection_sampling_raises_the_task_score(policy_model, tmp_path):
    out = tmp_path / "run"
    run_cli(["train", "rs", "-o", str(out), "--set", f"model.path={policy_model}", "--set", "rs.iterations=2",
             "--set", "rs.prompts_per_iteration=512", "--set", "rs.steps_per_iteration=40", "--set", "rs.min_score=1.0",
             *QUIET])
    s = summary(out)
    assert s["after"]["eval/task_score"] > s["before"]["eval/task_score"] + 0.04, s
    rounds = sorted((out / "rounds").glob("round_*.jsonl"))
    assert [p.name for p in rounds] == ["round_000.jsonl", "round_001.jsonl"]
    records = [json.loads(line) for line in rounds[0].read_text().splitlines()]
    assert records and all(r["chosen_score"] == 1.0 for r in records)  # only correct answers were kept
    from hpcrlhf.data.tasks import ArithmeticTask

    assert all(ArithmeticTask().score(r["prompt"], r["chosen"]) == 1.0 for r in records)


@pytest.mark.slow
def test_iterative_dpo_pairs_best_and_worst_and_learns(policy_model, tmp_path):
    out = tmp_path / "run"
    run_cli(["train", "rs", "-o", str(out), "--set", f"model.path={policy_model}", "--set", "rs.mode=dpo",
             "--set", "optim.lr=1e-5", "--set", "rs.iterations=2", "--set", "rs.prompts_per_iteration=256", "--set", "rs.steps_per_iteration=30",
             *QUIET])
    records = [json.loads(line) for line in (out / "rounds" / "round_000.jsonl").read_text().splitlines()]
    assert records and all(r["chosen_score"] > r["rejected_score"] for r in records)
    rows = [m for m in read_metrics(out) if "train/reward_margin" in m]
    assert rows[-1]["train/reward_margin"] > rows[0]["train/reward_margin"]
    s = summary(out)
    assert s["after"]["eval/task_score"] > s["before"]["eval/task_score"], s


@pytest.mark.slow
def test_resumed_ppo_run_equals_an_uninterrupted_one(policy_model, tmp_path):
    """Stop after step 2 (checkpoint), resume to step 4: the same rollouts, losses and KL
    controller state as a run of 4 steps in one go (replay buffer, adaptive KL and the refill rounds
    of dynamic sampling included)."""
    args = ["--set", f"model.path={policy_model}", "--set", "rollout.prompts_per_step=8", "--set",
            "train.global_batch_size=16", "--set", "train.micro_batch_size=8", "--set", "ppo.buffer_limit=48",
            "--set", "ppo.kl_target=0.01", "--set", "reward.running_norm=true", "--set", "checkpoint.every_steps=2",
            "--set", "ppo.dynamic_sampling=true", "--set", "eval.score_prompts=16", *QUIET]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_cli(["train", "ppo", "-o", str(whole), "--set", "train.max_steps=4", *args])
    run_cli(["train", "ppo", "-o", str(parts), "--set", "train.max_steps=2", *args])
    run_cli(["train", "ppo", "-o", str(parts), "--set", "train.max_steps=4", *args])
    a, b = train_rows(whole), train_rows(parts)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for key in ("rollout/score", "rollout/kl", "train/policy_loss", "train/value_loss", "train/kl_coef", "rollout/advantage",
                "rollout/generation_rounds", "rollout/dropped_groups"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=1e-5, abs=1e-6), key
    assert max(r["rollout/generation_rounds"] for r in a) > 1  # a refill round was resumed, not only first rounds


@pytest.mark.slow
def test_two_ranks_zero3_with_critic_reference_and_offload(policy_model, tmp_path):
    out = tmp_path / "run"
    run_cli(["train", "ppo", "-o", str(out), "--set", f"model.path={policy_model}", "--set", "train.max_steps=3",
             "--set", "engine.zero_stage=3", "--set", "reference.offload=true", "--set", "rollout.prompts_per_step=8",
             "--set", "train.global_batch_size=16", "--set", "train.micro_batch_size=4", "--set", "eval.score_prompts=16",
             "--set", "ppo.dynamic_sampling=true", *QUIET], nproc=2)
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # dynamic sampling's rounds run on both ranks together (generation under ZeRO-3 is collective)
    assert all(r["rollout/dropped_groups"] == (r["rollout/generation_rounds"] - 1) * 8 for r in rows), rows
    assert max(r["rollout/logprob_max_diff"] for r in rows) < 1e-4
    # the actor moved away from the reference: the log-ratio of sampled tokens (k1, either sign) is 0 only before step 1
    assert abs(rows[0]["rollout/kl"]) < 1e-6 and abs(rows[-1]["rollout/kl"]) > 1e-3, [r["rollout/kl"] for r in rows]
    assert (out / "model" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize("nproc, extra", [(1, []), (2, ["--set", "engine.zero_stage=3", "--set", "placement.vllm.sync_bucket_mb=1"])])
def test_vllm_rollouts_stay_in_sync_with_the_actor(nproc, extra, policy_model, tmp_path):
    """After every update the actor's weights are streamed into the vLLM engine (2 ranks: under
    ZeRO-3, gathered chunk by chunk, in 1 MB buckets): if a sync were missed or garbled, the
    engine's log-probs (old weights) would differ from the trainer's (new weights)."""
    out = tmp_path / "run"
    run_cli(["train", "ppo", "-o", str(out), "--set", f"model.path={policy_model}", "--set", "train.max_steps=3",
             "--set", "rollout.backend=vllm", "--set", "rollout.vllm_kv_cache_gb=0.25", "--set", "optim.lr=1e-3",
             "--set", "rollout.prompts_per_step=8", "--set", "train.global_batch_size=16",
             "--set", "train.micro_batch_size=8", "--set", "eval.score_prompts=16", *QUIET, *extra], nproc=nproc,
            timeout=900)
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["train/approx_kl"] > 0 or rows[-1]["rollout/kl"] > 1e-3  # the weights really changed
    assert max(r["rollout/logprob_max_diff"] for r in rows) < 1e-4
    assert all(r["weight_sync/bytes"] > 1.6e6 and r["weight_sync/buckets"] >= (2 if extra else 1) for r in rows)


@pytest.mark.slow
def test_every_ppo_switch_runs_together(policy_model, tmp_path):
    """The less common switches wired through one short run (their maths is checked in
    tests/algos): dual clip, asymmetric clip, entropy bonus, GRPO-style KL loss with k3, sequence
    aggregation, two PPO epochs, a frozen first actor step, reward clipping and penalties."""
    out = tmp_path / "run"
    run_cli(["train", "ppo", "-o", str(out), "--set", f"model.path={policy_model}", "--set", "train.max_steps=3",
             "--set", "rollout.prompts_per_step=8", "--set", "train.global_batch_size=16", "--set", "train.micro_batch_size=8",
             "--set", "ppo.dual_clip=3", "--set", "ppo.clip_eps_high=0.28", "--set", "ppo.entropy_coef=0.01",
             "--set", "ppo.kl_estimator=k3", "--set", "ppo.kl_loss_coef=0.01", "--set", "ppo.value_clip=null",
             "--set", "ppo.loss_aggregation=seq-mean-token-mean", "--set", "ppo.epochs=2", "--set", "ppo.freeze_actor_steps=1",
             "--set", "reward.clip=0.5", "--set", "reward.missing_eos_penalty=-1", "--set", "reward.length_penalty=0.01",
             "--set", "rollout.max_new_tokens=3", "--set", "eval.score_prompts=16", *QUIET])
    rows = train_rows(out)
    assert "train/policy_loss" not in rows[0] and "train/value_loss" in rows[0]  # step 1: critic only
    assert all(k in rows[-1] for k in ("train/policy_loss", "train/kl_loss", "train/entropy"))
    # 3 tokens cut some answers short; their penalty shows in the score (the exact-match part is 0 for them)
    assert rows[-1]["rollout/finished"] < 1
    assert rows[-1]["rollout/score"] < rows[-1]["reward/rule_task"] - 0.01
