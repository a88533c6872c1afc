"""Every job kind's config: documented, loadable, and cross-field mistakes named with their fix."""

from __future__ import annotations

import pytest

from hpcrlhf.config.loader import describe, load_config
from hpcrlhf.config.schema import JOB_CONFIGS, DPOConfig, KTOConfig, SFTConfig
from hpcrlhf.errors import ConfigError


@pytest.mark.parametrize("kind", sorted(JOB_CONFIGS))
def test_every_kind_loads_and_documents_every_field(kind):
    if kind == "rs":  # its length is rounds x steps per round
        cfg = load_config(JOB_CONFIGS[kind], overrides=["rs.iterations=3"])
        assert cfg.rs.iterations == 3 and cfg.output_dir == "runs/rs"
    else:
        cfg = load_config(JOB_CONFIGS[kind], overrides=["train.max_steps=3"])
        assert cfg.train.max_steps == 3 and cfg.output_dir == f"runs/{kind}"
    text = describe(JOB_CONFIGS[kind])
    assert "lora:" in text and "  # LoRA rank" in text


@pytest.mark.parametrize("cls, overrides, needle", [
    (DPOConfig, ["reference.offload=true"], "reference.offload: true keeps reference weights in CPU memory through ZeRO-3"),
    (DPOConfig, ["dpo.label_smoothing=0.2"], "only applies to dpo.loss=cdpo"),
    (DPOConfig, ["dpo.loss=cdpo", "dpo.label_smoothing=0.6"], "dpo.label_smoothing: 0.6 is invalid"),
    (DPOConfig, ["dpo.beta=0"], "dpo.beta: 0.0 is invalid"),
    (KTOConfig, ["kto.undesirable_weight=-1"], "kto.undesirable_weight"),
    (SFTConfig, ["lora.load_in_4bit=true"], "also set lora.rank"),
    (SFTConfig, ["lora.rank=8", "lora.load_in_4bit=true", "engine.zero_stage=3"], "cannot be sharded by ZeRO-3"),
    (SFTConfig, ["task.hard_pair_fraction=2"], "task.hard_pair_fraction"),
])
def test_cross_field_errors(cls, overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        load_config(cls, overrides=overrides)


def test_task_auto_applies_the_bundled_task_only_without_training_data():
    """`task.name: auto` (the default): the arithmetic task supplies data and score when no
    data.train_path is given, and nothing when one is; an explicit task.name is kept as written."""
    from hpcrlhf.config.schema import GenerateConfig, PPOConfig

    cfg = load_config(SFTConfig)
    assert cfg.task.name == "auto" and cfg.task.resolve(cfg.data) == "arithmetic"
    own = load_config(SFTConfig, overrides=["data.train_path=own.jsonl"])
    assert own.task.name == "auto" and own.task.resolve(own.data) is None
    explicit = load_config(SFTConfig, overrides=["data.train_path=own.jsonl", "task.name=arithmetic"])
    assert explicit.task.resolve(explicit.data) == "arithmetic"
    for cls, reward in ((PPOConfig, []), (GenerateConfig, ["reward={sources: [{rule: task_partial}]}"])):
        with pytest.raises(ConfigError) as err:
            load_config(cls, overrides=["data.train_path=own.jsonl", *reward])
        message = str(err.value)
        assert "reward.sources[0].rule: 'task" in message and "task.name is auto" in message, message
        assert "data.train_path is set" in message and "module:function" in message, message


@pytest.mark.parametrize("kind, overrides, needle", [
    ("sft", ["eval.metrics=[task]"], "eval.metrics[0]: 'task' is invalid: use a built-in rule (math, code, format) or "
                                     "package.module:function"),
    ("sft", ["eval.metrics=[a.b:score, c:score]"], "eval.metrics[1]: 'c:score' and 'a.b:score' would both be reported as "
                                                   "eval/score; wrap one in a function of another name"),
    ("ppo", ["data.train_path=own.jsonl", "reward.sources=[{rule: 'm:r'}]", "eval.metrics=[m:f]"],
     "eval.metrics: ['m:f'] score answers to held-out prompts, but with data.train_path and no data.eval_path"),
    ("sft", ["eval.metrics=[m:f]", "eval.score_prompts=0"], "eval.score_prompts is 0"),
    ("rm", ["eval.metrics=[m:f]"], "a reward model generates none"),
    ("generate", ["metrics=[m:f, n:f]"], "metrics[1]: 'n:f' and 'm:f' would both be reported"),
])
def test_metric_mistakes_fail_when_the_config_loads(kind, overrides, needle):
    from hpcrlhf.config.schema import GenerateConfig

    with pytest.raises(ConfigError) as err:
        load_config(GenerateConfig if kind == "generate" else JOB_CONFIGS[kind], overrides=overrides)
    assert needle in str(err.value), str(err.value)


def test_one_intent_one_edit_batches_follow_the_rollout():
    """Changing the rollout size alone used to fail on train.global_batch_size, then on
    train.micro_batch_size: left null they are derived (largest divisor <= 64), set they are kept."""
    from hpcrlhf.config.schema import PPOConfig
    from hpcrlhf.trainers.batches import BatchPlan, PPOPlan

    for prompts, mini in [(32, 64), (20, 40), (7, 28), (100, 50)]:
        cfg = load_config(PPOConfig, overrides=[f"rollout.prompts_per_step={prompts}"])
        assert cfg.train.global_batch_size == mini and (prompts * 4) % mini == 0
        plan = PPOPlan.build(cfg.train, prompts_per_step=prompts, samples_per_prompt=4, ppo_epochs=1,
                             num_prompts=10_000, data_parallel_size=1)
        assert plan.micro_batch_rows == mini and plan.grad_accum_steps == 1
    with pytest.raises(ConfigError, match="train.global_batch_size: 64 does not divide the 80 sequences"):
        load_config(PPOConfig, overrides=["rollout.prompts_per_step=20", "train.global_batch_size=64"])  # set: kept
    sft = load_config(SFTConfig)  # 64 per step on 2 ranks: the derived micro batch is 32 (was: an error)
    plan = BatchPlan.build(sft.train, num_rows=1000, data_parallel_size=2)
    assert (plan.micro_batch_rows, plan.grad_accum_steps) == (32, 1)
    big = load_config(SFTConfig, overrides=["train.global_batch_size=512"])
    assert BatchPlan.build(big.train, num_rows=10_000, data_parallel_size=2).micro_batch_rows == 64  # capped
    with pytest.raises(ConfigError, match="null is derived only for ppo"):
        load_config(SFTConfig, overrides=["train.global_batch_size=null"])


def test_lengths_follow_the_task_unless_set():
    """The demo's lengths (8 new tokens, 64-token samples) apply to the bundled task only; your data
    gets general defaults, and what you set is kept."""
    from hpcrlhf.config.schema import DEFAULT_MAX_LENGTH, DEFAULT_NEW_TOKENS, GenerateConfig, PPOConfig

    demo = load_config(PPOConfig)
    assert (demo.rollout.max_new_tokens, demo.eval.max_new_tokens, demo.data.max_length) == (8, 8, 64)
    own = load_config(PPOConfig, overrides=["data.train_path=p.jsonl", "reward.sources=[{rule: m:f}]"])
    assert (own.rollout.max_new_tokens, own.eval.max_new_tokens, own.data.max_length) == \
        (DEFAULT_NEW_TOKENS, DEFAULT_NEW_TOKENS, DEFAULT_MAX_LENGTH)
    set_ = load_config(SFTConfig, overrides=["data.train_path=t.jsonl", "data.max_length=300", "eval.max_new_tokens=12"])
    assert (set_.data.max_length, set_.eval.max_new_tokens) == (300, 12)
    assert load_config(GenerateConfig, overrides=["data.train_path=p.jsonl"]).rollout.max_new_tokens == DEFAULT_NEW_TOKENS
    with pytest.raises(ConfigError, match="rollout.min_new_tokens: 16 is invalid"):
        load_config(PPOConfig, overrides=["rollout.min_new_tokens=16"])  # against the task's 8
