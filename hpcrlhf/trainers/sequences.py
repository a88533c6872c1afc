"""Running tokenised samples through a model: batches and per-sequence log-probabilities.

Shared by every trainer that scores whole responses (reward model, DPO, KTO, the reference
model, evaluation). Samples are right-padded one per row with an attention mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hpcrlhf.algos.logprobs import IGNORE, token_logprobs
from hpcrlhf.data.batching import collate
from hpcrlhf.data.sft import TokenizedSample


def model_batch(samples: Sequence[TokenizedSample], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded batch tensors (input_ids, attention_mask, position_ids, labels) on `device`."""
    return {k: v.to(device) for k, v in collate([[s] for s in samples], pad_id, packed=False).items()}


def response_logps(forward: Callable[..., object], samples: Sequence[TokenizedSample], pad_id: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of each sample's response tokens (and EOS), and their counts (fp32).

    `forward(**batch)` is the model call (a training engine, or a frozen model)."""
    batch = model_batch(samples, pad_id, device)
    labels = batch.pop("labels")
    logps = token_logprobs(forward(**batch).logits, labels)
    return logps.sum(-1), (labels != IGNORE).sum(-1).float()
