"""Token log-probabilities and summed token losses: the shared maths of every trainer.

`labels` are already aligned with `logits` (labels[t] is the target of logits[t], -100 = none),
see `hpcrlhf.data.batching`. Losses are returned as sums with their token counts, so callers
can normalise over a whole global batch (exact across ranks, micro-batches and packing).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

IGNORE = -100


def float_dtypes(*tensors: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(output dtype, compute dtype) of a loss over `tensors`: their promoted dtype, and that
    promoted to at least fp32 (half-precision inputs are computed in fp32, returned as given)."""
    out = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    if not out.is_floating_point:
        raise TypeError(f"expected floating-point tensors, got {out}")
    return out, torch.promote_types(out, torch.float32)


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
