"""PPO maths against independent references: hand-computed numbers, and float64 re-implementations
written with plain Python loops over each row's masked positions and `math`.

The GAE reference uses the closed form A_t = sum_l (gamma lam)^l delta_{t+l} rather than the
backward recursion of the implementation, and returns-to-go the explicit discounted sum, so a
shared mistake in the recursion cannot pass. Tolerances: atol 1e-5 for float32 inputs (sums of a
few dozen O(1) terms), 1e-10 for float64.
"""

import math
import statistics

import pytest
import torch

from hpcrlhf.algos.ppo import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    aggregate_loss,
    build_kl_controller,
    clip_rewards,
    discounted_returns,
    entropy_from_logits,
    gae_advantages,
    kl_estimate,
    masked_mean,
    masked_sum,
    masked_whiten,
    normalize_scores,
    policy_loss,
    shape_rewards,
    truncated_is_weights,
    value_loss,
)
from tests.algos.fake_ranks import DTYPES, capture_sums, close, plus


# ---- shared helpers --------------------------------------------------------------------------


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


# ---- masked statistics -----------------------------------------------------------------------


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
        sums_a = capture_sums(lambda r: masked_whiten(xa, ma, reduce=r))
        sums_b = capture_sums(lambda r: masked_whiten(xb, mb, reduce=r))
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


# ---- KL estimators ---------------------------------------------------------------------------


def ref_kl(lp, rp, est):
    lr = min(max(lp - rp, -20.0), 20.0)  # every estimator bounded (a -inf log-prob must not give inf)
    if est == "k1":
        return lr
    if est == "k2":
        return 0.5 * lr * lr
    return math.exp(-lr) - 1 + lr


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("est", KL_ESTIMATORS)
def test_kl_estimators_match_formulas(dtype, est):
    g = torch.Generator().manual_seed(2)
    logp = (-torch.rand(5, 7, generator=g, dtype=torch.float64) * 4).to(dtype)
    ref = (-torch.rand(5, 7, generator=g, dtype=torch.float64) * 4).to(dtype)
    mask = torch.rand(5, 7, generator=g) < 0.6
    out = kl_estimate(logp, ref, est)
    assert out.dtype == dtype
    want = [[ref_kl(a, b, est) for a, b in zip(ra, rb)] for ra, rb in zip(rows(logp), rows(ref))]
    close(out, want, dtype)
    masked = kl_estimate(logp, ref, est, mask)
    close(masked, [[w if m else 0.0 for w, m in zip(rw, rm)] for rw, rm in zip(want, rows(mask))], dtype)
    assert torch.all(masked[~mask] == 0)


def test_k3_is_nonnegative_and_finite_at_extremes():
    lr = torch.tensor([-1e4, -100.0, -20.0, -1e-7, 0.0, 1e-7, 3.0, 100.0, 1e4])
    k3 = kl_estimate(lr, torch.zeros_like(lr), "k3")
    assert torch.all(torch.isfinite(k3)) and torch.all(k3 >= 0)
    assert k3[0].item() == pytest.approx(math.exp(20) - 21, rel=1e-6)  # clamped at -20
    assert k3[-1].item() == pytest.approx(math.exp(-20) + 19, rel=1e-6)
    assert k3[4].item() == 0.0
    # Near 0, k3 = lr^2 / 2 - lr^3 / 6 + ...; in fp32 the naive exp(-lr) - 1 + lr is off by ~10%
    # at lr = 1e-3 (one ulp of exp(-lr) is 6e-8 against a result of 5e-7); expm1 gets ~1e-4.
    lr_small = torch.tensor([1e-3])
    small = kl_estimate(lr_small, torch.tensor([0.0]), "k3").item()
    assert small == pytest.approx(0.5e-6 - 1e-9 / 6, rel=1e-3)
    assert abs((torch.exp(-lr_small) - 1 + lr_small).item() - small) > 1e-8
    # A -inf reference log-prob (token the reference cannot produce) stays finite.
    inf_ref = kl_estimate(torch.tensor([-1.0]), torch.tensor([float("-inf")]), "k3")
    assert torch.isfinite(inf_ref).all()
    with pytest.raises(ValueError, match=r"k1.*k2.*k3.*'k4'"):
        kl_estimate(lr, lr, "k4")


