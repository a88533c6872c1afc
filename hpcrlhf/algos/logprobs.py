"""Token log-probabilities and summed token losses: the shared maths of every trainer.

`labels` are already aligned with `logits` (labels[t] is the target of logits[t], -100 = none),
see `hpcrlhf.data.batching`. Losses are returned as sums with their token counts, so callers
can normalise over a whole global batch (exact across ranks, micro-batches and packing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels[t] | context) at each position, in fp32; 0 where labels == -100."""
    logits = logits.float()
    safe = labels.clamp(min=0)
    logp = torch.gather(F.log_softmax(logits, dim=-1), -1, safe.unsqueeze(-1)).squeeze(-1)
    return logp * (labels != IGNORE)


def nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token negative log-likelihood over labelled tokens, and their count."""
    loss = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return loss, int((labels != IGNORE).sum())
