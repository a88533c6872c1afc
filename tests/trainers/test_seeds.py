"""The seed formulas, pinned: a resumed run, a rerun, and a run on another hpcrlhf version draw the
same prompts, samples and mini-batches only while these values stay what they were."""

from hpcrlhf.trainers.seeds import (epoch_order_seed, eval_sampling_seed, minibatch_seed, refill_seed, sampling_seed,
                                   selection_order_seed)


def test_every_formula_keeps_its_values():
    assert [refill_seed(42, r) for r in (0, 1, 2)] == [42, 1_000_075, 2_000_108]
    assert sampling_seed(42, step=3, rank=1) == 42 * 1_000_003 + 3 * 7919 + 1 == 42_023_884
    assert sampling_seed(42, step=3, rank=1, round=2) == 2_000_108 * 1_000_003 + 3 * 7919 + 1
    assert minibatch_seed(42, step=3, rank=1) == 42 * 1_000_003 + 3 * 31 + 1 == 42_000_220
    assert epoch_order_seed(42, epoch=2) == 44
    assert selection_order_seed(42, round=3) == 3042
    assert eval_sampling_seed(42) == 42 * 1_000_003 + 999_983 == 43_000_109


def test_streams_differ_where_they_must():
    """Ranks, steps and refill rounds sample differently; actor and critic share mini-batches
    (one formula of (seed, step, rank) for both)."""
    seeds = {sampling_seed(0, step, rank, r) for step in range(50) for rank in range(8) for r in range(3)}
    assert len(seeds) == 50 * 8 * 3
    assert len({minibatch_seed(7, step, rank) for step in range(20) for rank in range(8)}) == 160
