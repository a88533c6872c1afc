"""The PPO losses on per-token tensors: the clipped policy surrogate and the value loss, their
aggregation to a scalar, the policy's entropy and the importance weights that correct for the
rollout engine's policy (truncated or masked).

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

The rest of a PPO step's maths: `masked`, `kl`, `reward_shaping`, `advantages` (conventions:
`hpcrlhf.algos`).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from hpcrlhf.algos.kl import MAX_LOG_RATIO
from hpcrlhf.algos.logprobs import float_dtypes
from hpcrlhf.algos.masked import masked_mean, masked_sum

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
RATIO_LEVELS = ("token", "sequence")


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
    importance weights of `importance_weights`. The scalar loss is `aggregate_loss(l, mask,
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
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
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


IS_MODES = ("truncate", "mask", "seq_mask")


def importance_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, *, cap: float,
                       floor: float | None = None, mode: str = "truncate") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights correcting the policy loss for the policy that generated each token.

    With r_t = pi_old(y_t) / pi_behaviour(y_t) -- pi_behaviour the rollout engine's policy (other numerics,
    or weights some updates behind), pi_old the trainer's recomputation the PPO ratio is taken against --
    C = `cap` and L = `floor`:
        truncate  w_t = min(r_t, C), and max(., L) with a floor: truncated importance sampling (Yao et al.
                  2025, "Your efficient RL framework secretly brings you off-policy RL training"; the floor
                  is slime's tis_clip_low)
        mask      w_t = r_t 1[L <= r_t <= C], L = floor or 1/C: tokens whose ratio left the band count nothing
                  (masked importance sampling, token level; verl's rollout_is "token" mask mode, icepop)
        seq_mask  g_i = exp(mean_t log r_t) over the response's tokens; w_t = min(r_t, C) 1[L <= g_i <= C]: a
                  response whose geometric-mean ratio left the band counts nothing (verl's "geometric" mode)
    A masked token keeps its place in the loss's denominator (the caller's mask is unchanged): it adds 0,
    and the kept tokens' gradients are not inflated (AReaL's choice). Computed in float64 on detached
    inputs; 0 off the mask; a token both policies give log-prob -inf has r = 1.

    Stats (float64 sums, so micro-batches and ranks add up): weight_sum (of w over the mask), truncated
    (tokens whose w was cut to C or L: truncate and seq_mask), masked (tokens set to 0 by the band, either mask
    mode), masked_seqs (responses masked by seq_mask), tokens, seqs (responses with a masked-in token)."""
    if mode not in IS_MODES:
        raise ValueError(f"importance weight mode must be one of {IS_MODES}, got {mode!r}")
    if not cap >= 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    if floor is not None and not 0 < floor <= 1:
        raise ValueError(f"floor must be in (0, 1] or None, got {floor}")
    keep = mask.bool()
    log_r = old_logp.detach().double() - behaviour_logp.detach().double()
    log_r = torch.where(keep & ~log_r.isnan(), log_r, torch.zeros_like(log_r))  # -inf - -inf: the same policy there
    high = math.log(cap)
    floor_low = math.log(floor) if floor is not None else -math.inf  # a weight's own lower bound: the floor only
    band_low = math.log(floor) if floor is not None else -high  # the masks' band: [1/C, C] without a floor
    zero, kept_rows = torch.zeros_like(log_r), keep.any(-1)
    masked_seqs = log_r.new_zeros(())
    if mode == "mask":
        band = (log_r >= band_low) & (log_r <= high)
        w = torch.where(keep & band, torch.exp(log_r), zero)
        masked, cut = (keep & ~band).sum().double(), torch.zeros_like(keep)
    else:
        w = torch.where(keep, torch.exp(log_r.clamp(min=floor_low, max=high)), zero)
        cut = keep & ((log_r > high) | (log_r < floor_low))
        out_rows = torch.zeros_like(kept_rows)
        if mode == "seq_mask":
            log_g = torch.where(keep, log_r, zero).sum(-1) / keep.sum(-1).clamp(min=1)
            out_rows = kept_rows & ~((log_g >= band_low) & (log_g <= high))  # NaN (inf - inf) leaves the band too
            w = torch.where(out_rows.unsqueeze(-1), zero, w)
            cut = cut & ~out_rows.unsqueeze(-1)
        masked, masked_seqs = (keep & out_rows.unsqueeze(-1)).sum().double(), out_rows.sum().double()
    truncated = cut.sum().double()
    stats = {"weight_sum": w.sum(), "truncated": truncated, "masked": masked, "masked_seqs": masked_seqs,
             "tokens": keep.sum().double(), "seqs": kept_rows.sum().double()}
    return w.to(old_logp.dtype), stats


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
