"""The rollout-engine seam: how PPO (and every online trainer) turns prompts into responses.

A trainer asks a `RolloutEngine` for `n` responses per prompt and gets back, for every response
token, its log-probability under the policy. Two backends sit behind the same three methods
(`generate`, `load_weights`, `close`); trainers never import vLLM:

- `hf.HFRollout`: Hugging Face `generate` on the trainer's own module. Slow (one Python step per
  token) but always available, and it works under ZeRO-3 (`synced_gpus`). It *shares* the
  trained parameters, so its `load_weights` is a no-op: the engine is in sync by construction.
- `vllm.VLLMRollout`: a vLLM engine on a Hugging Face folder, 15-30x faster on the tiny model here.
  It holds its own copy of the weights, so the trainer pushes the actor's state dict after every
  update (`load_weights`).

This package exposes the contract (`contract`: what an engine takes and returns) and
`build_rollout`; the backends are `hf`, `vllm` (with `vllm_worker`, what runs inside vLLM's own
processes) and `shared` (one engine on rank 0 serving every rank of a machine); `settings` reads
a job's config into sampling settings and a vLLM engine's arguments.

Why the log-probs are raw. PPO's ratio is pi_new(a|s) / pi_old(a|s), where pi_old is the
probability the *trained model* gave the token when it was sampled. The trainer recomputes
pi_new with a plain forward pass: log_softmax of the model's logits, no temperature, no top-p or
top-k. So the rollout engine reports the same thing: log p(token | context) from the
unmodified distribution (HF: `output_logits=True`, the logits before any processor; vLLM:
`logprobs_mode="raw_logprobs"`), in fp32, whatever temperature/top-p/top-k chose the token.
Both backends agree with the trainer's forward pass to ~1e-6 in fp32 (tested at 1e-4).
"""

from __future__ import annotations

from typing import Literal

from hpcrlhf.engines.rollout.contract import (BACKENDS, ENGINE_MEMORY, Done, Generation, Groups, Pending,
                                              RolloutEngine, SamplingParams, launch)
from hpcrlhf.engines.rollout.hf import HFRollout
from hpcrlhf.engines.rollout.vllm import VLLMRollout

__all__ = ["BACKENDS", "ENGINE_MEMORY", "Done", "Generation", "Groups", "Pending", "RolloutEngine", "SamplingParams",
           "build_rollout", "launch"]


def build_rollout(backend: Literal["hf", "vllm"], **kwargs) -> RolloutEngine:
    """The rollout engine for `backend` ("hf": HFRollout(model, ...), "vllm": VLLMRollout(model_dir, ...))."""
    if backend == "hf":
        return HFRollout(**kwargs)
    if backend == "vllm":
        return VLLMRollout(**kwargs)
    raise ValueError(f"unknown rollout backend {backend!r}: valid backends are {', '.join(repr(b) for b in BACKENDS)}")
