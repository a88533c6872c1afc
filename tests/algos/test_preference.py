"""Preference losses against independent float64 references written with `math`, per sample.

Tolerances: atol 1e-6 for float32 inputs, 1e-10 for float64, plus a small relative term
(1e-6 / 1e-12) because IPO losses at small beta and the large-magnitude cases are O(10^3),
where the spacing of float32 numbers alone is ~1e-4.
"""

import math

import pytest
import torch

from hpcrlhf.algos.preference import (
    KTOLossOutput,
    PreferenceLossOutput,
    dpo_loss,
    kto_kl_estimate,
    kto_loss,
    mismatched_pairs,
    pairwise_rm_loss,
    sequence_logprobs,
)

DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: (1e-6, 1e-6), torch.float64: (1e-10, 1e-12)}
BATCH_SIZES = [1, 3, 16]
BETAS = [0.01, 0.1, 0.5, 1.0]


# ---- independent references (plain Python floats) --------------------------------------------


def ref_logsigmoid(x):
    # Stable split: the naive math.log(1 / (1 + math.exp(-x))) overflows for x < -709.
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def ref_sigmoid(x):
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def ref_pairwise(rc, rr, margins):
    loss = sum(-ref_logsigmoid(c - r - m) for c, r, m in zip(rc, rr, margins)) / len(rc)
    return loss, sum(c > r for c, r in zip(rc, rr)) / len(rc)


def ref_dpo(pc, pr, rc, rr, beta, loss_type, eps):
    total = 0.0
    for a, b, c, d in zip(pc, pr, rc, rr):
        h = (a - c) - (b - d)
        if loss_type == "ipo":
            total += (h - 1 / (2 * beta)) ** 2
        else:  # dpo is cdpo with eps = 0
            total += -(1 - eps) * ref_logsigmoid(beta * h) - eps * ref_logsigmoid(-beta * h)
    return total / len(pc)


def ref_kto(pol, ref, desirable, kl, beta, wd, wu):
    z0 = max(kl, 0.0)
    total, chosen, rejected = 0.0, [], []
    for p, q, good in zip(pol, ref, desirable):
        r = p - q
        if good:
            total += wd * (1 - ref_sigmoid(beta * (r - z0)))
            chosen.append(beta * r)
        else:
            total += wu * (1 - ref_sigmoid(beta * (z0 - r)))
            rejected.append(beta * r)
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return total / len(pol), mean(chosen), mean(rejected), z0


def assert_close(got, ref, dtype):
    atol, rtol = TOL[dtype]
    got = got.item() if isinstance(got, torch.Tensor) else got
    assert math.isfinite(got)
    assert abs(got - ref) <= atol + rtol * abs(ref), (got, ref, dtype)


def rand(g, n, dtype, scale=2.0, shift=0.0):
    return (torch.randn(n, generator=g, dtype=torch.float64) * scale + shift).to(dtype)


# ---- sequence_logprobs -----------------------------------------------------------------------


