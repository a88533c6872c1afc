"""Every seed a run derives from `seed`, in one place: which data rows, prompts, samples and
mini-batches a step draws is a pure function of (seed, step, rank, round), so a resumed run, a
rerun and the uninterrupted run draw the same ones. The values are fixed: changing a formula
changes what every run samples (tests/trainers/test_seeds.py pins them).
"""

from __future__ import annotations


def epoch_order_seed(seed: int, epoch: int) -> int:
    """The order of the training rows (or prompts) in an epoch (`batches.rows_for_step`)."""
    return seed + epoch


def refill_seed(seed: int, round: int) -> int:
    """The run's seed as a step's generation round sees it: the run's own for the first round,
    another per refill round of ppo.dynamic_sampling (a prompt order and sampling of its own, the
    same on every attempt)."""
    return seed + round * 1_000_033


def sampling_seed(seed: int, step: int, rank: int, round: int = 0) -> int:
    """The rollout engine's sampling seed for a rank's prompts at a step (and dynamic-sampling
    round): a resumed run generates exactly what the first run would have."""
    return refill_seed(seed, round) * 1_000_003 + step * 7919 + rank


def minibatch_seed(seed: int, step: int, rank: int) -> int:
    """The order of a rank's mini-batches at a PPO step: actor and critic see the same mini-batches."""
    return seed * 1_000_003 + step * 31 + rank


def selection_order_seed(seed: int, round: int) -> int:
    """The order in which rejection sampling trains on a round's selected responses."""
    return seed + 1000 * round


def eval_sampling_seed(seed: int) -> int:
    """The sampling seed of evaluation's sampled answers (`eval.samples_per_prompt`, `eval.temperature`):
    the same at every evaluation of a run, so its evaluations are compared on the same draws."""
    return seed * 1_000_003 + 999_983
