"""Memory per GPU against numbers worked out by hand from the rules in `placement.memory`."""

from __future__ import annotations

import pytest

from hpcrlhf.placement.memory import (GIB, MemoryParts, activation_bytes, engine_memory, frozen_memory,
                                      kv_bytes_per_token, trained_memory)
from hpcrlhf.placement.shapes import shape_of

P7 = 6_738_415_616  # meta-llama/Llama-2-7b-hf


def trained(**kw) -> MemoryParts:
    args = dict(ranks=4, zero_stage=2, precision="bf16", offload_optimizer=False, offload_params=False, activations=0)
    return trained_memory(P7, **{**args, **kw})


@pytest.mark.parametrize("kw, weights, gradients, optimizer", [
    (dict(zero_stage=0), 2 * P7, 2 * P7, 12 * P7),  # plain data parallel: everything replicated
    (dict(zero_stage=1), 2 * P7, 2 * P7, 12 * P7 // 4),
    (dict(zero_stage=2), 2 * P7, 2 * P7 // 4, 12 * P7 // 4),
    (dict(zero_stage=3), 2 * P7 // 4, 2 * P7 // 4, 12 * P7 // 4),
    (dict(zero_stage=2, precision="fp32"), 4 * P7, 4 * P7 // 4, 8 * P7 // 4),
    (dict(zero_stage=1, offload_optimizer=True), 2 * P7, 2 * P7, 0),  # ZeRO-1 still builds full gradients
    (dict(zero_stage=2, offload_optimizer=True), 2 * P7, 0, 0),  # the gradient partition goes to the CPU
    (dict(zero_stage=3, offload_optimizer=True, offload_params=True), 0, 0, 0),
])
def test_trained_role_by_zero_stage_and_offload(kw, weights, gradients, optimizer):
    parts = trained(**kw)
    assert (parts.weights, parts.gradients, parts.optimizer) == (weights, gradients, optimizer)


def test_7b_zero2_on_4_ranks_in_gib():
    parts = trained(zero_stage=2)
    # 2P = 13.48e9 B = 12.55 GiB; 2P/4 = 3.14 GiB; 12P/4 = 20.2e9 B = 18.83 GiB
    assert [round(v / GIB, 2) for v in (parts.weights, parts.gradients, parts.optimizer)] == [12.55, 3.14, 18.83]
    assert parts.total == 2 * P7 + 2 * P7 // 4 + 12 * P7 // 4


@pytest.mark.parametrize("zero_stage, offload, weights", [(2, False, 2 * P7), (3, False, 2 * P7 // 8), (3, True, 0)])
def test_frozen_role_holds_weights_only(zero_stage, offload, weights):
    parts = frozen_memory(P7, ranks=8, zero_stage=zero_stage, precision="bf16", offload_params=offload)
    assert parts == MemoryParts(weights=weights)


def test_activations_follow_korthikanti_and_checkpointing():
    shape = shape_of("meta-llama/Llama-2-7b-hf")  # L 32, h 4096, a 32
    s, b = 2048, 4
    per_layer = s * b * 4096 * (34 + 5 * 32 * s // 4096)  # s*b*h*(34 + 5as/h): 114 bytes per (token, hidden)
    assert activation_bytes(shape, tokens=s, micro_batch=b, checkpointing=False) == 32 * per_layer
    assert activation_bytes(shape, tokens=s, micro_batch=b, checkpointing=True) == 32 * 2 * s * b * 4096  # 2.0 GiB
    assert round(32 * per_layer / GIB, 1) == 114.0


def test_vllm_engine_weights_kv_cache_and_tokens():
    shape = shape_of("meta-llama/Llama-2-70b-hf")  # 80 layers, 8 KV heads of 128
    gpu = 80 * GIB
    e = engine_memory(shape, tensor_parallel_size=4, gpu_memory_utilization=0.9, gpu_memory=gpu, precision="bf16")
    weights = 2 * 68_976_648_192 // 4
    assert e.parts.weights == weights and e.claimed == int(0.9 * gpu)
    assert e.parts.kv_cache == int(0.9 * gpu) - weights and e.parts.total == e.claimed
    per_token = 2 * 80 * (8 // 4) * 128 * 2  # K and V, layers, KV heads on this GPU, head_dim, bf16
    assert kv_bytes_per_token(shape, tensor_parallel_size=4, precision="bf16") == per_token == 81_920
    assert e.kv_cache_tokens == (int(0.9 * gpu) - weights) // per_token
    # TP larger than the KV heads replicates them: one head per GPU
    assert kv_bytes_per_token(shape, tensor_parallel_size=16, precision="bf16") == 2 * 80 * 1 * 128 * 2


def test_vllm_weights_larger_than_the_claim_leave_no_kv_cache():
    shape = shape_of("meta-llama/Llama-2-70b-hf")
    e = engine_memory(shape, tensor_parallel_size=1, gpu_memory_utilization=0.9, gpu_memory=80 * GIB,
                      precision="bf16")
    assert e.parts.kv_cache == 0 and e.kv_cache_tokens == 0 and e.parts.weights == 2 * 68_976_648_192


@pytest.mark.parametrize("kind, sleeps, generate, train, weight_sync", [
    # a trained role: activations only while training; asleep, nothing while vLLM generates
    ("trained", False, MemoryParts(1, 2, 3, 0, 0), MemoryParts(1, 2, 3, 4, 0), MemoryParts(1, 2, 3, 0, 0)),
    ("trained", True, MemoryParts(), MemoryParts(1, 2, 3, 4, 0), MemoryParts(1, 2, 3, 0, 0)),
    # an engine: asleep, nothing while the roles train and only its weights in the sync
    ("engine", False, MemoryParts(1, 0, 0, 0, 5), MemoryParts(1, 0, 0, 0, 5), MemoryParts(1, 0, 0, 0, 5)),
    ("engine", True, MemoryParts(1, 0, 0, 0, 5), MemoryParts(), MemoryParts(weights=1)),
    ("frozen", False, MemoryParts(weights=1), MemoryParts(weights=1), MemoryParts(weights=1)),
])
def test_what_an_occupant_holds_in_each_phase(kind, sleeps, generate, train, weight_sync):
    from hpcrlhf.placement.memory import PHASES, phase_parts

    most = {"trained": MemoryParts(1, 2, 3, 4, 0), "engine": MemoryParts(weights=1, kv_cache=5),
            "frozen": MemoryParts(weights=1)}[kind]
    got = [phase_parts(most, kind=kind, sleeps=sleeps, phase=phase) for phase in PHASES]
    assert got == [generate, train, weight_sync]
