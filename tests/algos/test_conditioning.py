"""Reward buckets of conditional SFT against hand-computed edges."""

import pytest

from hpcrlhf.algos.conditioning import bucket_edges, bucket_of


def test_equal_width_edges_and_buckets():
    edges = bucket_edges([0.0, 1.0, 0.3, 0.9], 4)
    assert edges == pytest.approx([0.25, 0.5, 0.75])
    assert [bucket_of(r, edges) for r in (0.0, 0.2, 0.25, 0.6, 0.75, 1.0, 7.0, -3.0)] == [0, 0, 1, 2, 3, 3, 3, 0]
    assert bucket_edges([2.0, -2.0], 2) == [0.0]


def test_degenerate_inputs():
    with pytest.raises(ValueError, match="rewards that differ"):
        bucket_edges([1.0, 1.0], 2)
    with pytest.raises(ValueError, match="at least 2 buckets"):
        bucket_edges([0.0, 1.0], 1)