def test_sequence_logprobs_sum_and_average_by_hand():
    logps = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-0.5, float("-inf"), 0.0, 0.0], [-7.0, -7.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert sequence_logprobs(logps, mask).tolist() == [-6.0, -0.5, 0.0]  # -inf is masked out, no NaN
    assert sequence_logprobs(logps, mask.bool(), average=True).tolist() == [-2.0, -0.5, 0.0]
    assert sequence_logprobs(logps.double(), mask).dtype == torch.float64
    assert sequence_logprobs(logps[:, :1].bfloat16(), mask[:, :1]).dtype == torch.bfloat16


# ---- pairwise reward-model loss --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_pairwise_rm_loss_matches_reference(dtype):
    g = torch.Generator().manual_seed(0)
    for n in BATCH_SIZES:
        rc, rr, m = rand(g, n, dtype), rand(g, n, dtype), rand(g, n, dtype).abs()
        for margin, ms in [(None, [0.0] * n), (0.5, [0.5] * n), (m, m.tolist())]:
            loss, acc = pairwise_rm_loss(rc, rr, margin)
            ref_loss, ref_acc = ref_pairwise(rc.tolist(), rr.tolist(), ms)
            assert loss.dtype == acc.dtype == dtype and loss.shape == acc.shape == ()
            assert_close(loss, ref_loss, dtype)
            assert_close(acc, ref_acc, dtype)


def test_pairwise_margin_shifts_loss():
    rc, rr = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64), torch.tensor([0.0, 0.0, 3.0], dtype=torch.float64)
    loss0, acc0 = pairwise_rm_loss(rc, rr)
    assert_close(pairwise_rm_loss(rc * 0, rr * 0)[0], math.log(2), torch.float64)
    # A margin m is the same as lowering every chosen reward by m ...
    for m in [0.3, 1.0, -0.5]:
        loss, acc = pairwise_rm_loss(rc, rr, m)
        assert_close(loss, pairwise_rm_loss(rc - m, rr)[0].item(), torch.float64)
        assert acc == acc0 == 1 / 3  # ... and accuracy ignores it (ties count as wrong)
    # ... so a positive margin raises the loss and a negative one lowers it.
    assert pairwise_rm_loss(rc, rr, 1.0)[0] > loss0 > pairwise_rm_loss(rc, rr, -1.0)[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_pairwise_large_magnitudes_are_stable(dtype):
    rc = torch.tensor([900.0, -1000.0, 5.0, -800.0], dtype=dtype)
    rr = torch.tensor([-900.0, 1000.0, 0.0, 800.0], dtype=dtype)
    with pytest.raises(OverflowError):  # the naive reference cannot even be evaluated here
        math.log(1 / (1 + math.exp(-(rc[1] - rr[1]).item())))
    loss, _ = pairwise_rm_loss(rc, rr)
    assert_close(loss, ref_pairwise(rc.tolist(), rr.tolist(), [0.0] * 4)[0], dtype)


# ---- DPO / cDPO / IPO ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("loss_type,eps", [("dpo", 0.0), ("cdpo", 0.1), ("cdpo", 0.3), ("ipo", 0.0)])
def test_dpo_losses_match_reference(dtype, loss_type, eps):
    g = torch.Generator().manual_seed(1)
    for n in BATCH_SIZES:
        for beta in BETAS:
            pc, pr, rc, rr = (rand(g, n, dtype, shift=-5.0) for _ in range(4))
            out = dpo_loss(pc, pr, rc, rr, beta, loss_type=loss_type, label_smoothing=eps)
            assert isinstance(out, PreferenceLossOutput)
            assert all(t.dtype == dtype for t in out) and out.loss.shape == ()
            ref = ref_dpo(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), beta, loss_type, eps)
            assert_close(out.loss, ref, dtype)
            for i in range(n):
                assert_close(out.chosen_rewards[i], beta * (pc[i].item() - rc[i].item()), dtype)
                assert_close(out.rejected_rewards[i], beta * (pr[i].item() - rr[i].item()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("loss_type,eps", [("dpo", 0.0), ("cdpo", 0.2), ("ipo", 0.0)])
def test_dpo_large_magnitudes_are_stable(dtype, loss_type, eps):
    # Summed log-probs of long sequences: |beta * h| up to ~2000, far past exp() overflow.
    pc = torch.tensor([-10.0, -3000.0, -50.0, -1500.0], dtype=dtype)
    pr = torch.tensor([-3000.0, -10.0, -60.0, -20.0], dtype=dtype)
    rc = torch.tensor([-20.0, -20.0, -55.0, -30.0], dtype=dtype)
    rr = torch.tensor([-25.0, -25.0, -58.0, -1700.0], dtype=dtype)
    with pytest.raises(OverflowError):
        math.exp(-((pc[1] - rc[1]) - (pr[1] - rr[1])).item())
    for beta in [0.5, 1.0]:
        out = dpo_loss(pc, pr, rc, rr, beta, loss_type=loss_type, label_smoothing=eps)
        ref = ref_dpo(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), beta, loss_type, eps)
        assert_close(out.loss, ref, dtype)


def test_dpo_equals_cdpo_with_zero_smoothing():
    g = torch.Generator().manual_seed(2)
    args = [rand(g, 8, torch.float32, scale=50.0) for _ in range(4)]
    a, b = dpo_loss(*args, beta=0.3), dpo_loss(*args, beta=0.3, loss_type="cdpo", label_smoothing=0.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_dpo_rewards_margins_accuracy_by_hand():
    # h = (pc - rc) - (pr - rr) = [2 - 0, 0 - 1, 1 - 1] = [2, -1, 0]
    pc = torch.tensor([-1.0, -4.0, -2.0], dtype=torch.float64)
    rc = torch.tensor([-3.0, -4.0, -3.0], dtype=torch.float64)
    pr = torch.tensor([-5.0, -2.0, -3.0], dtype=torch.float64)
    rr = torch.tensor([-5.0, -3.0, -4.0], dtype=torch.float64)
    out = dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert out.chosen_rewards.tolist() == [1.0, 0.0, 0.5]
    assert out.rejected_rewards.tolist() == [0.0, 0.5, 0.5]
    assert out.margins.tolist() == [1.0, -0.5, 0.0]
    assert out.accuracy.item() == pytest.approx(1 / 3)  # a zero margin is not a win
    expected = -(ref_logsigmoid(1.0) + ref_logsigmoid(-0.5) + ref_logsigmoid(0.0)) / 3
    assert_close(out.loss, expected, torch.float64)
    ipo = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo")  # target h = 1 / (2 * 0.5) = 1
    assert_close(ipo.loss, ((2 - 1) ** 2 + (-1 - 1) ** 2 + (0 - 1) ** 2) / 3, torch.float64)


@pytest.mark.parametrize("loss_type,eps", [("dpo", 0.0), ("cdpo", 0.2), ("ipo", 0.0)])
def test_dpo_gradients_reach_policy_only(loss_type, eps):
    g = torch.Generator().manual_seed(3)
    pc, pr, rc, rr = (rand(g, 5, torch.float64).requires_grad_() for _ in range(4))
    out = dpo_loss(pc, pr, rc, rr, 0.2, loss_type=loss_type, label_smoothing=eps)
    out.loss.backward()
    assert rc.grad is None and rr.grad is None
    assert not any(t.requires_grad for t in out[1:])
    h = ((pc - rc) - (pr - rr)).detach()
    if loss_type == "ipo":
        d_h = 2 * (h - 1 / (2 * 0.2)) / 5
    else:  # d/dh of -(1-e) logsig(bh) - e logsig(-bh) = -b ((1-e) sigmoid(-bh) - e sigmoid(bh))
        d_h = -0.2 * ((1 - eps) * torch.sigmoid(-0.2 * h) - eps * torch.sigmoid(0.2 * h)) / 5
    assert torch.allclose(pc.grad, d_h, atol=1e-12) and torch.allclose(pr.grad, -d_h, atol=1e-12)


def test_dpo_invalid_arguments_raise():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=r"loss_type.*'dpo'.*'ipo'.*'cdpo'.*'sigmoid'"):
        dpo_loss(x, x, x, x, 0.1, loss_type="sigmoid")
    with pytest.raises(ValueError, match=r"label_smoothing.*0 for loss_type='dpo'.*use loss_type='cdpo'"):
        dpo_loss(x, x, x, x, 0.1, label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"label_smoothing.*loss_type='ipo'"):
        dpo_loss(x, x, x, x, 0.1, loss_type="ipo", label_smoothing=0.1)
    for eps in [0.5, -0.1, 1.0]:
        with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0\.5\)"):
            dpo_loss(x, x, x, x, 0.1, loss_type="cdpo", label_smoothing=eps)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, 0.0, loss_type="ipo")