@pytest.mark.parametrize("est", KL_ESTIMATORS)
def test_every_kl_estimator_is_bounded_where_a_log_prob_is_minus_inf(est):
    """A token the reference cannot produce (log-prob -inf), or the policy cannot, or a huge
    finite gap: each estimate is the float64 formula at the clamped log-ratio (+-20), never inf."""
    logp = torch.tensor([-1.0, float("-inf"), -1.0, -3.0, -1e4, 0.0])
    ref = torch.tensor([float("-inf"), -1.0, -1e4, -1.0, 0.0, -30.0])
    out = kl_estimate(logp, ref, est)
    assert torch.isfinite(out).all(), out
    want = [ref_kl(a, b, est) for a, b in zip(logp.tolist(), ref.tolist())]
    assert out.tolist() == pytest.approx(want, rel=1e-6)
    assert out[0].item() == pytest.approx({"k1": 20.0, "k2": 200.0, "k3": math.exp(-20) + 19}[est], rel=1e-6)


def test_kl_estimate_gradient_flows_to_policy():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    kl_estimate(logp, ref, "k3").sum().backward()
    lr = (logp - ref).detach()
    assert torch.allclose(logp.grad, 1 - torch.exp(-lr), atol=1e-12)  # d/dlr (e^-lr - 1 + lr)


P = [0.5, 0.3, 0.2]
Q_FAR = [0.25, 0.25, 0.5]


def true_kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def per_category(p, q, est):
    """Estimator value for each category when sampling it from p."""
    lp, lq = torch.tensor(p, dtype=torch.float64).log(), torch.tensor(q, dtype=torch.float64).log()
    return kl_estimate(lp, lq, est).tolist()


def test_k1_and_k3_are_unbiased_exactly():
    # E_p[k] = sum_i p_i k(i): no sampling noise, so equality to 1e-12.
    kl = true_kl(P, Q_FAR)
    for est in ("k1", "k3"):
        assert sum(p * k for p, k in zip(P, per_category(P, Q_FAR, est))) == pytest.approx(kl, abs=1e-12)
    # k2 is biased for distributions this far apart (KL 0.218, E[k2] 0.227).
    assert abs(sum(p * k for p, k in zip(P, per_category(P, Q_FAR, "k2"))) - kl) > 0.005


def test_k1_and_k3_monte_carlo_converge_to_kl():
    g = torch.Generator().manual_seed(3)
    n = 100_000
    idx = torch.multinomial(torch.tensor(P), n, replacement=True, generator=g)
    logp, ref = torch.tensor(P).log()[idx], torch.tensor(Q_FAR).log()[idx]
    kl = true_kl(P, Q_FAR)
    for est in ("k1", "k3"):
        ks = per_category(P, Q_FAR, est)
        sd = math.sqrt(sum(p * (k - kl) ** 2 for p, k in zip(P, ks)))  # exact per-sample std
        mean = kl_estimate(logp, ref, est).double().mean().item()
        # 5 standard errors of a mean of n i.i.d. samples: a correct estimator fails w.p. ~6e-7.
        assert abs(mean - kl) < 5 * sd / math.sqrt(n), (est, mean, kl)


def test_k2_and_k3_close_to_kl_for_close_distributions():
    q = [0.49, 0.31, 0.20]
    kl = true_kl(P, q)
    max_u = max(abs(b / a - 1) for a, b in zip(P, q))
    # With u = q/p - 1: E[k2] - KL = -E[u^3]/6 + O(u^4), so within max|u| * KL.
    for est in ("k2", "k3"):
        assert abs(sum(p * k for p, k in zip(P, per_category(P, q, est))) - kl) <= max_u * kl


# ---- KL controllers --------------------------------------------------------------------------


def test_adaptive_kl_controller_hand_sequence():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    steps = [
        (9.0, 1000, 0.1 * 1.02),  # 9/6 - 1 = 0.5 -> clipped to 0.2; 1 + 0.2 * 0.1
        (3.0, 1000, 0.102 * 0.98),  # -0.5 -> clipped to -0.2
        (6.6, 500, 0.09996 * 1.005),  # 0.1 (inside the clip); 1 + 0.1 * 0.05
        (5.4, 2000, 0.1004598 * 0.98),  # -0.1; 1 - 0.1 * 0.2
        (6.0, 5000, 0.098450604),  # on target: unchanged
    ]
    for kl, n, want in steps:
        ctl.update(kl, n)
        assert ctl.value == pytest.approx(want, rel=1e-12)
    state = ctl.state_dict()
    other = AdaptiveKLController(0.5, target=6.0, horizon=10_000)
    other.load_state_dict(state)
    assert other.value == ctl.value
    ctl.update(100.0, 10_000)
    other.update(100.0, 10_000)
    assert other.value == ctl.value == pytest.approx(0.098450604 * 1.2)


