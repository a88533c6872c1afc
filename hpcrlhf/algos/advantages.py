"""Advantage estimators for the PPO loop, behind one entry point, `compute_advantages`, and the
token-level recursions they use: GAE and discounted returns.

* gae (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
  Estimation"): token-level GAE against a learned critic, `gae_advantages`:
  delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, returns R_t = A_t + V_t;
  advantages optionally whitened over the global batch.
* grpo (Shao et al. 2024, DeepSeekMath): no critic; each response's score is compared with the
  other samples of its prompt, A_i = (s_i - mean_group) / (std_group + eps), with the unbiased
  sample std (torch.std's default, as in DeepSeekMath's code and TRL).
* dr_grpo (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = s_i - mean_group, no
  division by the group's std, which up-weights prompts whose samples barely differ. The paper
  pairs it with a loss normalised by a constant rather than each response's length
  (`ppo.loss_aggregation=seq-mean-token-sum`).
* rloo (Ahmadian et al. 2024, "Back to Basics"): REINFORCE with a leave-one-out baseline,
  A_i = s_i - mean of the other n - 1 scores of its group (an unbiased baseline, since it does
  not depend on sample i).
* reinforce_baseline (OpenRLHF's `reinforce_baseline`): REINFORCE with a per-prompt baseline,
  A_i = s_i - mean_group, then whitened over the global batch (if `whiten`): Dr. GRPO's centring
  with one batch-wide scale instead of none.
* reinforce++ (Hu 2025): token-level rewards (KL penalty per token, score at the last token, as
  `reward_shaping.shape_rewards` builds them) -> discounted returns-to-go -> whitened over all masked
  tokens of the global batch; the whitening mean is the baseline.

Sequence-level estimators take `scores` (B,) laid out in groups of `group_size` consecutive rows,
the samples of one prompt: rows [g n, (g + 1) n). Their per-sequence advantage is broadcast to
every response token. For grpo and rloo the per-token KL penalty is *not* part of the advantage:
either the loss carries it (GRPO's k3 term, `kl.kl_estimate`) or the caller folds a sequence KL
into `scores` before calling. Every output is 0 outside the mask (conventions: `hpcrlhf.algos`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hpcrlhf.algos.estimators import ADVANTAGE_ESTIMATORS, CRITIC_FREE, ESTIMATORS  # noqa: F401 (re-exported)
from hpcrlhf.algos.logprobs import float_dtypes
from hpcrlhf.algos.masked import Reduce, masked_whiten


# ---- token level: GAE and returns-to-go ------------------------------------------------------


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


# ---- sequence level: scores compared within their prompt's group ------------------------------


def _groups(scores: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    """scores (B,) -> (B / n, n) in at least fp32, after checking the layout."""
    if scores.dim() != 1:
        raise ValueError(f"{name}: scores must have shape (B,), got {tuple(scores.shape)}")
    if group_size < 2:
        raise ValueError(f"{name} needs group_size >= 2 samples per prompt to form a baseline, got {group_size}")
    if scores.shape[0] % group_size != 0:
        raise ValueError(
            f"{name}: batch of {scores.shape[0]} scores is not a multiple of group_size={group_size} "
            "(each prompt's samples must be consecutive rows of complete groups)"
        )
    dt = torch.promote_types(scores.dtype, torch.float32)
    return scores.detach().to(dt).view(-1, group_size)


def grpo_advantages(
    scores: torch.Tensor, group_size: int, *, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """(score - group mean) / (group std + eps), unbiased std; std_normalize=False: score - group mean."""
    g = _groups(scores, group_size, "grpo")
    adv = g - g.mean(-1, keepdim=True)
    if std_normalize:
        # eps keeps a group of identical scores (std 0) at advantage 0 instead of 0/0.
        adv = adv / (g.std(-1, keepdim=True) + eps)
    return adv.flatten().to(scores.dtype)


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """score_i - mean of the other group_size - 1 scores of its group."""
    g = _groups(scores, group_size, "rloo")
    others_mean = (g.sum(-1, keepdim=True) - g) / (group_size - 1)
    return (g - others_mean).flatten().to(scores.dtype)


def broadcast_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, T): each row's value on its masked tokens, 0 elsewhere."""
    return torch.where(mask.bool(), seq_values.unsqueeze(-1), 0).to(seq_values.dtype)


