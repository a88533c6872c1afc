"""Session-wide fixtures: an isolated cache (tiny models and tokenizer built once per session),
offline hub settings, and a small CPU thread budget."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models and the tokenizer are built once into the user's cache (deterministic, keyed by
# builder version); tests that check building itself use their own temporary cache.


@pytest.fixture(scope="session")
def tiny_llama() -> str:
    from hpcrlhf.models.tiny import build_tiny_model_dir

    return str(build_tiny_model_dir("llama"))
