"""Masked statistics against independent references: hand-computed numbers, and float64
re-implementations written with plain Python loops over each row's masked positions and `math`.

Tolerances: atol 1e-5 for float32 inputs (sums of a few dozen O(1) terms), 1e-10 for float64.
"""

import math
import statistics

import pytest
import torch

from hpcrlhf.algos.masked import masked_mean, masked_sum, masked_whiten
from tests.algos.helpers import DTYPES, capture_sums, close, make_masks, plus, rows


def test_masked_sum_and_mean_by_hand():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("-inf"), 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    assert masked_sum(x, mask).item() == 13.0  # nan / -inf padding ignored
    assert masked_sum(x, mask.bool(), dim=1).tolist() == [3.0, 10.0, 0.0]
    assert masked_sum(x, mask, dim=0).tolist() == [5.0, 2.0, 6.0]
    assert masked_mean(x, mask).item() == 13.0 / 4
    assert masked_mean(x, mask, dim=1).tolist() == [1.5, 5.0, 0.0]  # empty row: 0, not NaN
    assert masked_mean(x, mask, dim=0).tolist() == [2.5, 2.0, 6.0]
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def ref_whiten(x, mask, shift_mean, eps):
    vals = [v for xr, mr in zip(rows(x), rows(mask)) for v, m in zip(xr, mr) if m]
    mean, var = statistics.fmean(vals), statistics.pvariance(vals)
    out = [[((v - mean) / math.sqrt(var + eps) + (0 if shift_mean else mean)) if m else 0.0 for v, m in zip(xr, mr)]
           for xr, mr in zip(rows(x), rows(mask))]
    return out, mean


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_reference_and_normalises(dtype, shift_mean):
    g = torch.Generator().manual_seed(0)
    for name, mask in make_masks(g).items():
        x = (torch.randn(mask.shape, generator=g, dtype=torch.float64) * 3 + 1.5).to(dtype)
        x = torch.where(mask, x, float("nan"))  # padding must not leak in
        out = masked_whiten(x, mask, shift_mean=shift_mean)
        want, mean = ref_whiten(x, mask, shift_mean, 1e-8)
        assert out.dtype == dtype
        close(out, want, dtype)
        assert torch.all(out[~mask] == 0), name
        vals = out[mask].double()
        center = mean if not shift_mean else 0.0
        assert abs(vals.mean().item() - center) < 1e-5
        assert abs((vals - vals.mean()).square().mean().item() - 1) < 1e-5  # population variance 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_whiten_is_global_over_fake_ranks(dtype):
    g = torch.Generator().manual_seed(1)
    for mask in make_masks(g, B=8).values():
        x = (torch.randn(mask.shape, generator=g, dtype=torch.float64) * 2 - 3).to(dtype)
        whole = masked_whiten(x, mask)
        (xa, xb), (ma, mb) = x.split(4), mask.split(4)
        sums_a = capture_sums(lambda r, x=xa, m=ma: masked_whiten(x, m, reduce=r))
        sums_b = capture_sums(lambda r, x=xb, m=mb: masked_whiten(x, m, reduce=r))
        split = torch.cat([masked_whiten(xa, ma, reduce=plus(sums_b)), masked_whiten(xb, mb, reduce=plus(sums_a))])
        # Same sums added in another order: equal up to float64 rounding of the statistics.
        assert torch.allclose(split, whole, atol=1e-12 if dtype == torch.float64 else 1e-6, rtol=0)
        # A single rank whitening only its half would give a different answer: the reduce matters.
        if ma.any() and mb.any() and mask.sum() > 3:
            assert not torch.allclose(masked_whiten(xa, ma), whole[:4], atol=1e-3)


def test_masked_whiten_constant_and_empty():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    out = masked_whiten(torch.full((2, 3), 4.0), mask)
    assert torch.equal(out, torch.zeros(2, 3))  # var 0: eps keeps it finite
    assert torch.equal(masked_whiten(torch.randn(2, 3), torch.zeros(2, 3)), torch.zeros(2, 3))
