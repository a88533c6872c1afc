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


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (0, "bf16"), (2, "bf16")])
def test_the_first_update_is_adam_s_first_step(stage, precision):
    """Adam's first step moves every weight with a nonzero gradient by lr * g / (|g| + eps) = lr
    (by hand: m_hat = g, v_hat = g^2). DeepSpeed's bf16 optimizer at ZeRO-0 takes a zero-gradient
    step at start-up; uncorrected, the first real update was Adam's second (0.735 lr) and norm
    weights at 1.0 did not move at all in bf16 (`forget_state_making_step`)."""
    import json
    import subprocess
    import sys

    from tests.launch_helpers import ROOT, cli_env

    proc = subprocess.run([sys.executable, "-m", "tests.engines.first_update", str(stage), precision], cwd=ROOT,
                          env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    moved = json.loads(proc.stdout.strip().splitlines()[-1])
    assert moved["model.layers.0.self_attn.q_proj.weight"] == pytest.approx(moved["lr"], rel=0.02), moved
    # bf16 cannot hold 1 + lr: the norm weights (1.0) round up to 1.0 or down to 1 - 2^-8; a step of
    # 0.735 lr rounds to no change at all
    assert moved["model.norm.weight"] > 0.5 * moved["lr"], moved
