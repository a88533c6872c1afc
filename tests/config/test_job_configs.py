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
