"""Fixtures for the rollout-engine tests: the bundled task's prompts, one real vLLM engine and one on an engine
loop.

The engine starts once per test module (~15-20 s here: two spawned processes) and is shut down
when the module ends, so an idle engine does not compete with later tests for the 2 cores.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def rollout_prompts(tiny_llama) -> list[list[int]]:
    """16 held-out arithmetic prompts ("12+34="), tokenised by the tiny model's tokenizer."""
    from hpcrlhf.data.tasks import ArithmeticTask
    from hpcrlhf.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama)
    return [tokenizer(row["prompt"])["input_ids"] for row in ArithmeticTask().prompt_rows("eval", 16)]


@pytest.fixture(scope="module")
def vllm_rollout(tiny_llama):
    """A VLLMRollout on the tiny llama (fp32, eager, 256 MiB KV cache)."""
    pytest.importorskip("vllm")
    from hpcrlhf.engines.rollout.vllm import VLLMRollout

    engine = VLLMRollout(tiny_llama, seed=0, max_model_len=256, kv_cache_bytes=1 << 28)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def streaming(tiny_llama):
    """A StreamingRollout on the tiny llama that pauses its samples across weight updates (rollout.partial)."""
    pytest.importorskip("vllm")
    from hpcrlhf.engines.rollout.loop import StreamingRollout
    from hpcrlhf.engines.rollout.vllm import VLLMRollout

    rollout = StreamingRollout(lambda: VLLMRollout(tiny_llama, seed=0, max_model_len=256, kv_cache_bytes=1 << 28),
                               partial=True)
    yield rollout
    rollout.close()
