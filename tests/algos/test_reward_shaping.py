"""Reward shaping against independent references: hand-computed token rewards, a float64
re-implementation over each row's masked positions, and running moments against `statistics` on
the concatenated batches.

Tolerances: atol 1e-5 for float32 inputs (sums of a few dozen O(1) terms), 1e-10 for float64.
"""

import math
import statistics

import pytest
import torch

from hpcrlhf.algos.advantages import gae_advantages
from hpcrlhf.algos.reward_shaping import (RunningMoments, clip_rewards, normalize_scores, place_turn_rewards,
                                          shape_rewards)
from tests.algos.helpers import capture_sums, close, make_masks, plus, positions, rows

# ---- rewards ---------------------------------------------------------------------------------


def test_shape_rewards_by_hand():
    scores = torch.tensor([2.0, -1.0, 5.0], dtype=torch.float64)
    kl = torch.tensor([[0.1, 0.2, 0.3, float("nan")], [1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]])
    out = shape_rewards(scores, kl, mask, kl_coef=0.5)
    want = [[0.0, -0.1, -0.15 + 2.0, 0.0], [-0.5, 0.0, -1.5, -2.0 - 1.0], [0.0, 0.0, 0.0, 0.0]]
    close(out, want, torch.float64)
    # kl_coef = 0: the score alone, at the last masked token (after a hole in row 1).
    assert shape_rewards(scores, kl, mask, 0.0).tolist() == [[0, 0, 2, 0], [0, 0, 0, -1], [0, 0, 0, 0]]


def test_shape_rewards_random_vs_reference():
    g = torch.Generator().manual_seed(4)
    for mask in make_masks(g).values():
        scores, kl = torch.randn(mask.shape[0], generator=g), torch.randn(mask.shape, generator=g)
        out = shape_rewards(scores, kl, mask, 0.1)
        want = []
        for s, kr, mr in zip(scores.tolist(), rows(kl), rows(mask)):
            pos = positions(mr)
            row = [-0.1 * k if m else 0.0 for k, m in zip(kr, mr)]
            if pos:
                row[pos[-1]] += s
            want.append(row)
        close(out, want, torch.float32)


def test_turn_rewards_sit_at_their_turns_last_actions_and_gae_credits_each_to_the_turns_before_it():
    """A two-turn trajectory (model tokens at 0-1 and 4-5, the environment's at 2-3): its first turn
    was judged 1.0, the trajectory's end score is 0.5. Placed by turn, the first turn's actions see
    1.0 + 0.5 and the second's 0.5 alone (gamma = lam = 1, values 0); at the end, every action sees 1.5."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]])
    zero = torch.zeros(2, 6, dtype=torch.float64)
    end = shape_rewards(torch.tensor([0.5, 2.0], dtype=torch.float64), zero, mask, 0.0)
    turn = place_turn_rewards(end, [[1], [2, 2]], [[1.0], [0.25, -0.5]])  # two rewards at one position add up
    assert turn.tolist() == [[0, 1.0, 0, 0, 0, 0.5], [0, 0, 2.0 + 0.25 - 0.5, 0, 0, 0]]
    assert end.tolist()[0] == [0, 0, 0, 0, 0, 0.5]  # not changed in place
    advantages, _ = gae_advantages(turn, zero, mask, gamma=1.0, lam=1.0)
    assert advantages.tolist()[0] == [1.5, 1.5, 0, 0, 0.5, 0.5]
    whole, _ = gae_advantages(shape_rewards(torch.tensor([1.5, 0.0], dtype=torch.float64), zero, mask, 0.0), zero, mask,
                              gamma=1.0, lam=1.0)
    assert whole.tolist()[0] == [1.5, 1.5, 0, 0, 1.5, 1.5]
    with pytest.raises(ValueError, match="row 0: 2 turn rewards for 1 positions"):
        place_turn_rewards(end, [[1], []], [[1.0, 2.0], []])


def test_clip_rewards():
    s = torch.tensor([-7.0, -1.0, 0.5, 3.0])
    assert clip_rewards(s, None) is s
    assert clip_rewards(s, 2.0).tolist() == [-2.0, -1.0, 0.5, 2.0]
    with pytest.raises(ValueError, match="clip"):
        clip_rewards(s, 0.0)


# ---- running moments -------------------------------------------------------------------------


def test_running_moments_match_statistics_of_concatenation():
    g = torch.Generator().manual_seed(8)
    rm, seen = RunningMoments(), []
    assert (rm.mean, rm.std, rm.count) == (0.0, 1.0, 0.0)  # identity normalisation before data
    for n, shift in [(1, 100.0), (7, 100.0), (64, 95.0), (3, 120.0), (0, 0.0), (250, 101.0)]:
        x = torch.randn(n, generator=g, dtype=torch.float64) * 4 + shift
        seen += x.tolist()
        mean, std = rm.update(x.float() if n == 64 else x)  # mixed dtypes are fine
        if n == 64:
            seen[-64:] = x.float().double().tolist()
        assert rm.count == len(seen)
        assert mean == rm.mean == pytest.approx(statistics.fmean(seen), rel=1e-13, abs=1e-12)
        assert std == rm.std == pytest.approx(statistics.pstdev(seen), rel=1e-10, abs=1e-12)


def test_running_moments_split_across_fake_ranks_and_state_roundtrip():
    g = torch.Generator().manual_seed(9)
    whole, rank_a, rank_b = RunningMoments(), RunningMoments(), RunningMoments()
    for n_a, n_b in [(5, 3), (16, 16), (1, 0), (40, 9)]:
        xa = torch.randn(n_a, generator=g) * 2 + 7
        xb = torch.randn(n_b, generator=g) * 2 + 7
        whole.update(torch.cat([xa, xb]))
        probe = RunningMoments()
        probe.load_state_dict(rank_b.state_dict())
        sums_b = capture_sums(lambda r, p=probe, x=xb: p.update(x, reduce=r))
        probe.load_state_dict(rank_a.state_dict())
        sums_a = capture_sums(lambda r, p=probe, x=xa: p.update(x, reduce=r))
        ma = rank_a.update(xa, reduce=plus(sums_b))
        mb = rank_b.update(xb, reduce=plus(sums_a))
        assert ma == pytest.approx(mb, rel=1e-14) and ma == pytest.approx((whole.mean, whole.std), rel=1e-12)
        assert rank_a.count == rank_b.count == whole.count
    restored = RunningMoments()
    restored.load_state_dict(whole.state_dict())
    assert restored.state_dict() == whole.state_dict() and restored.std == whole.std
    x = torch.randn(10, generator=g)
    assert restored.update(x) == whole.update(x)


def test_normalize_scores_uses_current_moments():
    rm = RunningMoments()
    s = torch.tensor([1.0, 3.0])
    assert torch.allclose(normalize_scores(s, rm), s)  # mean 0, std 1 before data
    rm.update(torch.tensor([2.0, 4.0, 6.0, 8.0]))  # mean 5, population std sqrt(5)
    out = normalize_scores(s, rm, eps=0.0)
    assert torch.allclose(out, (s - 5) / math.sqrt(5), atol=1e-7) and out.dtype == torch.float32
