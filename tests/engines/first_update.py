"""One optimizer step of a TrainingEngine from fresh Adam state: prints the mean absolute change of
the attention and norm weights (run in its own process: `python -m tests.engines.first_update
STAGE PRECISION`; the test_first_update test reads it)."""

from __future__ import annotations

import json
import os
import sys

import torch


def main(stage: int, precision: str) -> dict:
    for key, value in dict(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(key, value)
    from hpcrlhf.config.schema import EngineConfig, OptimConfig
    from hpcrlhf.engines.deepspeed_engine import TrainingEngine, build_deepspeed_config
    from hpcrlhf.engines.distributed import free_port, init_distributed
    from hpcrlhf.models.loading import load_causal_lm
    from hpcrlhf.models.tiny import build_tiny_model_dir

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    init_distributed()
    optim = OptimConfig(scheduler="constant", warmup_ratio=0.0)
    ds = build_deepspeed_config(EngineConfig(zero_stage=stage, precision=precision), optim, micro_batch_size=8,
                                grad_accum_steps=1, world_size=1)
    model = load_causal_lm(str(build_tiny_model_dir("llama")), dtype=precision)
    before = {k: v.detach().float().clone() for k, v in model.named_parameters()}
    engine = TrainingEngine(model, ds, optim=optim, total_steps=10)
    ids = torch.randint(5, 100, (8, 24), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    after = dict(engine.module.named_parameters())
    return {"lr": optim.lr, **{name: float((after[name].detach().float() - before[name]).abs().mean())
                               for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight")}}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2])))
