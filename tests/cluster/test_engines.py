"""vLLM engines as Ray actors on the node map's TP groups: each engine runs where the map says,
and after every weight sync its greedy generations equal those of the trainer's weights."""

from __future__ import annotations

import pytest
import torch

from hpcrlhf.cli import resolve_recipe
from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.placement import build_node_map

pytestmark = pytest.mark.slow


def greedy_tokens(gens) -> list[list[int]]:
    return [s[0].response_ids for s in gens]


def test_engines_on_tp_groups_follow_weight_syncs(ray_cluster, tiny_llama):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from hpcrlhf.cluster.engines import EngineWorker
    from hpcrlhf.cluster.reservation import reserve
    from hpcrlhf.cluster.worker_group import WorkerGroup
    from hpcrlhf.data.tasks import ArithmeticTask
    from hpcrlhf.engines.rollout import HFRollout, SamplingParams
    from hpcrlhf.models.loading import load_tokenizer

    node_map = build_node_map(load_config(PPOConfig, resolve_recipe("ppo-tiny-ray")))
    tokenizer = load_tokenizer(tiny_llama)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in ArithmeticTask().prompt_rows("eval", 12)]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    hf = HFRollout(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   device=torch.device("cpu"))
    params = SamplingParams(greedy=True, max_new_tokens=8)

    reservation = reserve(node_map)
    engines = None
    try:
        engines = WorkerGroup.for_engines(EngineWorker, reservation, tiny_llama, tensor_parallel_size=2,
                                          max_model_len=128, kv_cache_bytes=1 << 27)
        for where, devices in zip(engines.call("whereabouts"), node_map.engines):
            assert where.node_ip == ray_cluster.node_ips[devices[0].node]
            assert where.visible_devices == ",".join(str(d.gpu) for d in devices) == "2,3"
        before = greedy_tokens(hf.generate(prompts, params))
        assert [greedy_tokens(g) for g in engines.call("generate", prompts, params)] == [before, before]
        for update in range(2):  # two "optimizer steps", each followed by a sync
            with torch.no_grad():
                gen = torch.Generator().manual_seed(update)
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            engines.call("load_weights", {k: v.clone() for k, v in model.state_dict().items()})
            after = greedy_tokens(hf.generate(prompts, params))
            assert [greedy_tokens(g) for g in engines.call("generate", prompts, params)] == [after, after]
            assert after != before  # the update changed the greedy answers, so equality is evidence
            before = after
    finally:
        if engines is not None:
            engines.call("close")
            engines.kill()
        reservation.release()
