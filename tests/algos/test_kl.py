"""KL estimates and controllers against independent references: the estimators' formulas in
float64 Python, exact expectations over small categorical distributions, and hand-computed
controller sequences.

Tolerances: atol 1e-5 for float32 inputs (sums of a few dozen O(1) terms), 1e-10 for float64.
"""

import math

import pytest
import torch

from hpcrlhf.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    kl_estimate,
)
from tests.algos.helpers import DTYPES, close, rows


# ---- KL estimators ---------------------------------------------------------------------------


def ref_kl(lp, rp, est):
    lr = min(max(lp - rp, -20.0), 20.0)  # every estimator bounded (a -inf log-prob must not give inf)
    if est == "k1":
        kl = lr
    elif est == "k2":
        kl = 0.5 * lr * lr
    else:
        kl = math.exp(-lr) - 1 + lr
    return min(max(kl, -10.0), 10.0)  # and the estimate too (OpenRLHF's and verl's bound)


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
    assert k3[0].item() == k3[-1].item() == 10.0  # bounded at 10, however far apart
    assert k3[6].item() == pytest.approx(math.exp(-3) + 2, rel=1e-6)  # inside the bound: the formula
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
    finite gap: each estimate is the float64 formula at the clamped log-ratio (+-20), itself bounded
    to +-10, never inf."""
    logp = torch.tensor([-1.0, float("-inf"), -1.0, -3.0, -1e4, 0.0])
    ref = torch.tensor([float("-inf"), -1.0, -1e4, -1.0, 0.0, -30.0])
    out = kl_estimate(logp, ref, est)
    assert torch.isfinite(out).all(), out
    want = [ref_kl(a, b, est) for a, b in zip(logp.tolist(), ref.tolist())]
    assert out.tolist() == pytest.approx(want, rel=1e-6)
    assert out[0].item() == 10.0 and out[1].item() == {"k1": -10.0, "k2": 10.0, "k3": 10.0}[est]


def test_one_far_token_cannot_outweigh_the_batch():
    """The case an outside check found (issue 40): the policy made a token e^11 times less likely than the
    reference. Unbounded, k3 was 59,862 with gradient -59,873; OpenRLHF and verl give 10 and no gradient."""
    logp = torch.tensor([[-12.0, -1.1]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    k3 = kl_estimate(logp, ref, "k3")
    k3.sum().backward()
    assert k3[0, 0].item() == 10.0 and logp.grad[0, 0].item() == 0.0
    assert k3[0, 1].item() == pytest.approx(math.exp(0.1) - 1.1, rel=1e-9)  # an ordinary token: the formula
    assert logp.grad[0, 1].item() == pytest.approx(1 - math.exp(0.1), rel=1e-9)


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
