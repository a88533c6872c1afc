import math

import pytest

from hpcrlhf.engines.schedule import lr_multiplier


def test_warmup_then_cosine_by_hand():
    def f(s: int) -> float:
        return lr_multiplier(s, total_steps=11, warmup_steps=2, kind="cosine", min_ratio=0.1)

    assert f(0) == pytest.approx(1 / 3) and f(1) == pytest.approx(2 / 3)
    assert f(2) == pytest.approx(1.0)
    # halfway through the 8 decay steps (step 2 + 4): 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55
    assert f(6) == pytest.approx(0.55)
    assert f(10) == pytest.approx(0.1)


def test_linear_and_constant():
    def lin(s: int) -> float:
        return lr_multiplier(s, total_steps=5, warmup_steps=0, kind="linear", min_ratio=0.0)

    assert [round(lin(s), 6) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert lr_multiplier(3, total_steps=5, warmup_steps=0, kind="constant", min_ratio=0.0) == 1.0
    assert math.isclose(lr_multiplier(0, total_steps=1, warmup_steps=0, kind="cosine", min_ratio=0.2), 1.0)
