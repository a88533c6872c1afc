"""pass@k against the closed form with exact binomials (fractions), and by hand; the majority vote by hand."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from hpcrlhf.algos.pass_at_k import majority, pass_at_k


def exact(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.parametrize("n", [1, 2, 5, 16, 100, 200])
def test_pass_at_k_is_the_closed_form_for_every_count_and_k(n):
    for c in range(n + 1):
        for k in sorted({1, min(2, n), n // 2 or 1, n}):
            assert pass_at_k(n, c, k) == pytest.approx(float(exact(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == 0.25  # one correct in four: a single draw finds it a quarter of the time
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 2, 3) == 1.0  # none; fewer wrong than draws
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the share correct


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_counts_it_is_not_defined_for(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_the_majority_is_the_first_sample_of_the_most_common_answer():
    assert majority(["12", " 7", "7 ", None, "12", "7"]) == 1  # "7" three times (stripped) beats "12" twice
    assert majority(["3", "4", "4", "3"]) == 0  # a tie: the answer seen first
    assert majority([None, None]) is None and majority([]) is None
    assert majority([None, "5"]) == 1
