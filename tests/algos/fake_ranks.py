"""Helpers shared by the RL maths tests: tolerances per dtype, a float64 comparison, and a
two-rank all-reduce simulated in one process (`capture_sums` records one rank's local sums,
`plus(other)` adds the other rank's)."""

from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.float64]
ATOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def close(got, want, dtype):
    got = torch.as_tensor(got, dtype=torch.float64)
    want = torch.as_tensor(want, dtype=torch.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.allclose(got, want, atol=ATOL[dtype], rtol=0), (got, want)


def capture_sums(call):
    """Run call(reduce) with a reduce that records this 'rank's local sums and returns them unchanged."""
    seen = []

    def cap(vals):
        seen.append(list(vals))
        return list(vals)

    call(cap)
    assert len(seen) == 1, "reduce must be called exactly once"
    return seen[0]


def plus(other):
    """A fake all-reduce for 2 ranks: adds the other rank's local sums."""
    return lambda vals: [a + b for a, b in zip(vals, other)]
