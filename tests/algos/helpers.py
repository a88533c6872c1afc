"""Helpers shared by the RL maths tests: tolerances per dtype, a float64 comparison, a two-rank
all-reduce simulated in one process (`capture_sums` records one rank's local sums, `plus(other)`
adds the other rank's), and masks of every shape the per-token functions must handle."""

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


def make_masks(g, B=6, T=9):
    """Masks of every shape the functions must handle: prompt + response + padding, holes inside
    the response, all-zero and all-one rows, and fully random."""
    contiguous = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        start = int(torch.randint(0, T // 2, (1,), generator=g))
        end = int(torch.randint(start + 1, T + 1, (1,), generator=g))
        contiguous[b, start:end] = True
    holes = contiguous & (torch.rand(B, T, generator=g) < 0.7)
    holes[0] = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1, 0][:T], dtype=torch.bool)
    empty_rows = contiguous.clone()
    empty_rows[[1, 4]] = False
    full = torch.ones(B, T, dtype=torch.bool)
    scattered = torch.rand(B, T, generator=g) < 0.5
    scattered[2] = False
    return {"contiguous": contiguous, "holes": holes, "empty_rows": empty_rows, "full": full, "scattered": scattered}


def rows(t):
    return t.tolist()


def positions(mask_row):
    return [t for t, m in enumerate(mask_row) if m]