# ---- KTO -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_kto_matches_reference(dtype):
    g = torch.Generator().manual_seed(4)
    for n in BATCH_SIZES:
        for beta in BETAS:
            for kl, wd, wu in [(0.7, 1.0, 1.0), (-0.3, 1.0, 1.33), (2.5, 0.5, 2.0)]:
                pol, ref = rand(g, n, dtype, shift=-5.0), rand(g, n, dtype, shift=-5.0)
                good = torch.rand(n, generator=g) < 0.5
                kl_t = torch.tensor(kl, dtype=dtype)
                out = kto_loss(pol, ref, good, kl_t, beta, desirable_weight=wd, undesirable_weight=wu)
                assert isinstance(out, KTOLossOutput) and all(t.dtype == dtype and t.shape == () for t in out)
                expected = ref_kto(pol.tolist(), ref.tolist(), good.tolist(), kl_t.item(), beta, wd, wu)
                for got, want in zip(out, expected):
                    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kto_large_magnitudes_are_stable(dtype):
    pol = torch.tensor([-10.0, -3000.0, -2900.0, -5.0], dtype=dtype)
    ref = torch.tensor([-2500.0, -20.0, -10.0, -2000.0], dtype=dtype)
    good = torch.tensor([True, True, False, False])
    for beta in [0.5, 1.0]:
        out = kto_loss(pol, ref, good, torch.tensor(30.0, dtype=dtype), beta)
        for got, want in zip(out, ref_kto(pol.tolist(), ref.tolist(), good.tolist(), 30.0, beta, 1.0, 1.0)):
            assert_close(got, want, dtype)


