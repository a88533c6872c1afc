"""Tokenising (prompt, response) rows for next-token training.

A sample is `prompt tokens + response tokens + EOS`; the loss mask is true on the response and
EOS only. Prompt and response are tokenised separately (the prompt exactly as it is tokenised at
generation time), so the model learns to continue the prompt it will actually see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hpcrlhf.data.sources import Row
from hpcrlhf.errors import ConfigError


@dataclass(frozen=True)
class TokenizedSample:
    input_ids: tuple[int, ...]
    loss_mask: tuple[bool, ...]
    """True where the token is a training target (response and EOS)."""
    origin: str


def encode_prompts(tokenizer, prompts: Sequence[str], apply_chat_template: bool = False) -> list[list[int]]:
    """Token ids of prompts as the model sees them, special tokens and chat template included."""
    if not prompts:  # a fast tokenizer fails on an empty batch
        return []
    if apply_chat_template:
        _require_chat_template(tokenizer)
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
        return tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    return tokenizer(list(prompts), add_special_tokens=True)["input_ids"]


def _require_chat_template(tokenizer) -> None:
    """A base model's tokenizer has no chat template; transformers would fail deep inside
    `apply_chat_template` with a ValueError that does not say which setting asked for it."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or "the model"
        raise ConfigError(f"data.apply_chat_template: true, but the tokenizer of {name} has no chat template; set "
                          "data.apply_chat_template=false for a base model, or use a chat model")


def encode_prompt(tokenizer, prompt: str, apply_chat_template: bool = False) -> list[int]:
    return encode_prompts(tokenizer, [prompt], apply_chat_template)[0]


def tokenize_sft(
    rows: Sequence[Row],
    tokenizer,
    *,
    prompt_key: str,
    response_key: str,
    max_length: int,
    apply_chat_template: bool = False,
) -> tuple[list[TokenizedSample], int]:
    """Tokenise rows; returns the samples and how many were truncated to `max_length`."""
    if not rows:
        return [], 0
    prompts = encode_prompts(tokenizer, [r.data[prompt_key] for r in rows], apply_chat_template)
    responses = tokenizer([r.data[response_key] for r in rows], add_special_tokens=False)["input_ids"]
    samples, truncated = [], 0
    for row, prompt, response in zip(rows, prompts, responses):
        ids = prompt + response + [tokenizer.eos_token_id]
        mask = [False] * len(prompt) + [True] * (len(response) + 1)
        if len(ids) > max_length:
            truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        samples.append(TokenizedSample(tuple(ids), tuple(mask), row.origin))
    return samples, truncated