def reinforce_pp_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, reduce: Reduce | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: (whitened returns-to-go, returns-to-go), whitened over the global batch's masked tokens."""
    returns = discounted_returns(rewards, mask, gamma)
    return masked_whiten(returns, mask, reduce=reduce), returns


# ---- dispatch --------------------------------------------------------------------------------
# Each entry takes the keyword arguments of `compute_advantages` (minus the name) and returns
# (advantages, returns); adding an estimator is one function and one registry line.


def _gae(*, rewards, mask, values, gamma, lam, whiten, reduce, **_) -> tuple[torch.Tensor, torch.Tensor]:
    if values is None:
        raise ValueError("advantage estimator 'gae' needs critic values, got values=None")
    adv, returns = gae_advantages(rewards, values, mask, gamma, lam)
    if whiten:
        adv = masked_whiten(adv, mask, reduce=reduce)
    return adv, returns


def _grpo(*, mask, scores, group_size, **_) -> tuple[torch.Tensor, torch.Tensor]:
    # Already normalised within each group, so the `whiten` flag does not apply.
    adv = broadcast_to_tokens(grpo_advantages(_need_scores(scores, "grpo"), group_size), mask)
    return adv, adv


def _dr_grpo(*, mask, scores, group_size, **_) -> tuple[torch.Tensor, torch.Tensor]:
    adv = grpo_advantages(_need_scores(scores, "dr_grpo"), group_size, std_normalize=False)
    adv = broadcast_to_tokens(adv, mask)
    return adv, adv


def _reinforce_baseline(*, mask, scores, group_size, whiten, reduce, **_) -> tuple[torch.Tensor, torch.Tensor]:
    adv = grpo_advantages(_need_scores(scores, "reinforce_baseline"), group_size, std_normalize=False)
    adv = broadcast_to_tokens(adv, mask)
    if whiten:
        adv = masked_whiten(adv, mask, reduce=reduce)
    return adv, adv


def _rloo(*, mask, scores, group_size, whiten, reduce, **_) -> tuple[torch.Tensor, torch.Tensor]:
    adv = broadcast_to_tokens(rloo_advantages(_need_scores(scores, "rloo"), group_size), mask)
    if whiten:
        adv = masked_whiten(adv, mask, reduce=reduce)
    return adv, adv


def _reinforce_pp(*, rewards, mask, gamma, reduce, **_) -> tuple[torch.Tensor, torch.Tensor]:
    # Whitened by definition (the batch mean is REINFORCE++'s baseline): `whiten` does not apply.
    return reinforce_pp_advantages(rewards, mask, gamma=gamma, reduce=reduce)


def _need_scores(scores: torch.Tensor | None, name: str) -> torch.Tensor:
    if scores is None:
        raise ValueError(f"advantage estimator {name!r} needs per-sequence scores, got scores=None")
    return scores


_COMPUTE: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": _gae,
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
    "reinforce++": _reinforce_pp,
    "reinforce_baseline": _reinforce_baseline,
}
"""How each estimator of `algos.estimators.ESTIMATORS` (what it needs) computes."""


def compute_advantages(
    estimator: str,
    *,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    scores: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    group_size: int = 1,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both (B, T) and 0 outside mask, for the named estimator.

    gae:         GAE on token `rewards` and critic `values` (required); returns = A + V before
                 whitening; advantages whitened globally (via `reduce`) if `whiten`.
    grpo:        group-normalised `scores` broadcast to tokens; `whiten` ignored (already
                 normalised per group); returns = advantages (there is no critic to fit).
    dr_grpo:     group-centred `scores` (no std division) broadcast to tokens; `whiten` ignored.
    reinforce_baseline: group-centred `scores` broadcast to tokens, whitened globally if `whiten`.
    rloo:        leave-one-out `scores` broadcast to tokens, whitened globally if `whiten`;
                 returns = advantages.
    reinforce++: whitened returns-to-go of token `rewards`; whitening is part of the estimator,
                 so `whiten` is ignored; returns = the unwhitened returns-to-go.
    For the sequence-level ones (grpo, dr_grpo, rloo, reinforce_baseline) the token-level KL penalty is not in the advantage (see module docstring);
    `rewards` is unused by them.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
    return _COMPUTE[estimator](
        rewards=rewards,
        mask=mask,
        scores=scores,
        values=values,
        group_size=group_size,
        gamma=gamma,
        lam=lam,
        whiten=whiten,
        reduce=reduce,
    )
