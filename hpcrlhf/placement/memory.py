"""GPU memory of one rank of each role: pure functions of sizes, with the assumptions stated.

What is counted (bytes per GPU; P = parameters, D = the role's data-parallel ranks):

* Trained roles (actor, critic). Mixed precision (`engine.precision: bf16`): bf16 weights 2P,
  bf16 gradients 2P, optimizer 12P (fp32 master weights, Adam m and v). fp32: 4P / 4P / 8P
  (Adam m and v; the weights are their own master copy). ZeRO-1 shards the optimizer over D,
  ZeRO-2 also the gradients, ZeRO-3 also the weights. `offload_optimizer` moves the optimizer
  states to the CPU and, as DeepSpeed does, the reduced gradient partition too (ZeRO-2/3 copy
  each reduced bucket straight into CPU memory; ZeRO-1 still builds the full gradients on the
  GPU first). `offload_params` (ZeRO-3) moves the weights off the GPU.
* Activations of the trained roles (Korthikanti et al. 2022, "Reducing Activation Recomputation
  in Large Transformer Models", eq. 1 without tensor parallelism): per layer
  s*b*h*(34 + 5*a*s/h) bytes for s tokens, b sequences, hidden size h and a attention heads; with
  `engine.gradient_checkpointing` only each layer's input is kept: 2*s*b*h bytes per layer.
* Frozen roles (reference, reward models): weights only, 2P in bf16 (4P in fp32), divided by D
  under ZeRO-3, none with parameter offload. Forward activations are small next to them.
* A vLLM engine of tensor-parallel size T: weights 2P/T per GPU (4P/T when the job runs in fp32,
  as the rollout engine then does); vLLM claims
  gpu_memory_utilization x the GPU's memory on each of its GPUs and keeps the rest of that claim
  (after weights) as KV cache, K and V of every layer for the engine's share of the KV heads.

Phases (`phase_parts`): a PPO step's GPUs hold different things while vLLM generates
(`generate`), while the roles score and train (`train`) and while the actor's weights go into the
engines (`weight_sync`). Without sleep every occupant holds its memory in every phase, and a
trained role's activations exist only in `train`. With `placement.vllm.sleep` an engine holds
nothing while the roles train, and only its weights during the sync (the KV cache comes back once
the trained roles sleep); with `placement.<role>.sleep` a trained role holds nothing while vLLM
generates. A GPU must fit its phase of largest total.

Not counted: CUDA context and allocator fragmentation (a few GiB; leave headroom), DeepSpeed's
communication buckets and ZeRO-3's prefetched layers, the logits of the loss, vLLM's CUDA graphs
and its own activation peak. The estimates are for catching layouts that cannot fit, not for
tuning the last GiB.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal

from hpcrlhf.placement.shapes import ModelShape

GIB = 1 << 30
PARTS = ("weights", "gradients", "optimizer", "activations", "kv_cache")
"""Names of the parts of a breakdown, in display order."""

# Bytes per parameter by engine.precision: (weights, gradients, optimizer states).
_BYTES = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}


@dataclass(frozen=True)
class MemoryParts:
    """Bytes of one GPU (or of one occupant of it), by what they hold."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    kv_cache: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in PARTS)

    def __add__(self, other: MemoryParts) -> MemoryParts:
        return MemoryParts(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in PARTS}


PHASES = ("generate", "train", "weight_sync")
"""A PPO step's memory phases, in step order (see the module docstring)."""
Kind = Literal["engine", "trained", "frozen"]


def phase_parts(parts: MemoryParts, *, kind: Kind, sleeps: bool, phase: str) -> MemoryParts:
    """What an occupant of `kind` (a vLLM engine's GPU, a trained or a frozen role's rank) holding
    `parts` at most holds in `phase`; `sleeps`: its sleep setting."""
    if kind == "frozen" or phase == "train" and kind == "trained" or phase == "generate" and kind == "engine":
        return parts
    if kind == "engine":  # sleeping through training; its weights come back for the sync
        return parts if not sleeps else MemoryParts(weights=parts.weights) if phase == "weight_sync" else MemoryParts()
    return MemoryParts() if sleeps and phase == "generate" else replace(parts, activations=0)


def weight_bytes(precision: str) -> int:
    """Bytes per weight of a model kept in the job's precision (trained, frozen or in vLLM)."""
    return _BYTES[precision][0]


def activation_bytes(shape: ModelShape, *, tokens: int, micro_batch: int, checkpointing: bool) -> int:
    """Activations kept for the backward pass of one micro-batch (Korthikanti et al. 2022, see
    the module docstring): L * s*b*h*(34 + 5*a*s/h), or L * 2*s*b*h with checkpointing."""
    s, b, h, a = tokens, micro_batch, shape.hidden_size, shape.num_attention_heads
    per_layer = 2 * s * b * h if checkpointing else s * b * h * 34 + 5 * a * s * s * b
    return shape.num_layers * per_layer


def trained_memory(params: int, *, ranks: int, zero_stage: int, precision: str, offload_optimizer: bool,
                   offload_params: bool, activations: int) -> MemoryParts:
    """One rank of a role DeepSpeed trains (actor, critic); see the module docstring."""
    w, g, o = (n * params for n in _BYTES[precision])
    optimizer = 0 if offload_optimizer else o // ranks if zero_stage >= 1 else o
    gradients = 0 if offload_optimizer and zero_stage >= 2 else g // ranks if zero_stage >= 2 else g
    return MemoryParts(weights=_frozen_weights(w, ranks, zero_stage, offload_params), gradients=gradients,
                       optimizer=optimizer, activations=activations)


def frozen_memory(params: int, *, ranks: int, zero_stage: int, precision: str, offload_params: bool) -> MemoryParts:
    """One rank of a role that only runs forward passes (reference, reward models)."""
    return MemoryParts(weights=_frozen_weights(weight_bytes(precision) * params, ranks, zero_stage, offload_params))


def _frozen_weights(total: int, ranks: int, zero_stage: int, offload_params: bool) -> int:
    if offload_params:
        return 0
    return total // ranks if zero_stage == 3 else total


def kv_bytes_per_token(shape: ModelShape, *, tensor_parallel_size: int, precision: str) -> int:
    """KV-cache bytes one token takes on each GPU of an engine: K and V for every layer and the
    GPU's KV heads. vLLM splits the KV heads over the TP ranks, and replicates them when TP is
    larger than their number (each GPU then holds one)."""
    heads_per_gpu = max(1, shape.num_kv_heads // tensor_parallel_size)
    return 2 * shape.num_layers * heads_per_gpu * shape.head_dim * weight_bytes(precision)


@dataclass(frozen=True)
class EngineMemory:
    """One GPU of a vLLM engine: its breakdown and the engine's KV-cache capacity in tokens."""

    parts: MemoryParts
    kv_cache_tokens: int
    claimed: int
    """Bytes vLLM claims on the GPU (gpu_memory_utilization x its memory)."""


def engine_memory(shape: ModelShape, *, tensor_parallel_size: int, gpu_memory_utilization: float,
                  gpu_memory: int, precision: str) -> EngineMemory:
    """Weights P*bytes/T; KV cache = the claim minus the weights (0 when the weights do not fit)."""
    weights = weight_bytes(precision) * shape.params // tensor_parallel_size
    claimed = int(gpu_memory_utilization * gpu_memory)
    kv = max(0, claimed - weights)
    tokens = kv // kv_bytes_per_token(shape, tensor_parallel_size=tensor_parallel_size, precision=precision)
    return EngineMemory(MemoryParts(weights=weights, kv_cache=kv), tokens, claimed)
