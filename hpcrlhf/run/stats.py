"""Metrics as (sum, count) pairs: how every trainer adds up a step or an evaluation over
micro-batches, workers and ranks before taking means (a mean of means would weigh a short
micro-batch like a full one)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from hpcrlhf.engines.distributed import all_reduce_sum

Stats = dict[str, Sequence[float]]
"""Metric name -> (sum, count) over some samples; a count of 0 marks a plain sum (see `reduce_means`).
Running totals are the same shape with lists (`new_stats`)."""


def new_stats() -> Stats:
    """Empty running totals: every metric starts at [0.0, 0.0]."""
    return defaultdict(lambda: [0.0, 0.0])


def add_stats(sums: Stats, stats: Stats) -> Stats:
    """Add (sum, count) pairs into running [sum, count] totals (from `new_stats`)."""
    for key, (total, count) in stats.items():
        sums[key][0] += total
        sums[key][1] += count
    return sums


def reduce_means(sums: Stats, sum_divisor: int | None = None) -> dict[str, float]:
    """Sum (sum, count) pairs over ranks, then divide. A count of 0 marks a plain sum: divided by
    `sum_divisor` when given (e.g. mini-batch losses whose parts over micro-batches and ranks add
    up to one mini-batch's mean, averaged over the updates), else the metric is left out."""
    keys = sorted(sums)
    flat = all_reduce_sum([x for k in keys for x in sums[k]])
    out = {}
    for i, k in enumerate(keys):
        total, count = flat[2 * i], flat[2 * i + 1]
        if count > 0 or sum_divisor:
            out[k] = total / (count or sum_divisor)
    return out
