"""Tokenising (prompt, response) rows for next-token training.

A sample is `prompt tokens + response tokens + EOS`; the loss mask is true on the response and
EOS only. Prompt and response are tokenised separately (the prompt exactly as it is tokenised at
generation time), so the model learns to continue the prompt it will actually see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hpcrlhf.data.sources import Row


@dataclass(frozen=True)
class TokenizedSample:
    input_ids: tuple[int, ...]
    loss_mask: tuple[bool, ...]
    """True where the token is a training target (response and EOS)."""
    origin: str


def encode_prompt(tokenizer, prompt: str, apply_chat_template: bool = False) -> list[int]:
    """Token ids of a prompt as the model sees it, BOS and chat template included."""
    if apply_chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


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
    samples, truncated = [], 0
    for row in rows:
        prompt = encode_prompt(tokenizer, row.data[prompt_key], apply_chat_template)
        response = tokenizer(row.data[response_key], add_special_tokens=False)["input_ids"]
        ids = prompt + response + [tokenizer.eos_token_id]
        mask = [False] * len(prompt) + [True] * (len(response) + 1)
        if len(ids) > max_length:
            truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        samples.append(TokenizedSample(tuple(ids), tuple(mask), row.origin))
    return samples, truncated
