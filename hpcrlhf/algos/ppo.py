"""PPO maths on per-token tensors: masked statistics, KL estimates and controllers, reward
shaping, GAE, and the clipped policy / value losses.

Algorithms, as implemented here:

* PPO clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms"):
  with r = exp(logp - old_logp) and advantage A, the per-token loss is
  max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); eps_high > eps_low is the asymmetric
  "clip-higher" variant (DAPO, Yu et al. 2025).
* Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"): for A < 0
  the loss is additionally capped at -A c (c > 1), so a token whose ratio exploded under a
  negative advantage cannot dominate the batch.
* Clipped value loss (as in the PPO reference code): 0.5 max((V - R)^2, (V_clip - R)^2) with
  V_clip = V_old + clip(V - V_old, -eps, eps).
* KL estimators (Schulman 2020, "Approximating KL Divergence", the k1/k2/k3 estimators), from
  samples of pi with log_ratio = log pi - log ref:  k1 = log_ratio (unbiased, can be negative),
  k2 = log_ratio^2 / 2 (biased, low variance), k3 = exp(-log_ratio) - 1 + log_ratio
  (unbiased and non-negative).
* KL-penalised rewards (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
  Preferences"): r_t = -beta KL_t at each response token, plus the sequence score at the last one;
  beta is fixed or adapted towards a target KL:  e = clip(KL / target - 1, -0.2, 0.2),
  beta <- beta (1 + e n_steps / horizon).
* Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control
  Using Generalized Advantage Estimation"): delta_t = r_t + gamma V_{t+1} - V_t,
  A_t = delta_t + gamma lam A_{t+1}, returns R_t = A_t + V_t.
* Running reward moments combined exactly across batches and ranks (Chan, Golub & LeVeque 1979).

Conventions: per-token tensors are (B, T) and `mask` marks the action (response) tokens. Masked
tokens of a row are the consecutive time steps of one episode, which ends after the row's last
masked token; masked-out positions are ignored wherever they are (padding, or holes inside a
response), and every per-token output is exactly 0 there. Values at masked-out positions are never
read arithmetically into a result (selected with `torch.where`, not multiplied by the mask), so
-inf or NaN padding cannot leak in.

Functions computing batch statistics take `reduce`, a callable that sums a list of Python floats
over data-parallel ranks (None: one process). Local sums are accumulated in float64, reduced in
one call, and only then turned into means and variances, so every rank sees the statistics of the
global batch. Half-precision inputs are computed in fp32 and cast back (house convention, see
`hpcrlhf.algos.preference`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

from hpcrlhf.algos.logprobs import float_dtypes

Reduce = Callable[[list[float]], list[float]]

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")

# exp(20) ~ 4.9e8: far beyond any ratio that carries a useful signal, yet finite in fp32/bf16
# (exp overflows there beyond ~88) and, squared or multiplied by a reward, still finite.
_MAX_LOG_RATIO = 20.0


# ---- helpers ---------------------------------------------------------------------------------


def _local_sums(*sums: torch.Tensor) -> list[float]:
    """Scalar tensors -> Python floats (float64), with one device-to-host copy instead of one each."""
    return torch.stack([t.to(device=sums[-1].device, dtype=torch.float64) for t in sums]).tolist()


def _global(local: list[float], reduce: Reduce | None) -> list[float]:
    if reduce is None:
        return local
    summed = list(reduce(local))
    if len(summed) != len(local):
        raise ValueError(f"reduce returned {len(summed)} values for {len(local)} inputs")
    return summed


# ---- masked statistics -----------------------------------------------------------------------


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x over positions where mask is true (all dims if dim is None)."""
    kept = torch.where(mask.bool(), x, 0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """masked_sum / number of masked entries; an empty selection gives 0 rather than 0/0 = NaN."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    reduce: Reduce | None = None,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with the mean and population variance of the masked entries
    of the global batch; with shift_mean=False the mean is added back (rescaling only). 0 where
    mask is 0."""
    out, dt = float_dtypes(x)
    keep = mask.bool()
    xk = torch.where(keep, x.detach(), 0).double()
    n, s, ss = _global(_local_sums(keep.sum(), xk.sum(), xk.square().sum()), reduce)
    # One reduce of plain sums is all a sum-only collective allows. var = E[x^2] - mean^2
    # cancels badly only when |mean| >> std; in float64 that costs ~1e-16 * mean^2 / var,
    # invisible next to the fp32 precision of the inputs for any realistic advantages.
    mean = s / max(n, 1.0)
    var = max(ss / max(n, 1.0) - mean * mean, 0.0)
    white = (x.to(dt) - mean) / math.sqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return torch.where(keep, white, 0).to(out)


# ---- KL estimates and controllers ------------------------------------------------------------


def kl_estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    estimator: Literal["k1", "k2", "k3"],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi (Schulman's k1/k2/k3).

    log_ratio = logp - ref_logp; k1 = log_ratio, k2 = log_ratio^2 / 2,
    k3 = exp(-log_ratio) - 1 + log_ratio. For every estimator the log-ratio is first clamped
    to [-20, 20]: a token the reference (or the policy) gives log-prob -inf makes it +-inf, so
    k1 and k2 would be inf and k3's exp(-log_ratio) overflows in fp32 already below -88; a single
    inf poisons the reward or loss of the whole batch. (OpenRLHF bounds its estimates to
    [-10, 10], verl its k3 likewise.) The bound is far outside what PPO's updates reach (its
    ratio clip); k2 and k3 stay non-negative. Gradients flow to both inputs inside the bound
    (GRPO puts k3 in the loss), none outside; 0 where mask is 0.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    out, dt = float_dtypes(logp, ref_logp)
    lr = (logp.to(dt) - ref_logp.to(dt)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if estimator == "k1":
        kl = lr
    elif estimator == "k2":
        kl = 0.5 * lr.square()
    else:
        # expm1 keeps precision for small lr, where exp(-lr) - 1 and lr nearly cancel.
        kl = torch.expm1(-lr) + lr
    if mask is not None:
        kl = torch.where(mask.bool(), kl, 0)
    return kl.to(out)


class FixedKLController:
    """Constant KL coefficient; same interface as AdaptiveKLController."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller steering the KL coefficient towards a target KL (Ziegler et al. 2019).

    error = clip(current_kl / target - 1, -0.2, 0.2);  value *= 1 + error * n_steps / horizon.
    The clip bounds the per-update change, so one noisy KL estimate cannot swing the coefficient.
    Only `value` is checkpointed: target and horizon are configuration and come from the
    constructor, so a resumed run may change them.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if not target > 0:
            raise ValueError(f"target KL must be > 0, got {target}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def build_kl_controller(
    init_kl_coef: float, target: float | None, horizon: int
) -> FixedKLController | AdaptiveKLController:
    """Adaptive controller when a target KL is given, fixed coefficient otherwise."""
    if target is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, target, horizon)


# ---- rewards and returns ---------------------------------------------------------------------


def shape_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Per-token rewards (B, T): -kl_coef * kl at every masked token, plus scores[b] at the last
    masked token of row b (the reward model judges the whole response, so its score arrives when
    the episode ends). Rows without masked tokens get all zeros."""
    out, dt = float_dtypes(scores, kl)
    keep = mask.bool()
    pos = torch.arange(keep.shape[-1], device=keep.device)
    last = torch.where(keep, pos, -1).amax(-1, keepdim=True)  # -1 for an empty row: never matches
    is_last = keep & (pos == last)
    rewards = torch.where(keep, -kl_coef * kl.to(dt), 0)
    rewards = rewards + torch.where(is_last, scores.to(dt).unsqueeze(-1), 0)
    return rewards.to(out)


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the masked tokens of each row (Schulman et al. 2016).

    The masked tokens of a row are the steps of one episode that terminates after its last one
    (the value after it is 0); the "next" step of a masked token is the next masked token of the
    row, however many masked-out positions lie between. Returns (advantages, returns) with
    returns = advantages + values, both 0 where mask is 0. Inputs are detached.
    """
    out, dt = float_dtypes(rewards, values)
    keep = mask.bool()
    r, v = rewards.detach().to(dt), values.detach().to(dt)
    adv = torch.zeros_like(r)
    # Carried across masked-out positions, so they are skipped rather than treated as steps;
    # both start at 0, which is the terminal condition after the last masked token.
    next_value = r.new_zeros(r.shape[0])
    next_adv = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        m = keep[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, 0)
        next_value = torch.where(m, v[:, t], next_value)
        next_adv = torch.where(m, a, next_adv)
    returns = torch.where(keep, adv + v, 0)
    return adv.to(out), returns.to(out)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Returns-to-go G_t = r_t + gamma G_{t+1} over the masked tokens of each row (same "next
    masked token" rule as `gae_advantages`), 0 where mask is 0. Inputs are detached."""
    out, dt = float_dtypes(rewards)
    keep = mask.bool()
    r = rewards.detach().to(dt)
    ret = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        m = keep[:, t]
        running = torch.where(m, r[:, t] + gamma * running, running)
        ret[:, t] = torch.where(m, running, 0)
    return ret.to(out)


def clip_rewards(scores: torch.Tensor, clip: float | None) -> torch.Tensor:
    """Clamp scores to [-clip, clip]; None leaves them unchanged."""
    if clip is None:
        return scores
    if not clip > 0:
        raise ValueError(f"reward clip must be > 0 or None, got {clip}")
    return scores.clamp(-clip, clip)


class RunningMoments:
    """Running mean and population std of every score seen so far, exact in float64.

    Each batch (global over ranks via `reduce`) is folded in with Chan et al.'s parallel
    combination of (count, mean, M2), so the result equals the statistics of the concatenation
    of all batches, whatever their sizes. Before the first update mean = 0 and std = 1, so
    `normalize_scores` is the identity until there is data.
    """

    def __init__(self) -> None:
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean
        self.count = 0.0

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count > 0 else 1.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, x: torch.Tensor, reduce: Reduce | None = None) -> tuple[float, float]:
        """Fold in a batch of scores (all ranks call this with the same state); return (mean, std)."""
        # Sums of deviations from the current mean, which every rank holds identically: a shared
        # shift keeps the one-reduce variance free of cancellation once the mean has settled.
        d = x.detach().double().flatten() - self.mean
        n, s, ss = _global(_local_sums(torch.tensor(d.numel()), d.sum(), d.square().sum()), reduce)
        if n == 0:
            return self.mean, self.std
        delta = s / n  # batch mean minus running mean
        batch_m2 = max(ss - s * delta, 0.0)
        total = self.count + n
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total
        return self.mean, self.std

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "m2": self.m2, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.m2, self.count = float(state["mean"]), float(state["m2"]), float(state["count"])


def normalize_scores(scores: torch.Tensor, moments: RunningMoments, eps: float = 1e-8) -> torch.Tensor:
    """(scores - mean) / (std + eps) with the moments' current values."""
    out, dt = float_dtypes(scores)
    return ((scores.to(dt) - moments.mean) / (moments.std + eps)).to(out)


# ---- losses ----------------------------------------------------------------------------------


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"],
    normalizer: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss (B, T) to a scalar.

    token-mean:          sum of masked losses / (normalizer or number of masked tokens)
    seq-mean-token-mean: sum over rows of the row's masked mean / (normalizer or number of rows
                         with at least one masked token)
    seq-mean-token-sum:  sum over rows of the row's masked sum / (normalizer or number of rows);
                         a constant denominator, so long responses are not down-weighted per
                         token (Dr. GRPO, Liu et al. 2025)
    Each mode is a sum divided by a count, and `normalizer` replaces the count: a micro-batch
    divided by the count of the whole global mini-batch makes the sum of micro-batch losses (and
    gradients) over accumulation steps and ranks exactly the full-batch loss. Without a
    normalizer an empty selection gives 0, not NaN.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {mode!r}")
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0 or None, got {normalizer}")
    out, dt = float_dtypes(loss)
    keep = mask.bool()
    row_sums = torch.where(keep, loss.to(dt), 0).sum(-1)
    row_counts = keep.sum(-1)
    if mode == "token-mean":
        total, count = row_sums.sum(), row_counts.sum()
    elif mode == "seq-mean-token-mean":
        total, count = (row_sums / row_counts.clamp(min=1)).sum(), (row_counts > 0).sum()
    else:
        total, count = row_sums.sum(), torch.tensor(row_sums.shape[0])
    # Counts stay tensors (no .item()): no host sync per micro-batch on an accelerator.
    denom = normalizer if normalizer is not None else count.to(device=total.device, dtype=dt).clamp(min=1)
    return (total / denom).to(out)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
    ratio_level: str = "token",
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss (Schulman et al. 2017), optionally asymmetric and dual-clipped.

    Per token, with ratio = exp(logp - old_logp) and A the advantage:
        l1 = -A ratio,  l2 = -A clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high),  l = max(l1, l2)
    clip_eps_high defaults to clip_eps_low (DAPO's clip-higher sets it larger). Dual clip (Ye et
    al. 2020, dual_clip = c > 1): where A < 0, l = min(l, -A c). The log-ratio is clamped to
    [-20, 20] before exp so an extreme token gives a large finite ratio instead of inf (whose
    0 * inf gradients would be NaN); tokens that far off are clipped anyway. old_logp and
    advantages are detached. `token_weights` (detached) multiply l token by token: the truncated
    importance weights of `truncated_is_weights`. The scalar loss is `aggregate_loss(l, mask,
    aggregation, normalizer)`.

    ratio_level="sequence" is GSPO (Zheng et al. 2025): one ratio per response, the geometric
    mean of its token ratios, s_i = exp(mean_t (logp - old_logp)), clipped as a whole. It is
    written in GSPO-token form, s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]: each token's ratio has
    the value s_i and the gradient s_i * grad log pi(y_t). With per-response advantages and
    aggregation "seq-mean-token-mean" that is exactly GSPO's objective and gradient,
    1/G sum_i min(s_i A_i, clip(s_i) A_i). (GSPO's clip ranges are ~1000x smaller than PPO's:
    the paper uses 3e-4 / 4e-4.)

    Stats (detached sums over masked tokens, not means, so that micro-batches and ranks can be
    summed exactly before dividing by "tokens"):
        clipfrac_sum   tokens where clipping is active (l2 > l1: the gradient through the ratio
                       is cut)
        approx_kl_sum  sum of 0.5 (logp - old_logp)^2 (the k2 estimate of KL(old || new))
        ratio_sum      sum of ratios (sequence level: each token counts its response's s_i)
        tokens         number of masked tokens
    """
    high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if clip_eps_low < 0 or high < 0:
        raise ValueError(f"clip_eps_low and clip_eps_high must be >= 0, got {clip_eps_low}, {high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    out, dt = float_dtypes(logp, old_logp, advantages)
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    keep = mask.bool()
    adv = advantages.detach().to(dt)
    token_log_ratio = logp.to(dt) - old_logp.detach().to(dt)
    log_ratio = token_log_ratio
    if ratio_level == "sequence":
        sequence = masked_mean(token_log_ratio.detach(), keep, dim=-1).unsqueeze(-1)  # log s_i, (B, 1)
        log_ratio = sequence + token_log_ratio - token_log_ratio.detach()  # value log s_i, gradient grad log pi(y_t)
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + high)
    loss = torch.maximum(l1, l2)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip), loss)
    if token_weights is not None:
        loss = loss * token_weights.detach().to(dt)
    total = aggregate_loss(loss, keep, aggregation, normalizer)  # type: ignore[arg-type]
    with torch.no_grad():
        stats = {
            "clipfrac_sum": (keep & (l2 > l1)).sum().to(dt),
            "approx_kl_sum": masked_sum(0.5 * token_log_ratio.square(), keep),
            "ratio_sum": masked_sum(ratio, keep),
            "tokens": keep.sum().to(dt),
        }
    return total.to(out), stats


def truncated_is_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings
    you off-policy RL training"): per token min(pi_old(y_t) / pi_behaviour(y_t), cap), pi_behaviour
    the policy that generated the token (the rollout engine: other numerics, or weights an update
    behind), pi_old the trainer's recomputation the PPO ratio is taken against. 0 off the mask."""
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    log_w = (old_logp.detach().double() - behaviour_logp.detach().double()).clamp(max=math.log(cap))
    return torch.where(mask.bool(), torch.exp(log_w), torch.zeros_like(log_w)).to(old_logp.dtype)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float | None = None,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss 0.5 (V - R)^2 per token, or with clip_eps the pessimistic clipped form
    0.5 max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, -eps, eps), which keeps
    the critic from moving far from the values the advantages were computed with. Aggregated
    with `aggregate_loss`; stats as in `policy_loss`: "clipfrac_sum" (tokens where the clipped
    term is the larger one) and "tokens"."""
    if clip_eps is not None and not clip_eps > 0:
        raise ValueError(f"value clip_eps must be > 0 or None, got {clip_eps}")
    out, dt = float_dtypes(values, old_values, returns)
    keep = mask.bool()
    v, target = values.to(dt), returns.detach().to(dt)
    err = (v - target).square()
    if clip_eps is None:
        loss, clipped = 0.5 * err, torch.zeros_like(keep)
    else:
        v_old = old_values.detach().to(dt)
        err_clipped = (v_old + (v - v_old).clamp(-clip_eps, clip_eps) - target).square()
        loss, clipped = 0.5 * torch.maximum(err, err_clipped), err_clipped > err
    total = aggregate_loss(loss, keep, aggregation, normalizer)  # type: ignore[arg-type]
    stats = {"clipfrac_sum": (keep & clipped).sum().to(dt), "tokens": keep.sum().to(dt)}
    return total.to(out), stats


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (B, T) of softmax(logits) over the last dim, in fp32.

    -sum p log p with log p from log_softmax (logsumexp-shifted: no overflow for huge logits).
    log p is floored at the most negative finite float so -inf logits (banned tokens) give
    p log p = 0 * finite = 0 rather than 0 * -inf = NaN, in the value and in the gradient.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)
