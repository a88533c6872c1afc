"""From sequence scores to per-token rewards: the KL-penalised token rewards, score clipping and
running score normalisation.

* KL-penalised rewards (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
  Preferences"): r_t = -beta KL_t at each response token, plus the sequence score at the last one
  (beta: `kl.build_kl_controller`).
* A multi-turn trajectory's turn rewards, each at its turn's last action (`place_turn_rewards`).
* Running reward moments combined exactly across batches and ranks (Chan, Golub & LeVeque 1979).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hpcrlhf.algos.logprobs import float_dtypes
from hpcrlhf.algos.masked import Reduce, global_sums, local_sums


def shape_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Per-token rewards (B, T): -kl_coef * kl at every masked token, plus scores[b] at the last
    masked token of row b (the reward model judges the whole response, so its score arrives when
    the episode ends). Rows without masked tokens get all zeros."""
    out, dt = float_dtypes(scores, kl)
    keep = mask.bool()
    pos = torch.arange(keep.shape[-1], device=keep.device)
    last = torch.where(keep, pos, -1).amax(-1, keepdim=True)  # -1 for an empty row: never matches
    is_last = keep & (pos == last)
    rewards = torch.where(keep, -kl_coef * kl.to(dt), 0)
    rewards = rewards + torch.where(is_last, scores.to(dt).unsqueeze(-1), 0)
    return rewards.to(out)


def place_turn_rewards(rewards: torch.Tensor, positions: Sequence[Sequence[int]],
                       values: Sequence[Sequence[float]]) -> torch.Tensor:
    """Per-token rewards (B, T) with values[b][k] added at position positions[b][k] of row b (a
    multi-turn trajectory's turn rewards, each at its turn's last action; several at one position add up)."""
    out = rewards.clone()
    for b, (where, what) in enumerate(zip(positions, values, strict=True)):
        if len(where) != len(what):
            raise ValueError(f"row {b}: {len(what)} turn rewards for {len(where)} positions")
        for p, v in zip(where, what):
            out[b, p] += v
    return out


def clip_rewards(scores: torch.Tensor, clip: float | None) -> torch.Tensor:
    """Clamp scores to [-clip, clip]; None leaves them unchanged."""
    if clip is None:
        return scores
    if not clip > 0:
        raise ValueError(f"reward clip must be > 0 or None, got {clip}")
    return scores.clamp(-clip, clip)


class RunningMoments:
    """Running mean and population std of every score seen so far, exact in float64.

    Each batch (global over ranks via `reduce`) is folded in with Chan et al.'s parallel
    combination of (count, mean, M2), so the result equals the statistics of the concatenation
    of all batches, whatever their sizes. Before the first update mean = 0 and std = 1, so
    `normalize_scores` is the identity until there is data.
    """

    def __init__(self) -> None:
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean
        self.count = 0.0

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count > 0 else 1.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, x: torch.Tensor, reduce: Reduce | None = None) -> tuple[float, float]:
        """Fold in a batch of scores (all ranks call this with the same state); return (mean, std)."""
        # Sums of deviations from the current mean, which every rank holds identically: a shared
        # shift keeps the one-reduce variance free of cancellation once the mean has settled.
        d = x.detach().double().flatten() - self.mean
        n, s, ss = global_sums(local_sums(torch.tensor(d.numel()), d.sum(), d.square().sum()), reduce)
        if n == 0:
            return self.mean, self.std
        delta = s / n  # batch mean minus running mean
        batch_m2 = max(ss - s * delta, 0.0)
        total = self.count + n
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total
        return self.mean, self.std

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "m2": self.m2, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.m2, self.count = float(state["mean"]), float(state["m2"]), float(state["count"])


def normalize_scores(scores: torch.Tensor, moments: RunningMoments, eps: float = 1e-8) -> torch.Tensor:
    """(scores - mean) / (std + eps) with the moments' current values."""
    out, dt = float_dtypes(scores)
    return ((scores.to(dt) - moments.mean) / (moments.std + eps)).to(out)
