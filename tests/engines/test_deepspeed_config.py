import pytest

from hpcrlhf.config.loader import from_dict
from hpcrlhf.config.schema import EngineConfig, OptimConfig
from hpcrlhf.engines.deepspeed_engine import build_deepspeed_config
from hpcrlhf.errors import ConfigError


def ds(**engine):
    return build_deepspeed_config(EngineConfig(**engine), OptimConfig(), micro_batch_size=4, grad_accum_steps=2, world_size=2)


def test_batch_sizes_and_plain_adam():
    cfg = ds()
    assert cfg["train_batch_size"] == 16 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["optimizer"]["params"]["torch_adam"] is True
    assert cfg["zero_optimization"] == {"stage": 0}


def test_zero3_offload():
    cfg = ds(zero_stage=3, offload_optimizer=True, offload_params=True, precision="bf16")
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    assert "torch_adam" not in cfg["optimizer"]["params"]  # offload steps with DeepSpeed's CPU Adam
    assert cfg["bf16"]["enabled"] is True


@pytest.mark.parametrize("bad, needle", [
    ({"zero_stage": 0, "offload_optimizer": True}, "engine.zero_stage"),
    ({"zero_stage": 2, "offload_params": True}, "engine.zero_stage=3"),
])
def test_offload_needs_zero(bad, needle):
    with pytest.raises(ConfigError, match=needle):
        from_dict(EngineConfig, bad)