def test_fixed_kl_controller_and_builder():
    ctl = build_kl_controller(0.05, None, 10_000)
    assert isinstance(ctl, FixedKLController)
    for kl in [0.0, 1.0, 100.0]:
        ctl.update(kl, 512)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05
    adaptive = build_kl_controller(0.05, 6.0, 10_000)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.05
    assert (adaptive.target, adaptive.horizon) == (6.0, 10_000)
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, 0.0, 10)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 1.0, 0)


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


def test_clip_rewards():
    s = torch.tensor([-7.0, -1.0, 0.5, 3.0])
    assert clip_rewards(s, None) is s
    assert clip_rewards(s, 2.0).tolist() == [-2.0, -1.0, 0.5, 2.0]
    with pytest.raises(ValueError, match="clip"):
        clip_rewards(s, 0.0)


# ---- GAE and returns ---------------------------------------------------------------------------


def ref_gae(rewards, values, mask, gamma, lam):
    """Closed form over each row's masked positions: A_k = sum_{j>=k} (gamma lam)^(j-k) delta_j,
    delta_j = r_j + gamma V_{j+1} - V_j, V after the last masked token = 0."""
    adv, ret = [], []
    for rr, vr, mr in zip(rows(rewards), rows(values), rows(mask)):
        pos = positions(mr)
        r = [rr[t] for t in pos]
        v = [vr[t] for t in pos] + [0.0]
        deltas = [r[j] + gamma * v[j + 1] - v[j] for j in range(len(r))]
        a_row, g_row = [0.0] * len(mr), [0.0] * len(mr)
        for k, t in enumerate(pos):
            a = sum((gamma * lam) ** (j - k) * deltas[j] for j in range(k, len(r)))
            a_row[t], g_row[t] = a, a + v[k]
        adv.append(a_row)
        ret.append(g_row)
    return adv, ret


def ref_returns(rewards, mask, gamma):
    out = []
    for rr, mr in zip(rows(rewards), rows(mask)):
        pos = positions(mr)
        row = [0.0] * len(mr)
        for k, t in enumerate(pos):
            row[t] = sum(gamma ** (j - k) * rr[pos[j]] for j in range(k, len(pos)))
        out.append(row)
    return out


def test_gae_hand_examples():
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    m = torch.ones(1, 3)
    # gamma = lam = 1: A_t = (sum of future rewards) - V_t = 1 - V_t.
    adv, ret = gae_advantages(r, v, m, 1.0, 1.0)
    close(adv, [[0.5, 0.4, 0.3]], torch.float64)
    close(ret, [[1.0, 1.0, 1.0]], torch.float64)
    # gamma = 0.9, lam = 0.8 (gamma lam = 0.72):
    #   t=2: delta = 1 + 0.9 * 0     - 0.7 = 0.3;   A = 0.3
    #   t=1: delta = 0 + 0.9 * 0.7   - 0.6 = 0.03;  A = 0.03 + 0.72 * 0.3   = 0.246
    #   t=0: delta = 0 + 0.9 * 0.6   - 0.5 = 0.04;  A = 0.04 + 0.72 * 0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    adv, ret = gae_advantages(r, v, m, 0.9, 0.8)
    close(adv, [[0.21712, 0.246, 0.3]], torch.float64)
    close(ret, [[0.71712, 0.846, 1.0]], torch.float64)
    # The same episode spread over a row with padding and a hole: identical numbers at the masked
    # tokens, exact zeros elsewhere, whatever garbage sits at the masked-out positions.
    nan = float("nan")
    r2 = torch.tensor([[nan, 0.0, 5.0, 0.0, 1.0, nan]], dtype=torch.float64)
    v2 = torch.tensor([[nan, 0.5, 9.0, 0.6, 0.7, nan]], dtype=torch.float64)
    m2 = torch.tensor([[0, 1, 0, 1, 1, 0]])
    adv, ret = gae_advantages(r2, v2, m2, 0.9, 0.8)
    assert adv.tolist()[0][0] == adv.tolist()[0][2] == adv.tolist()[0][5] == 0.0
    close(adv, [[0.0, 0.21712, 0.0, 0.246, 0.3, 0.0]], torch.float64)
    close(ret, [[0.0, 0.71712, 0.0, 0.846, 1.0, 0.0]], torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8), (0.99, 0.0)])
