"""Batched generation with Hugging Face `generate` (the fallback rollout path, and evaluation).

Prompts are left-padded so that every row's continuation starts at the same column. Under ZeRO-3
every rank must run the same number of forward passes (`synced_gpus`), so callers give every rank
the same number of batches.
"""

from __future__ import annotations

from typing import Sequence

import torch


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def right_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask (for scoring whole sequences)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


@torch.no_grad()
def generate_greedy(model, tokenizer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    device: torch.device, synced_gpus: bool = False) -> list[str]:
    """Greedy continuations (decoded, special tokens removed) of tokenised prompts."""
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    out = model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        synced_gpus=synced_gpus,
    )
    return tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
