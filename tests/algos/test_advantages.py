"""Advantage estimators, GAE and returns-to-go against float64 references written with plain Python
loops over each group / each row's masked positions, plus hand-computed examples.

The GAE reference uses the closed form A_t = sum_l (gamma lam)^l delta_{t+l} rather than the
backward recursion of the implementation, and returns-to-go the explicit discounted sum, so a
shared mistake in the recursion cannot pass. Tolerances: atol 1e-5 for float32 inputs, 1e-10 for
float64.
"""

import math
import statistics

import pytest
import torch

from hpcrlhf.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    CRITIC_FREE,
    broadcast_to_tokens,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from hpcrlhf.algos.masked import masked_whiten
from tests.algos.helpers import DTYPES, capture_sums, close, make_masks, plus, positions, rows


def response_mask(g, B, T=7):
    """Prompt + response + padding per row, a hole in row 0 and an empty last row."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        start = int(torch.randint(0, 3, (1,), generator=g))
        mask[b, start : int(torch.randint(start + 1, T + 1, (1,), generator=g))] = True
    mask[0] = torch.tensor([0, 1, 1, 0, 1, 1, 0], dtype=torch.bool)[:T]
    mask[-1] = False
    return mask


# ---- references ------------------------------------------------------------------------------


def ref_grpo(scores, n, std_normalize=True, eps=1e-6):
    out = []
    for i in range(0, len(scores), n):
        grp = scores[i : i + n]
        mean = sum(grp) / n
        std = math.sqrt(sum((s - mean) ** 2 for s in grp) / (n - 1))  # unbiased
        out += [(s - mean) / (std + eps) if std_normalize else s - mean for s in grp]
    return out


def ref_rloo(scores, n):
    out = []
    for i in range(0, len(scores), n):
        grp = scores[i : i + n]
        out += [s - sum(o for j, o in enumerate(grp) if j != k) / (n - 1) for k, s in enumerate(grp)]
    return out


def ref_reinforce_pp(rewards, mask, gamma, eps=1e-8):
    returns = []
    for rr, mr in zip(rewards.tolist(), mask.tolist()):
        pos = [t for t, m in enumerate(mr) if m]
        row = [0.0] * len(mr)
        for k, t in enumerate(pos):
            row[t] = sum(gamma ** (j - k) * rr[pos[j]] for j in range(k, len(pos)))
        returns.append(row)
    vals = [g for gr, mr in zip(returns, mask.tolist()) for g, m in zip(gr, mr) if m]
    mean, sd = statistics.fmean(vals), math.sqrt(statistics.pvariance(vals) + eps)
    adv = [[(g - mean) / sd if m else 0.0 for g, m in zip(gr, mr)] for gr, mr in zip(returns, mask.tolist())]
    return adv, returns


# ---- GRPO / RLOO -----------------------------------------------------------------------------


def test_grpo_and_rloo_by_hand():
    s = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    assert rloo_advantages(s, 2).tolist() == [1.0, -1.0, -1.0, 1.0]
    # Group [1, 0]: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.70710678...
    sd = math.sqrt(0.5)
    close(grpo_advantages(s, 2), [0.5 / (sd + 1e-6), -0.5 / (sd + 1e-6), -0.5 / (sd + 1e-6), 0.5 / (sd + 1e-6)],
          torch.float64)
    assert grpo_advantages(s, 2, std_normalize=False).tolist() == [0.5, -0.5, -0.5, 0.5]  # Dr. GRPO
    # Group of 4 [3, 1, 0, 0]: rloo_0 = 3 - (1 + 0 + 0) / 3; rloo_1 = 1 - 3 / 3 = 0; rloo_2 = 0 - 4 / 3
    close(rloo_advantages(torch.tensor([3.0, 1.0, 0.0, 0.0], dtype=torch.float64), 4),
          [3 - 1 / 3, 0.0, -4 / 3, -4 / 3], torch.float64)
    # Identical scores (all right or all wrong): no signal, advantage 0, not NaN.
    same = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    assert grpo_advantages(same, 3).tolist() == [0.0] * 6 and rloo_advantages(same, 3).tolist() == [0.0] * 6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3, 8])
def test_grpo_and_rloo_match_reference(dtype, n):
    g = torch.Generator().manual_seed(0)
    for n_groups in [1, 4]:
        s = (torch.randn(n * n_groups, generator=g, dtype=torch.float64) * 2 + 1).to(dtype)
        for std_normalize in [True, False]:
            out = grpo_advantages(s, n, std_normalize=std_normalize)
            assert out.dtype == dtype and out.shape == s.shape
            close(out, ref_grpo(s.tolist(), n, std_normalize), dtype)
        close(grpo_advantages(s, n, eps=0.5), ref_grpo(s.tolist(), n, eps=0.5), dtype)
        close(rloo_advantages(s, n), ref_rloo(s.tolist(), n), dtype)
        # Each group's RLOO advantages sum to 0 (n/(n-1) times the mean-centred scores).
        group_sums = rloo_advantages(s, n).view(-1, n).sum(-1).double()
        assert torch.allclose(group_sums, torch.zeros(n_groups, dtype=torch.float64), atol=1e-5)


def test_group_advantages_reject_bad_layouts():
    s = torch.zeros(6)
    for fn in (grpo_advantages, rloo_advantages):
        with pytest.raises(ValueError, match="not a multiple of group_size=4"):
            fn(s, 4)
        with pytest.raises(ValueError, match="group_size >= 2"):
            fn(s, 1)
        with pytest.raises(ValueError, match=r"shape \(B,\)"):
            fn(torch.zeros(3, 2), 2)


def test_group_advantages_keep_half_precision_dtype_and_detach():
    s = torch.tensor([1.0, 0.0, 0.5, 0.25], requires_grad=True)
    assert not grpo_advantages(s, 2).requires_grad and not rloo_advantages(s, 2).requires_grad
    assert grpo_advantages(s.detach().bfloat16(), 2).dtype == torch.bfloat16


def test_broadcast_to_tokens():
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0, 7.0], dtype=torch.float64), mask)
    assert out.tolist() == [[0, 2, 2, 0], [-1, 0, -1, -1], [0, 0, 0, 0]] and out.dtype == torch.float64


# ---- REINFORCE++ -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_reference(dtype, gamma):
    g = torch.Generator().manual_seed(1)
    mask = response_mask(g, 6)
    rewards = torch.where(mask, torch.randn(mask.shape, generator=g, dtype=torch.float64), float("nan")).to(dtype)
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=gamma)
    want_adv, want_ret = ref_reinforce_pp(rewards, mask, gamma)
    assert adv.dtype == ret.dtype == dtype
    close(adv, want_adv, dtype)
    close(ret, want_ret, dtype)
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)


def test_reinforce_pp_is_whitened_over_the_global_batch():
    g = torch.Generator().manual_seed(2)
    mask = response_mask(g, 8)
    rewards = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    whole_adv, whole_ret = reinforce_pp_advantages(rewards, mask, gamma=0.95)
    (ra, rb), (ma, mb) = rewards.split(4), mask.split(4)
    sums_a = capture_sums(lambda r: reinforce_pp_advantages(ra, ma, gamma=0.95, reduce=r))
    sums_b = capture_sums(lambda r: reinforce_pp_advantages(rb, mb, gamma=0.95, reduce=r))
    adv_a, ret_a = reinforce_pp_advantages(ra, ma, gamma=0.95, reduce=plus(sums_b))
    adv_b, ret_b = reinforce_pp_advantages(rb, mb, gamma=0.95, reduce=plus(sums_a))
    assert torch.allclose(torch.cat([adv_a, adv_b]), whole_adv, atol=1e-12, rtol=0)
    assert torch.equal(torch.cat([ret_a, ret_b]), whole_ret)
    assert not torch.allclose(reinforce_pp_advantages(ra, ma, gamma=0.95)[0], whole_adv[:4], atol=1e-3)


# ---- compute_advantages ----------------------------------------------------------------------


def test_registry_names():
    from hpcrlhf.algos.advantages import _COMPUTE

    assert ADVANTAGE_ESTIMATORS == ("gae", "grpo", "dr_grpo", "rloo", "reinforce++", "reinforce_baseline")
    assert CRITIC_FREE == set(ADVANTAGE_ESTIMATORS) - {"gae"} and CRITIC_FREE < set(ADVANTAGE_ESTIMATORS)
    assert tuple(_COMPUTE) == ADVANTAGE_ESTIMATORS  # every record has its maths and no maths lacks a record


def test_estimator_records_drive_config_and_trainer():
    """What the records say is what validation enforces: a group-based estimator refuses one
    sample per prompt; a critic-free one needs no critic; the type's choices are the records'."""
    import typing

    from hpcrlhf.algos.estimators import ESTIMATORS
    from hpcrlhf.config.loader import load_config
    from hpcrlhf.config.schema import PPOConfig, PPOSectionConfig
    from hpcrlhf.errors import ConfigError

    assert typing.get_args(typing.get_type_hints(PPOSectionConfig)["advantage_estimator"]) == ADVANTAGE_ESTIMATORS
    for name, record in ESTIMATORS.items():
        overrides = [f"ppo.advantage_estimator={name}", "rollout.samples_per_prompt=1"]
        if record.needs_groups:
            with pytest.raises(ConfigError, match=f"rollout.samples_per_prompt: 1 gives {name} no group"):
                load_config(PPOConfig, overrides=overrides)
        else:
            assert load_config(PPOConfig, overrides=overrides).ppo.uses_critic == record.needs_critic


def ref_whitened(tokens, mask):
    """Token values standardised over every masked token of the batch (population variance + 1e-8)."""
    vals = [v for row, mr in zip(tokens, mask) for v, m in zip(row, mr) if m]
    mean, sd = statistics.fmean(vals), math.sqrt(statistics.pvariance(vals) + 1e-8)
    return [[(v - mean) / sd if m else 0.0 for v, m in zip(row, mr)] for row, mr in zip(tokens, mask)]


def _batch(seed, B=6):
    g = torch.Generator().manual_seed(seed)
    mask = response_mask(g, B)
    rewards = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    scores = torch.randn(B, generator=g, dtype=torch.float64)
    return mask, rewards, values, scores


@pytest.mark.parametrize("whiten", [True, False])
def test_compute_advantages_gae(whiten):
    mask, rewards, values, _ = _batch(3)
    adv, ret = compute_advantages("gae", rewards=rewards, mask=mask, values=values, gamma=0.99, lam=0.9, whiten=whiten)
    raw, want_ret = gae_advantages(rewards, values, mask, 0.99, 0.9)
    assert torch.equal(ret, want_ret)  # returns come from the unwhitened advantages
    assert torch.equal(adv, masked_whiten(raw, mask) if whiten else raw)
    if whiten:
        assert abs(adv[mask].mean().item()) < 1e-10 and abs(adv[mask].var(unbiased=False).item() - 1) < 1e-6
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)


def test_compute_advantages_gae_whitening_is_global():
    mask, rewards, values, _ = _batch(4, B=8)
    kw = dict(gamma=1.0, lam=0.95)
    whole, _ = compute_advantages("gae", rewards=rewards, mask=mask, values=values, **kw)
    halves = [(rewards[i], mask[i], values[i]) for i in (slice(0, 4), slice(4, 8))]
    sums = [
        capture_sums(lambda red, h=h: compute_advantages("gae", rewards=h[0], mask=h[1], values=h[2], reduce=red, **kw))
        for h in halves
    ]
    split = [
        compute_advantages("gae", rewards=h[0], mask=h[1], values=h[2], reduce=plus(other), **kw)[0]
        for h, other in zip(halves, sums[::-1])
    ]
    assert torch.allclose(torch.cat(split), whole, atol=1e-12, rtol=0)


def test_compute_advantages_grpo():
    mask, rewards, _, scores = _batch(5)
    adv, ret = compute_advantages("grpo", rewards=rewards, mask=mask, scores=scores, group_size=3)
    want = ref_grpo(scores.tolist(), 3)
    close(adv, [[want[b] if m else 0.0 for m in row] for b, row in enumerate(mask.tolist())], torch.float64)
    assert torch.equal(ret, adv)
    # Already normalised per group: the whiten flag changes nothing; token rewards are not used.
    same, _ = compute_advantages("grpo", rewards=rewards * 0, mask=mask, scores=scores, group_size=3, whiten=False)
    assert torch.equal(same, adv)


@pytest.mark.parametrize("whiten", [True, False])
def test_compute_advantages_dr_grpo(whiten):
    """Dr. GRPO: score minus its group's mean, no std division (float64 reference by hand), the
    same for every token of the response; whiten does not apply."""
    mask, rewards, _, scores = _batch(9)
    adv, ret = compute_advantages("dr_grpo", rewards=rewards, mask=mask, scores=scores, group_size=3, whiten=whiten)
    s = scores.tolist()
    want = [s[b] - statistics.fmean(s[b // 3 * 3 : b // 3 * 3 + 3]) for b in range(len(s))]
    close(adv, [[want[b] if m else 0.0 for m in row] for b, row in enumerate(mask.tolist())], torch.float64)
    assert torch.equal(ret, adv)
    grpo, _ = compute_advantages("grpo", rewards=rewards, mask=mask, scores=scores, group_size=3)
    assert not torch.allclose(grpo, adv)  # grpo divides by each group's std


def check_sequence_advantages(adv, ret, want: list[float], mask, whiten: bool) -> None:
    """A sequence-level estimator's result: each response's value `want[b]` on its tokens (whitened
    over the batch's tokens when asked), and returns equal to the advantages."""
    tokens = [[want[b] if m else 0.0 for m in row] for b, row in enumerate(mask.tolist())]
    if whiten:
        tokens = ref_whitened(tokens, mask.tolist())
    close(adv, tokens, torch.float64)
    assert torch.equal(ret, adv)


@pytest.mark.parametrize("whiten", [True, False])
def test_compute_advantages_reinforce_baseline(whiten):
    """Score minus its prompt's mean (float64 by hand), broadcast to the response's tokens, then
    whitened over every masked token of the batch when asked."""
    mask, rewards, _, scores = _batch(10)
    adv, ret = compute_advantages("reinforce_baseline", rewards=rewards, mask=mask, scores=scores, group_size=2,
                                  whiten=whiten)
    s = scores.tolist()
    want = [s[b] - (s[b // 2 * 2] + s[b // 2 * 2 + 1]) / 2 for b in range(len(s))]
    check_sequence_advantages(adv, ret, want, mask, whiten)


@pytest.mark.parametrize("whiten", [True, False])
def test_compute_advantages_rloo(whiten):
    mask, rewards, _, scores = _batch(6)
    adv, ret = compute_advantages("rloo", rewards=rewards, mask=mask, scores=scores, group_size=2, whiten=whiten)
    want = ref_rloo(scores.tolist(), 2)
    check_sequence_advantages(adv, ret, want, mask, whiten)


@pytest.mark.parametrize("whiten", [True, False])
def test_compute_advantages_reinforce_pp(whiten):
    mask, rewards, _, _ = _batch(7)
    adv, ret = compute_advantages("reinforce++", rewards=rewards, mask=mask, gamma=0.9, whiten=whiten)
    want_adv, want_ret = ref_reinforce_pp(rewards, mask, 0.9)
    close(adv, want_adv, torch.float64)  # whitened by definition, whatever `whiten` says
    close(ret, want_ret, torch.float64)


def test_compute_advantages_errors():
    mask, rewards, values, scores = _batch(8)
    with pytest.raises(ValueError, match=r"'gae', 'grpo', 'dr_grpo', 'rloo', 'reinforce\+\+', 'reinforce_baseline'.*'ppo'"):
        compute_advantages("ppo", rewards=rewards, mask=mask, values=values)
    with pytest.raises(ValueError, match="'gae' needs critic values"):
        compute_advantages("gae", rewards=rewards, mask=mask)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_baseline"):
        with pytest.raises(ValueError, match=f"'{name}' needs per-sequence scores"):
            compute_advantages(name, rewards=rewards, mask=mask, group_size=2)
        with pytest.raises(ValueError, match="group_size >= 2"):
            compute_advantages(name, rewards=rewards, mask=mask, scores=scores)  # default group_size 1
        with pytest.raises(ValueError, match="not a multiple of group_size=4"):
            compute_advantages(name, rewards=rewards, mask=mask, scores=scores, group_size=4)


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