def test_gae_matches_reference_on_random_masks(dtype, gamma, lam):
    g = torch.Generator().manual_seed(5)
    for name, mask in make_masks(g).items():
        r = torch.randn(mask.shape, generator=g, dtype=torch.float64).to(dtype)
        v = torch.randn(mask.shape, generator=g, dtype=torch.float64).to(dtype)
        adv, ret = gae_advantages(r, v, mask, gamma, lam)
        want_adv, want_ret = ref_gae(r, v, mask, gamma, lam)
        assert adv.dtype == ret.dtype == dtype, name
        close(adv, want_adv, dtype)
        close(ret, want_ret, dtype)
        assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)


def test_gae_detaches_inputs_and_lam_zero_is_td():
    r = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    m = torch.ones(2, 4)
    adv, ret = gae_advantages(r, v, m, 0.9, 0.0)
    assert not adv.requires_grad and not ret.requires_grad
    next_v = torch.cat([v[:, 1:], torch.zeros(2, 1, dtype=torch.float64)], 1)
    assert torch.allclose(adv, (r + 0.9 * next_v - v).detach(), atol=1e-12)  # one-step TD error


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_discounted_returns_match_reference(dtype, gamma):
    g = torch.Generator().manual_seed(6)
    for mask in make_masks(g).values():
        r = torch.randn(mask.shape, generator=g, dtype=torch.float64).to(dtype)
        r = torch.where(mask, r, float("inf"))
        out = discounted_returns(r, mask, gamma)
        assert out.dtype == dtype
        close(out, ref_returns(r, mask, gamma), dtype)
        assert torch.all(out[~mask] == 0)
    # By hand: rewards 1, 2, 3 at masked positions 0, 2, 3 of a row with a hole, gamma 0.5:
    # G = [1 + 0.5 * (2 + 0.5 * 3), 0, 2 + 0.5 * 3, 3] = [2.75, 0, 3.5, 3]
    out = discounted_returns(torch.tensor([[1.0, 9.0, 2.0, 3.0, 9.0]]), torch.tensor([[1, 0, 1, 1, 0]]), 0.5)
    assert out.tolist() == [[2.75, 0.0, 3.5, 3.0, 0.0]]


def test_gae_with_lam_one_equals_returns_minus_values():
    g = torch.Generator().manual_seed(7)
    for mask in make_masks(g).values():
        r, v = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
        adv, ret = gae_advantages(r, v, mask, 0.95, 1.0)
        assert torch.allclose(ret, discounted_returns(r, mask, 0.95), atol=1e-5)
        assert torch.allclose(adv, torch.where(mask, ret - v, 0), atol=1e-5)


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
        sums_b = capture_sums(lambda r: probe.update(xb, reduce=r))
        probe.load_state_dict(rank_a.state_dict())
        sums_a = capture_sums(lambda r: probe.update(xa, reduce=r))
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


# ---- policy loss -----------------------------------------------------------------------------


def ref_ppo_token(log_ratio, a, low, high, dual):
    """Per-token PPO loss with the branches spelled out; returns (loss, clipped, grad wrt logp)."""
    r = math.exp(log_ratio)
    if a > 0:
        # objective a * min(r, 1 + high): only the upper clip can bind for a positive advantage.
        if r > 1 + high:
            return -a * (1 + high), True, 0.0
        return -a * r, False, -a * r
    if a < 0:
        # objective a * max(r, 1 - low): only the lower clip can bind for a negative advantage.
        if r < 1 - low:
            loss, clipped, grad = -a * (1 - low), True, 0.0
        else:
            loss, clipped, grad = -a * r, False, -a * r
        if dual is not None and loss > -a * dual:  # dual clip: cap the loss at -a * c
            return -a * dual, clipped, 0.0
        return loss, clipped, grad
    return 0.0, False, 0.0


def ref_aggregate(loss, mask, mode, normalizer=None):
    kept = [[v for v, m in zip(lr, mr) if m] for lr, mr in zip(loss, mask)]
    if mode == "token-mean":
        num, den = sum(sum(k) for k in kept), sum(len(k) for k in kept)
    elif mode == "seq-mean-token-mean":
        num, den = sum(sum(k) / len(k) for k in kept if k), sum(1 for k in kept if k)
    else:
        num, den = sum(sum(k) for k in kept), len(kept)
    return num / (normalizer if normalizer is not None else max(den, 1))


