"""Fixtures for the rollout-engine tests: the bundled task's prompts and one real vLLM engine.

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
