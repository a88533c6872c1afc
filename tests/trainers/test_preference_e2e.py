"""Reward model, DPO/IPO/cDPO, KTO and conditional SFT end to end through the real CLI: each
learns on the bundled task, 2 ranks agree with 1, precomputed reference log-probs equal live ones,
and the reward model exports with its normalisation statistics and loads as reward and critic."""

from __future__ import annotations

import json

import pytest
import torch

from hpcrlhf.run.metrics import read_metrics
from tests.launch_helpers import run_cli

QUIET = ["--set", "log.backends=[]", "--set", "eval.every_steps=0"]
LEARN = [*QUIET, "--set", "train.max_steps=300", "--set", "task.train_size=9600"]
SHORT = [*QUIET, "--set", "train.max_steps=6", "--set", "train.global_batch_size=16", "--set", "train.micro_batch_size=4",
         "--set", "log.every_steps=1", "--set", "task.train_size=256", "--set", "task.eval_size=32",
         "--set", "eval.score_prompts=16"]


def summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def train_metric(out, key: str) -> dict[int, float]:
    return {m["step"]: m[key] for m in read_metrics(out) if key in m}


@pytest.fixture(scope="module")
def rm_run(sft_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm") / "run"
    run_cli(["train", "rm", "-o", str(out), "--set", f"model.path={sft_model}", "--set", "train.max_steps=200",
             "--set", "task.train_size=6400", *QUIET])
    return out


@pytest.mark.slow
def test_reward_model_learns_and_exports_its_statistics(rm_run):
    s = summary(rm_run)
    assert s["before"]["eval/accuracy"] < 0.75
    assert s["after"]["eval/accuracy_easy"] > 0.9, s["after"]
    assert s["after"]["eval/accuracy"] > s["before"]["eval/accuracy"] + 0.1
    config = json.loads((rm_run / "model" / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification") and len(config["id2label"]) == 1
    assert config["reward_std"] > 0 and config["reward_mean"] == pytest.approx(s["after"]["eval/reward_mean"])


@pytest.mark.slow
def test_exported_reward_model_scores_as_reward_and_initialises_a_critic(rm_run):
    """Load the RM folder independently: normalised rewards of the held-out responses have mean 0
    and std 1 (recomputed here in float64), chosen beats rejected as often as training reported,
    and a critic built from the folder keeps the trained head."""
    from safetensors.torch import load_file

    from hpcrlhf.config.schema import PairDataConfig, TaskConfig
    from hpcrlhf.data.preference import load_pairs
    from hpcrlhf.models.loading import load_tokenizer
    from hpcrlhf.models.value import ValueModel, last_token_values, load_value_model, normalized_rewards
    from hpcrlhf.trainers.sequences import model_batch

    path = str(rm_run / "model")
    tok = load_tokenizer(path)
    model = load_value_model(path, pad_token_id=tok.pad_token_id)
    critic = ValueModel(model).eval()
    saved = load_file(f"{path}/model.safetensors")
    assert torch.equal(critic.hf_model.score.weight, saved["score.weight"])
    _, evals = load_pairs(PairDataConfig(max_length=64), TaskConfig(eval_size=256), tok)
    seqs = [p.chosen for p in evals] + [p.rejected for p in evals]
    batch = model_batch(seqs, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        rewards = last_token_values(critic(batch["input_ids"], batch["attention_mask"], batch["position_ids"]),
                                    batch["attention_mask"])
        pooled = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    torch.testing.assert_close(rewards, pooled.float(), rtol=1e-4, atol=1e-4)  # same as transformers' own pooling
    normed = normalized_rewards(rewards.double(), model.config)
    assert normed.mean().item() == pytest.approx(0.0, abs=1e-3)
    assert normed.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-3)
    n = len(evals)
    accuracy = (rewards[:n] > rewards[n:]).double().mean().item()
    assert accuracy == pytest.approx(summary(rm_run)["after"]["eval/accuracy"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("loss", [["--set", "dpo.loss=dpo"],
                                  ["--set", "dpo.loss=ipo", "--set", "dpo.beta=1.0"],
                                  ["--set", "dpo.loss=cdpo", "--set", "dpo.label_smoothing=0.1"]],
                         ids=["dpo", "ipo", "cdpo"])
def test_dpo_family_raises_preference_for_correct_answers(sft_model, tmp_path, loss):
    out = tmp_path / "dpo"
    run_cli(["train", "dpo", "-o", str(out), "--set", f"model.path={sft_model}", "--set", "dpo.nll_coef=0.2",
             *LEARN, *loss])
    before, after = summary(out)["before"], summary(out)["after"]
    assert before["eval/reward_accuracy"] == 0.0  # policy == reference at the start
    assert after["eval/reward_accuracy"] > 0.6, after  # implicit reward separates held-out pairs
    assert after["eval/reward_margin"] > 0
    # The policy itself (no reference) puts more probability on correct than on wrong answers.
    assert after["eval/logp_margin"] > before["eval/logp_margin"], (before, after)
    assert after["eval/task_score"] > before["eval/task_score"] + 0.02, (before, after)


@pytest.mark.slow
def test_kto_raises_desirable_over_undesirable_and_task_score(sft_model, tmp_path):
    out = tmp_path / "kto"
    run_cli(["train", "kto", "-o", str(out), "--set", f"model.path={sft_model}", "--set", "kto.beta=0.5",
             "--set", "kto.desirable_weight=1.33", *LEARN])
    before, after = summary(out)["before"], summary(out)["after"]
    assert before["eval/reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert after["eval/reward_margin"] > 0.5, after
    assert after["eval/logp_margin"] > before["eval/logp_margin"], (before, after)
    assert after["eval/task_score"] > before["eval/task_score"] + 0.02, (before, after)
    assert all(v >= 0 for v in train_metric(out, "train/kl").values())  # z0 is clamped at 0


@pytest.mark.slow
def test_csft_top_condition_beats_bottom(sft_model, tmp_path):
    out = tmp_path / "csft"
    run_cli(["train", "csft", "-o", str(out), "--set", f"model.path={sft_model}", "--set", "optim.lr=1e-3", *LEARN])
    after = summary(out)["after"]
    assert after["eval/task_score_top"] > after["eval/task_score_bottom"] + 0.03, after
    meta = json.loads((out / "model" / "csft.json").read_text())
    assert meta["top_bucket"] == 1 and meta["bucket_edges"] == [0.5]


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref_one_rank")
    runs = {}
    for kind in ("rm", "dpo", "kto"):
        runs[kind] = root / kind
        run_cli(["train", kind, "-o", str(runs[kind]), *SHORT])
    return runs


def _agree(a, b, key: str) -> None:
    one, two = train_metric(a, key), train_metric(b, key)
    assert sorted(one) == sorted(two) == list(range(1, 7))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=2e-3, abs=2e-3), (key, step)


@pytest.mark.distributed
@pytest.mark.parametrize("kind, engine", [
    ("rm", ["--set", "engine.zero_stage=2"]),
    ("dpo", ["--set", "engine.zero_stage=3", "--set", "reference.offload=true"]),
    ("kto", ["--set", "engine.zero_stage=2"]),
], ids=["rm-zero2", "dpo-zero3-refoffload", "kto-zero2"])
def test_two_ranks_agree_with_one(one_rank_runs, tmp_path, kind, engine):
    out = tmp_path / kind
    run_cli(["train", kind, "-o", str(out), *SHORT, *engine], nproc=2)
    _agree(one_rank_runs[kind], out, "train/loss")
    key = {"rm": "train/accuracy", "dpo": "train/reward_margin", "kto": "train/kl"}[kind]
    _agree(one_rank_runs[kind], out, key)


def test_precomputed_reference_equals_live(one_rank_runs, tmp_path):
    out = tmp_path / "dpo_pre"
    run_cli(["train", "dpo", "-o", str(out), *SHORT, "--set", "reference.precompute=true"])
    _agree(one_rank_runs["dpo"], out, "train/loss")
    _agree(one_rank_runs["dpo"], out, "train/reward_margin")
    assert (out / "reference_logps.pt").exists()
    before = summary(out)["after"]["eval/loss"]
    assert before == pytest.approx(summary(one_rank_runs["dpo"])["after"]["eval/loss"], rel=1e-4)


def test_rm_on_user_pairs_with_margins_and_no_eval_data(tmp_path):
    from hpcrlhf.data.tasks import ArithmeticTask

    rows = [{**r, "margin": 1.0 if r["difficulty"] == "easy" else 0.0}
            for r in ArithmeticTask().mixed_preference_rows("train", 64, 0.5)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "rm"
    run_cli(["train", "rm", "-o", str(out), *SHORT, "--set", "task.name=null", "--set", f"data.train_path={data}",
             "--set", "data.margin_key=margin"])
    losses = train_metric(out, "train/loss")
    assert len(losses) == 6 and all(v == v and v > 0 for v in losses.values())
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["reward_std"] > 0  # statistics from training pairs when there is no eval data
