"""PPO losses against independent references: hand-computed numbers, and float64 re-implementations
written with plain Python loops over each row's masked positions and `math` (the clipping
branches spelled out token by token).

Tolerances: atol 1e-5 for float32 inputs (sums of a few dozen O(1) terms), 1e-10 for float64.
"""

import math

import pytest
import torch

from hpcrlhf.algos.ppo import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    entropy_from_logits,
    policy_loss,
    IS_MODES,
    importance_weights,
    value_loss,
)
from tests.algos.helpers import DTYPES, close, make_masks, rows


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


def ref_importance_weights(old, behaviour, mask, cap, floor, mode):
    """Plain-Python importance weights and counts, row by row with `math` (the bands spelled out)."""
    lo_band = math.log(floor) if floor is not None else -math.log(cap)
    lo_floor = math.log(floor) if floor is not None else -math.inf
    hi = math.log(cap)
    out, counts = [], {"truncated": 0, "masked": 0, "masked_seqs": 0, "tokens": 0, "seqs": 0}
    for ro, rb, rm in zip(old, behaviour, mask):
        logs = []
        for o, b, m in zip(ro, rb, rm):
            d = o - b if m else 0.0
            logs.append(0.0 if math.isnan(d) else d)  # -inf - -inf
        kept = [lr for lr, m in zip(logs, rm) if m]
        counts["tokens"] += len(kept)
        counts["seqs"] += bool(kept)
        row_in = not kept or lo_band <= (sum(kept) / len(kept) if kept else 0.0) <= hi
        if mode == "seq_mask" and kept and not row_in:
            counts["masked_seqs"] += 1
            counts["masked"] += len(kept)
            out.append([0.0] * len(logs))
            continue
        row = []
        for lr, m in zip(logs, rm):
            if not m:
                row.append(0.0)
            elif mode == "mask":
                inside = lo_band <= lr <= hi
                counts["masked"] += not inside
                row.append(math.exp(lr) if inside else 0.0)
            else:
                counts["truncated"] += lr > hi or lr < lo_floor
                row.append(math.exp(min(max(lr, lo_floor), hi)))
        out.append(row)
    return out, counts


@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("floor", [None, 0.7])
def test_importance_weights_match_a_float64_reference(mode, floor):
    """Every mode and band against the plain-Python reference, on every mask shape, with ratios spread
    around the band (and -inf log-probs: a token one policy cannot produce, both cannot)."""
    g = torch.Generator().manual_seed(40)
    for dtype in DTYPES:
        for mask in make_masks(g).values():
            old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
            behaviour = old + torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.8
            old[0, 0], behaviour[0, 1], old[1, 2], behaviour[1, 2] = -math.inf, -math.inf, -math.inf, -math.inf
            w, stats = importance_weights(old.to(dtype), behaviour.to(dtype), mask, cap=2.0, floor=floor, mode=mode)
            want, counts = ref_importance_weights(rows(old.to(dtype).double()), rows(behaviour.to(dtype).double()),
                                                  rows(mask), 2.0, floor, mode)
            assert w.dtype == dtype
            close(w, want, dtype)
            assert {k: float(v) for k, v in stats.items() if k != "weight_sum"} == counts
            assert float(stats["weight_sum"]) == pytest.approx(sum(map(sum, want)), abs=1e-9)


def test_importance_weights_by_hand():
    """r = exp(old - behaviour) per token: truncate cuts at the cap (and a floor), mask drops tokens outside
    [1/cap, cap], seq_mask drops a response whose geometric-mean ratio leaves the band."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.2, -1.0, -0.5, -9.0], [-2.0, -2.0, -2.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    e = math.exp
    w, stats = importance_weights(old, behaviour, mask, cap=2.0)  # r: e^0.2, e^-1, 1, - | e, e, e, 1
    close(w, [[e(0.2), e(-1.0), 1.0, 0.0], [2.0, 2.0, 2.0, 1.0]], torch.float64)
    assert float(stats["truncated"]) == 3 and float(stats["tokens"]) == 7
    w, _ = importance_weights(old, behaviour, mask, cap=2.0, floor=0.5)
    assert w[0, 1] == pytest.approx(0.5)  # e^-1 = 0.37 raised to the floor
    w, stats = importance_weights(old, behaviour, mask, cap=2.0, mode="mask")  # band [0.5, 2]: e^-1 and e out
    close(w, [[e(0.2), 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]], torch.float64)
    assert float(stats["masked"]) == 4
    # row 2's geometric mean e^0.75 = 2.1 > 2: the whole response goes; row 1's e^(-0.8/3) stays, truncated
    w, stats = importance_weights(old, behaviour, mask, cap=2.0, mode="seq_mask")
    close(w, [[e(0.2), e(-1.0), 1.0, 0.0], [0.0] * 4], torch.float64)
    assert (float(stats["masked_seqs"]), float(stats["masked"]), float(stats["seqs"])) == (1, 4, 2)
    with pytest.raises(ValueError, match="cap must be >= 1"):
        importance_weights(old, behaviour, mask, cap=0.5)
    with pytest.raises(ValueError, match="floor must be in"):
        importance_weights(old, behaviour, mask, cap=2.0, floor=1.5)


def test_masked_tokens_keep_their_place_in_the_denominator():
    """Mask-mode weights in the loss: the dropped tokens add 0 to the sum and still count in its
    denominator, for every aggregation (the kept tokens' gradients are not inflated)."""
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.0, -3.0, -1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)  # token (0, 1): r = e^2
    mask = torch.ones(2, 3, dtype=torch.bool)
    w, _ = importance_weights(old, behaviour, mask, cap=2.0, mode="mask")
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 2.0, 0.5]], dtype=torch.float64)
    per_tok = [[-a * wt for a, wt in zip(ra, rw)] for ra, rw in zip(rows(adv), rows(w))]  # ratio 1: l = -A w
    for mode in LOSS_AGGREGATIONS:
        loss, _ = policy_loss(old.clone(), old, adv, mask, clip_eps_low=0.2, aggregation=mode, token_weights=w)
        close(loss, ref_aggregate(per_tok, rows(mask), mode), torch.float64)
    token_mean, _ = policy_loss(old.clone(), old, adv, mask, clip_eps_low=0.2, token_weights=w)
    assert float(token_mean) == pytest.approx(-(1 + 0 + 1 - 1 + 2 + 0.5) / 6)  # 6 tokens, not 5


def test_importance_weights_multiply_the_loss_token_by_token():
    """The loss takes the weights as per-token multipliers of the clipped surrogate (value and gradient),
    whatever the aggregation."""
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
