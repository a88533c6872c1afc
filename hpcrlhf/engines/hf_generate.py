"""Batched generation with Hugging Face `generate` (the fallback rollout path, and evaluation).

Prompts are left-padded so that every row's continuation starts at the same column. Under ZeRO-3
every rank must run the same number of forward passes (`synced_gpus`), so callers give every rank
the same number of batches.

A stop request (a time-limit signal, Ctrl-C: `hpcrlhf.run.signals`) ends a generation at the next decode
step (`StopOnRequest`), so a long one does not outlast the time before the kill. Under `synced_gpus`
a rank that stops goes on with the forward passes its peers need (transformers' synced loop) until
they are done too; the caller throws the cut result away (`hpcrlhf.run.folder.Run.stoppable`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from hpcrlhf.run.signals import stop_requested_here


class StopOnRequest(StoppingCriteria):
    """Every row is done once this process was asked to stop (checked after each decode step)."""

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), stop_requested_here(), dtype=torch.bool, device=input_ids.device)


def stop_on_request() -> StoppingCriteriaList:
    """The `stopping_criteria` every generation of hpcrlhf passes to `generate`."""
    return StoppingCriteriaList([StopOnRequest()])


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
        synced_gpus=synced_gpus, stopping_criteria=stop_on_request(),
    )
    return tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