@pytest.mark.parametrize("all_good", [True, False])
def test_kto_one_sided_batches_are_finite(all_good):
    g = torch.Generator().manual_seed(5)
    pol, ref = rand(g, 6, torch.float64), rand(g, 6, torch.float64)
    good = torch.full((6,), all_good)
    out = kto_loss(pol, ref, good, torch.tensor(0.2, dtype=torch.float64), 0.1, 1.5, 0.7)
    assert all(torch.isfinite(t) for t in out)
    assert (out.rejected_rewards_mean if all_good else out.chosen_rewards_mean).item() == 0.0
    expected = ref_kto(pol.tolist(), ref.tolist(), good.tolist(), 0.2, 0.1, 1.5, 0.7)
    for got, want in zip(out, expected):
        assert_close(got, want, torch.float64)


def test_kto_weights_scale_each_kind_as_the_formula_says():
    g = torch.Generator().manual_seed(6)
    pol, ref = rand(g, 8, torch.float64), rand(g, 8, torch.float64)
    good = torch.tensor([True, False, True, True, False, False, True, False])
    kl, beta = torch.tensor(0.4, dtype=torch.float64), 0.5
    base = kto_loss(pol, ref, good, kl, beta).loss.item()
    r = (pol - ref).tolist()
    d_sum = sum(1 - ref_sigmoid(beta * (x - 0.4)) for x, ok in zip(r, good.tolist()) if ok)
    u_sum = sum(1 - ref_sigmoid(beta * (0.4 - x)) for x, ok in zip(r, good.tolist()) if not ok)
    assert_close(base, (d_sum + u_sum) / 8, torch.float64)
    # loss = (w_d * d_sum + w_u * u_sum) / B: linear in each weight with slope (sum of that kind) / B.
    assert_close(kto_loss(pol, ref, good, kl, beta, 3.0, 1.0).loss, base + 2 * d_sum / 8, torch.float64)
    assert_close(kto_loss(pol, ref, good, kl, beta, 1.0, 0.25).loss, base - 0.75 * u_sum / 8, torch.float64)
    assert_close(kto_loss(pol, ref, good, kl, beta, 0.0, 0.0).loss, 0.0, torch.float64)


def test_kto_clamps_and_detaches_the_reference_point():
    g = torch.Generator().manual_seed(7)
    pol, ref = rand(g, 4, torch.float64).requires_grad_(), rand(g, 4, torch.float64).requires_grad_()
    good = torch.tensor([True, False, True, False])
    kl = torch.tensor(-0.8, dtype=torch.float64, requires_grad=True)
    out = kto_loss(pol, ref, good, kl, 0.1)
    assert out.kl.item() == 0.0  # a negative KL estimate is clamped: z0 = 0
    assert out.loss.item() == kto_loss(pol, ref, good, torch.zeros((), dtype=torch.float64), 0.1).loss.item()
    out.loss.backward()
    assert pol.grad is not None and torch.all(pol.grad != 0)
    assert ref.grad is None and kl.grad is None
    assert not any(t.requires_grad for t in out[1:])
    with pytest.raises(ValueError, match="is_desirable"):
        kto_loss(pol, ref, good.long(), kl, 0.1)


def test_mismatched_pairs_is_a_cyclic_derangement():
    assert mismatched_pairs(5).tolist() == [1, 2, 3, 4, 0]
    for n in range(2, 12):
        idx = mismatched_pairs(n)
        assert sorted(idx.tolist()) == list(range(n))
        assert all(j == (i + 1) % n and j != i for i, j in enumerate(idx.tolist()))
    with pytest.raises(ValueError, match="n >= 2"):
        mismatched_pairs(1)


def test_kto_kl_estimate_is_unclamped_detached_mean():
    pol = torch.tensor([-3.0, -2.0, -6.0], requires_grad=True)
    ref = torch.tensor([-4.0, -1.0, -4.0])
    est = kto_kl_estimate(pol, ref)
    assert est.item() == pytest.approx((1.0 - 1.0 - 2.0) / 3) and est.item() < 0
    assert not est.requires_grad and est.dtype == torch.float32
    assert kto_kl_estimate(pol.detach().double(), ref.double()).dtype == torch.float64


def test_half_precision_in_half_precision_out():
    x = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in pairwise_rm_loss(x, x.flip(0)))
    assert all(t.dtype == torch.bfloat16 for t in dpo_loss(x, x.flip(0), x, x, 0.1))
    good = torch.tensor([True, False, True])
    assert all(t.dtype == torch.bfloat16 for t in kto_loss(x, x.flip(0), good, x.mean(), 0.1))
    assert kto_kl_estimate(x, x.flip(0)).dtype == torch.bfloat16
