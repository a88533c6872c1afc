"""Masked statistics of per-token tensors: sum, mean, and whitening over the global batch.

Whitening takes the mean and variance of the masked entries over every data-parallel rank: the
local sums are reduced in one call of `reduce` (conventions: `hpcrlhf.algos`), and `local_sums` /
`global_sums` are that step for every batch statistic of the RL maths.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hpcrlhf.algos.logprobs import float_dtypes

Reduce = Callable[[list[float]], list[float]]
"""Sums a list of Python floats over data-parallel ranks (an all-reduce), same length out."""


def local_sums(*sums: torch.Tensor) -> list[float]:
    """Scalar tensors -> Python floats (float64), with one device-to-host copy instead of one each."""
    return torch.stack([t.to(device=sums[-1].device, dtype=torch.float64) for t in sums]).tolist()


def global_sums(local: list[float], reduce: Reduce | None) -> list[float]:
    """`local` summed over every rank by `reduce` (None: one process, `local` itself)."""
    if reduce is None:
        return local
    summed = list(reduce(local))
    if len(summed) != len(local):
        raise ValueError(f"reduce returned {len(summed)} values for {len(local)} inputs")
    return summed


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x over positions where mask is true (all dims if dim is None)."""
    kept = torch.where(mask.bool(), x, 0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """masked_sum / number of masked entries; an empty selection gives 0 rather than 0/0 = NaN."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    reduce: Reduce | None = None,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with the mean and population variance of the masked entries
    of the global batch; with shift_mean=False the mean is added back (rescaling only). 0 where
    mask is 0."""
    out, dt = float_dtypes(x)
    keep = mask.bool()
    xk = torch.where(keep, x.detach(), 0).double()
    n, s, ss = global_sums(local_sums(keep.sum(), xk.sum(), xk.square().sum()), reduce)
    # One reduce of plain sums is all a sum-only collective allows. var = E[x^2] - mean^2
    # cancels badly only when |mean| >> std; in float64 that costs ~1e-16 * mean^2 / var,
    # invisible next to the fp32 precision of the inputs for any realistic advantages.
    mean = s / max(n, 1.0)
    var = max(ss / max(n, 1.0) - mean * mean, 0.0)
    white = (x.to(dt) - mean) / math.sqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return torch.where(keep, white, 0).to(out)
