"""Reward buckets for conditional SFT: pure functions.

Rewards are cut into `k` equal-width buckets over [min, max] of the training rewards; bucket 0
holds the worst responses and bucket k-1 the best. Values outside the range (held-out data)
fall into the first or last bucket.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def bucket_edges(rewards: Sequence[float], k: int) -> list[float]:
    """The k-1 inner edges of k equal-width buckets over [min(rewards), max(rewards)]."""
    if k < 2:
        raise ValueError(f"need at least 2 buckets, got {k}")
    lo, hi = min(rewards), max(rewards)
    if lo == hi:
        raise ValueError(f"every reward is {lo}: conditioning needs rewards that differ")
    return [lo + (hi - lo) * i / k for i in range(1, k)]


def bucket_of(reward: float, edges: Sequence[float]) -> int:
    """Index of the bucket holding `reward` (a reward on an edge goes to the upper bucket)."""
    return bisect.bisect_right(edges, reward)
