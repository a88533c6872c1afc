"""A job's rollout engine settings, read from its config: the sampling settings of a `rollout`
section (`sampling_params`) and the keyword arguments a `VLLMRollout` is built with, in this
process (`trainers.online`, `hpcrlhf generate`) or in an engine worker (`trainers.ppo.ray`)."""

from __future__ import annotations

from typing import Any

from hpcrlhf.config.schema import PPOConfig, RolloutConfig
from hpcrlhf.engines.rollout.contract import SamplingParams
from hpcrlhf.models.loading import resolve_model_path


def sampling_params(r: RolloutConfig, *, n: int, seed: int | None, greedy: bool = False) -> SamplingParams:
    """The engine's sampling settings from a `rollout` config section."""
    return SamplingParams(n=n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                          min_new_tokens=r.min_new_tokens, greedy=greedy, seed=seed)


def vllm_engine_args(cfg: PPOConfig) -> dict[str, Any]:
    """`VLLMRollout`'s settings for a job: model folder, seed, longest sequence (prompt + rollout or
    evaluation response, or a multi-turn trajectory's `agent.max_tokens`), precision and the rollout
    section's engine settings."""
    r = cfg.rollout
    return dict(model_dir=resolve_model_path(cfg.model.path), seed=cfg.seed,
                max_model_len=cfg.data.max_length + max(r.max_new_tokens, cfg.eval.max_new_tokens,
                                                         cfg.agent.max_tokens if cfg.agent else 0),
                dtype="bfloat16" if cfg.engine.precision == "bf16" else "float32",
                bucket_bytes=cfg.placement.vllm.sync_bucket_mb << 20, sleep=cfg.placement.vllm.sleep,
                **vllm_rollout_args(r))


def vllm_rollout_args(r: RolloutConfig) -> dict[str, Any]:
    """`VLLMRollout`'s settings from a `RolloutConfig`: KV cache, eager mode and batching limits."""
    return dict(kv_cache_bytes=int(r.vllm_kv_cache_gb * (1 << 30)), enforce_eager=r.vllm_enforce_eager,
                max_num_seqs=r.vllm_max_num_seqs, max_num_batched_tokens=r.vllm_max_num_batched_tokens,
                chunked_prefill=r.vllm_chunked_prefill)