BRANCHES = [
    # (ratio, advantage, expected loss, clipping active, dual clip active) for low 0.2, high 0.3, dual 3
    (1.1, 1.0, -1.1, False, False),  # a > 0, inside
    (1.5, 1.0, -1.3, True, False),  # a > 0, above 1 + high: clipped
    (0.5, 1.0, -0.5, False, False),  # a > 0, below 1 - low: not clipped (pessimistic min)
    (1.25, 2.0, -2.5, False, False),  # inside only because clip is asymmetric (would clip at 1.2)
    (0.9, -1.0, 0.9, False, False),  # a < 0, inside
    (0.5, -1.0, 0.8, True, False),  # a < 0, below 1 - low: clipped
    (2.0, -1.0, 2.0, False, False),  # a < 0, above 1 + high: not clipped, under the dual cap
    (5.0, -1.0, 3.0, False, True),  # a < 0, ratio above dual 3: capped at 3
    (5.0, -0.5, 1.5, False, True),
    (1.7, 0.0, 0.0, False, False),  # zero advantage
]


@pytest.mark.parametrize("ratio,adv,want,clipped,dual_active", BRANCHES)
def test_policy_loss_branches_by_hand(ratio, adv, want, clipped, dual_active):
    logp = torch.tensor([[math.log(ratio) - 1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    a, m = torch.tensor([[adv]], dtype=torch.float64), torch.ones(1, 1)
    loss, stats = policy_loss(logp, old, a, m, clip_eps_low=0.2, clip_eps_high=0.3, dual_clip=3.0)
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert stats["clipfrac_sum"].item() == float(clipped) and stats["tokens"].item() == 1.0
    assert stats["ratio_sum"].item() == pytest.approx(ratio, rel=1e-12)
    assert stats["approx_kl_sum"].item() == pytest.approx(0.5 * math.log(ratio) ** 2, abs=1e-12)
    loss.backward()
    # Where clipping or the dual cap is active the loss is flat in logp: gradient exactly 0.
    if clipped or dual_active or adv == 0:
        assert logp.grad.item() == 0.0
    else:
        assert logp.grad.item() == pytest.approx(-adv * ratio, rel=1e-12)
    assert loss.item() == pytest.approx(ref_ppo_token(math.log(ratio), adv, 0.2, 0.3, 3.0)[0], abs=1e-12)
    if not dual_active:  # without dual clip these tokens are unchanged
        plain, _ = policy_loss(logp, old, a, m, clip_eps_low=0.2, clip_eps_high=0.3)
        assert plain.item() == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("low,high,dual", [(0.2, None, None), (0.2, 0.28, None), (0.1, 0.3, 2.0)])
def test_policy_loss_matches_reference(dtype, mode, low, high, dual):
    g = torch.Generator().manual_seed(10)
    for mask in make_masks(g).values():
        old = (-torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3).to(dtype)
        logp = (old.double() + torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.4).to(dtype)
        adv = torch.randn(mask.shape, generator=g, dtype=torch.float64).to(dtype)
        leaf = logp.clone().requires_grad_()
        loss, stats = policy_loss(
            leaf, old, adv, mask, clip_eps_low=low, clip_eps_high=high, dual_clip=dual, aggregation=mode
        )
        hi = low if high is None else high
        per_tok = [
            [ref_ppo_token(a - b, c, low, hi, dual) for a, b, c in zip(ra, rb, rc)]
            for ra, rb, rc in zip(rows(logp), rows(old), rows(adv))
        ]
        losses = [[t[0] for t in row] for row in per_tok]
        assert loss.dtype == dtype and loss.shape == ()
        close(loss, ref_aggregate(losses, rows(mask), mode), dtype)
        keep = rows(mask)
        flat = [(t, m) for rt, rm in zip(per_tok, keep) for t, m in zip(rt, rm)]
        assert stats["clipfrac_sum"].item() == sum(t[1] for t, m in flat if m)
        assert stats["tokens"].item() == mask.sum().item()
        lr = [(a - b, m) for ra, rb, rm in zip(rows(logp), rows(old), keep) for a, b, m in zip(ra, rb, rm)]
        close(stats["ratio_sum"], sum(math.exp(x) for x, m in lr if m), dtype)
        close(stats["approx_kl_sum"], sum(0.5 * x * x for x, m in lr if m), dtype)
        assert all(not s.requires_grad for s in stats.values())
        if mode == "token-mean" and mask.any():
            loss.backward()
            n = mask.sum().item()
            grads = [[t[2] / n if m else 0.0 for t, m in zip(rt, rm)] for rt, rm in zip(per_tok, keep)]
            close(leaf.grad, grads, dtype)


def test_truncated_is_weights_by_hand_and_in_the_loss():
    """min(exp(old - behaviour), cap) per token, 0 off the mask; the loss takes them as per-token
    multipliers of the clipped surrogate (value and gradient), whatever the aggregation."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.2, -1.0, -0.5, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    w = truncated_is_weights(old, behaviour, mask, cap=2.0)
    assert w[0].tolist() == pytest.approx([math.exp(0.2), math.exp(-1.0), 1.0, 0.0], abs=1e-15)
    assert truncated_is_weights(old, behaviour - 5, mask, cap=2.0)[0, :3].tolist() == pytest.approx([2.0] * 3)
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(old, behaviour, mask, cap=0.0)
    g = torch.Generator().manual_seed(12)
    for mode in LOSS_AGGREGATIONS:
        for mask in make_masks(g).values():
            old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
            logp = (old + torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.4).requires_grad_()
            adv = torch.randn(mask.shape, generator=g, dtype=torch.float64)
            weights = torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2
            loss, _ = policy_loss(logp, old, adv, mask, clip_eps_low=0.2, aggregation=mode, token_weights=weights)
            per_tok = [[w * ref_ppo_token(a - b, c, 0.2, 0.2, None)[0] for a, b, c, w in zip(ra, rb, rc, rw)]
                       for ra, rb, rc, rw in zip(rows(logp.detach()), rows(old), rows(adv), rows(weights))]
            close(loss, ref_aggregate(per_tok, rows(mask), mode), torch.float64)
            if mode == "token-mean" and mask.any():
                loss.backward()
                n = mask.sum().item()
                grads = [[w * ref_ppo_token(a - b, c, 0.2, 0.2, None)[2] / n if m else 0.0
                          for a, b, c, w, m in zip(ra, rb, rc, rw, rm)]
                         for ra, rb, rc, rw, rm in zip(rows(logp.detach()), rows(old), rows(adv), rows(weights),
                                                       rows(mask))]
                close(logp.grad, grads, torch.float64)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_normalizer_makes_micro_batches_sum_to_the_full_batch(mode):
    g = torch.Generator().manual_seed(11)
    mask = make_masks(g, B=8)["empty_rows"]
    mask[5] = False
    old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    kw = dict(clip_eps_low=0.2, aggregation=mode)
    whole, _ = policy_loss(logp, old, adv, mask, **kw)
    (whole_grad,) = torch.autograd.grad(whole, logp)
    counts = {
        "token-mean": mask.sum().item(),
        "seq-mean-token-mean": mask.any(-1).sum().item(),
        "seq-mean-token-sum": mask.shape[0],
    }
    total = 0.0
    for idx in [slice(0, 2), slice(2, 5), slice(5, 8)]:  # uneven micro-batches, one with an empty row
        micro, _ = policy_loss(logp[idx], old[idx], adv[idx], mask[idx], normalizer=counts[mode], **kw)
        micro.backward()
        total += micro.item()
    assert total == pytest.approx(whole.item(), abs=1e-12)
    assert torch.allclose(logp.grad, whole_grad, atol=1e-12)
    # Without the global normaliser, averaging uneven micro-batches' means is not the full-batch loss.
    means = [policy_loss(logp[i], old[i], adv[i], mask[i], **kw)[0].item() for i in (slice(0, 2), slice(2, 8))]
    assert sum(means) / 2 != pytest.approx(whole.item(), abs=1e-6)


def test_policy_loss_invalid_arguments():
    x, m = torch.zeros(1, 2), torch.ones(1, 2)
    for c in [1.0, 0.5]:
        with pytest.raises(ValueError, match="dual_clip must be > 1"):
            policy_loss(x, x, x, m, clip_eps_low=0.2, dual_clip=c)
    with pytest.raises(ValueError, match="clip_eps"):
        policy_loss(x, x, x, m, clip_eps_low=-0.1)
    with pytest.raises(ValueError, match="token-mean"):
        policy_loss(x, x, x, m, clip_eps_low=0.2, aggregation="sum")


@pytest.mark.parametrize("dual", [None, 3.0])
def test_gspo_is_the_sequence_ratio_objective_and_its_gradient(dual):
    """ratio_level="sequence" against GSPO written directly in float64 (Zheng et al. 2025, eq. 5-7):
    s_i = exp(mean over the response of log pi - log pi_old), loss = mean_i max(-A_i s_i,
    -A_i clip(s_i, 1 - low, 1 + high)) (dual clip on A_i < 0), autograd through s_i. Value and
    gradient with respect to every token log-prob must agree, with whole responses clipped."""
    g = torch.Generator().manual_seed(3)
    B, T = 6, 5
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    shift = torch.tensor([0.3, -0.3, 0.01, -0.02, 0.2, 1.5], dtype=torch.float64).unsqueeze(-1)
    logp = (old + shift + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0],
                         [1, 1, 1, 1, 1]], dtype=torch.bool)
    seq_adv = torch.tensor([1.0, -0.5, 2.0, -1.5, -1.0, -0.7], dtype=torch.float64)
    adv = seq_adv.unsqueeze(-1).expand(B, T) * mask
    low, high = 0.05, 0.08
    loss, stats = policy_loss(logp, old, adv, mask, clip_eps_low=low, clip_eps_high=high, dual_clip=dual,
                              aggregation="seq-mean-token-mean", ratio_level="sequence")
    loss.backward()

    reference = logp.detach().clone().requires_grad_()
    terms, clipped = [], 0
    for i in range(B):
        m = mask[i].double()
        s_i = torch.exp(((reference[i] - old[i]) * m).sum() / m.sum())
        term = torch.maximum(-seq_adv[i] * s_i, -seq_adv[i] * s_i.clamp(1 - low, 1 + high))
        if dual is not None and seq_adv[i] < 0:
            term = torch.minimum(term, -seq_adv[i] * dual)
        clipped += int(not (1 - low <= s_i.item() <= 1 + high))
        terms.append(term)
    want = torch.stack(terms).mean()
    want.backward()
    assert clipped >= 2 and clipped < B  # the case has clipped and unclipped responses
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(logp.grad, reference.grad, rtol=1e-10, atol=1e-14)
    assert torch.all(logp.grad[~mask] == 0)
    token_level, _ = policy_loss(logp.detach(), old, adv, mask, clip_eps_low=low, clip_eps_high=high, dual_clip=dual,
                                 aggregation="seq-mean-token-mean")
    assert token_level.item() != pytest.approx(loss.item(), rel=1e-6)  # not the per-token ratio
    with pytest.raises(ValueError, match="ratio_level must be one of"):
        policy_loss(logp, old, adv, mask, clip_eps_low=low, ratio_level="group")


def test_policy_loss_extreme_ratio_stays_finite():
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-200.0, 200.0]])
    adv = torch.tensor([[-1.0, 1.0]])
    loss, stats = policy_loss(logp, old, adv, torch.ones(1, 2), clip_eps_low=0.2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(s) for k, s in stats.items() if k != "approx_kl_sum")


# ---- value loss ------------------------------------------------------------------------------


def ref_value_token(v, v_old, ret, eps):
    err = (v - ret) ** 2
    if eps is None:
        return 0.5 * err, False
    v_clip = v_old + min(max(v - v_old, -eps), eps)
    err_c = (v_clip - ret) ** 2
    return 0.5 * max(err, err_c), err_c > err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [None, 0.2])
@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_value_loss_matches_reference(dtype, eps, mode):
    g = torch.Generator().manual_seed(12)
    for mask in make_masks(g).values():
        v_old = torch.randn(mask.shape, generator=g, dtype=torch.float64).to(dtype)
        v = (v_old.double() + torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.4).to(dtype)
        ret = torch.randn(mask.shape, generator=g, dtype=torch.float64).to(dtype)
        loss, stats = value_loss(v, v_old, ret, mask, clip_eps=eps, aggregation=mode)
        per_tok = [[ref_value_token(*t, eps) for t in zip(a, b, c)] for a, b, c in zip(rows(v), rows(v_old), rows(ret))]
        close(loss, ref_aggregate([[t[0] for t in r] for r in per_tok], rows(mask), mode), dtype)
        assert stats["tokens"].item() == mask.sum().item()
        n_clipped = sum(t[1] for rt, rm in zip(per_tok, rows(mask)) for t, m in zip(rt, rm) if m)
        assert stats["clipfrac_sum"].item() == n_clipped
        if eps is not None and mask.sum() > 10:
            assert n_clipped > 0  # the data exercise the clipped branch


def test_value_loss_by_hand_and_gradient():
    # v_old 0, eps 0.2: v = 1.0 with return 2.0 -> v_clip 0.2, errors 1.0 and 3.24: clipped term wins,
    # so the gradient through v is 0; v = 0.1 with return 0.0 -> inside the clip: 0.5 * 0.01.
    v = torch.tensor([[1.0, 0.1]], dtype=torch.float64, requires_grad=True)
    loss, stats = value_loss(v, torch.zeros(1, 2), torch.tensor([[2.0, 0.0]]), torch.ones(1, 2), clip_eps=0.2)
    assert loss.item() == pytest.approx((0.5 * 3.24 + 0.5 * 0.01) / 2, abs=1e-12)
    assert stats["clipfrac_sum"].item() == 1.0
    loss.backward()
    assert v.grad.tolist() == [[0.0, pytest.approx(0.1 / 2, abs=1e-12)]]
    with pytest.raises(ValueError, match="clip_eps"):
        value_loss(v, v, v, torch.ones(1, 2), clip_eps=0.0)


# ---- entropy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_entropy_matches_reference(dtype):
    g = torch.Generator().manual_seed(13)
    logits = (torch.randn(2, 3, 11, generator=g, dtype=torch.float64) * 3).to(dtype)
    out = entropy_from_logits(logits)
    assert out.shape == (2, 3) and out.dtype == torch.float32
    want = []
    for row in logits.tolist():
        want_row = []
        for lg in row:
            z = sum(math.exp(x) for x in lg)
            want_row.append(-sum(math.exp(x) / z * math.log(math.exp(x) / z) for x in lg))
        want.append(want_row)
    close(out, want, torch.float32)
    assert torch.allclose(entropy_from_logits(logits.bfloat16()), out, atol=0.1)  # fp32 maths on bf16 input


def test_entropy_extreme_logits():
    inf = float("inf")
    logits = torch.tensor(
        [
            [1e4, -1e4, 0.0, 5.0],  # one-hot in practice: 0
            [1e4, 1e4, -1e4, -1e4],  # two equal huge logits: log 2
            [3.0, 3.0, 3.0, -inf],  # banned token: log 3
            [0.0, 0.0, 0.0, 0.0],  # uniform: log 4
        ],
        requires_grad=True,
    )
    out = entropy_from_logits(logits)
    assert torch.allclose(out, torch.tensor([0.0, math.log(2), math.log(3), math.log(4)]), atol=1e-6)
    out.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.isfinite(entropy_from_logits(torch.full((1, 3), 3e38))).all()


# ---- aggregate_loss --------------------------------------------------------------------------


def test_aggregate_loss_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
    # masked: row 0 -> [1, 2, 3] (sum 6, mean 2); row 1 -> [20]; row 2 -> nothing
    assert aggregate_loss(loss, mask, "token-mean").item() == 26.0 / 4
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == (2.0 + 20.0) / 2  # empty row not counted
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(26.0 / 3)  # every row counted
    assert aggregate_loss(loss, mask, "token-mean", normalizer=13.0).item() == 2.0
    assert aggregate_loss(loss, mask, "seq-mean-token-mean", normalizer=11.0).item() == 2.0
    assert aggregate_loss(loss, mask, "seq-mean-token-sum", normalizer=2.0).item() == 13.0
    for mode in LOSS_AGGREGATIONS:
        assert aggregate_loss(loss, torch.zeros_like(mask), mode).item() == 0.0
    with pytest.raises(ValueError, match=r"'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum'.*'mean'"):
        aggregate_loss(loss, mask, "mean")
    with pytest.raises(ValueError, match="normalizer"):
        aggregate_loss(loss, mask, "token-mean", normalizer=0.0)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregate_loss_random_vs_reference(mode):
    g = torch.Generator().manual_seed(14)
    for mask in make_masks(g).values():
        loss = torch.randn(mask.shape, generator=g, dtype=torch.float64)
        close(aggregate_loss(loss, mask, mode), ref_aggregate(rows(loss), rows(mask), mode), torch.float64)
        close(aggregate_loss(loss, mask, mode, 7.0), ref_aggregate(rows(loss), rows(mask), mode, 7.0), torch.float64)
