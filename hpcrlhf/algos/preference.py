"""Preference-learning losses: reward-model pairs, DPO / cDPO / IPO, and KTO.

Pure tensor maths on per-sequence log-probabilities (batch dimension first); the trainers
compute those with `token_logprobs` + `sequence_logprobs`. Conventions shared by all losses:

* Half-precision inputs are upcast to fp32 for the arithmetic (differences of summed
  log-probs cancel badly in bf16) and results are cast back to the inputs' dtype, so any
  float dtype comes out as it went in. fp32 is the floor rather than fp64 because some
  accelerators (e.g. Apple MPS) have no fp64.
* Reference-model log-probs and KL estimates are detached here, so the reference is a
  constant even if a caller forgets `torch.no_grad()`; reported rewards are detached too.
* log(sigmoid(x)) is always `F.logsigmoid` (stable for |x| in the thousands, where
  `torch.log(torch.sigmoid(x))` gives -inf), and 1 - sigmoid(x) is written sigmoid(-x)
  (no cancellation when sigmoid(x) rounds to 1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from hpcrlhf.algos.logprobs import float_dtypes

LOSS_TYPES = ("dpo", "ipo", "cdpo")


class PreferenceLossOutput(NamedTuple):
    loss: torch.Tensor  # scalar, mean over the batch
    chosen_rewards: torch.Tensor  # (B,) beta * (policy - ref) on chosen, detached
    rejected_rewards: torch.Tensor  # (B,) same on rejected, detached
    margins: torch.Tensor  # (B,) chosen_rewards - rejected_rewards
    accuracy: torch.Tensor  # scalar, mean(margins > 0)


class KTOLossOutput(NamedTuple):
    loss: torch.Tensor  # scalar, mean over the batch of weighted per-sample losses
    chosen_rewards_mean: torch.Tensor  # mean beta * (policy - ref) on desirable; 0 if none
    rejected_rewards_mean: torch.Tensor  # same on undesirable; 0 if none
    kl: torch.Tensor  # z0 = clamp(kl_estimate, min=0), detached


def sequence_logprobs(token_logps: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Per-sequence log-probability from per-token ones, reducing the last dimension.

    sum:     log p(y|x) = sum_t mask_t * logp_t
    average: sum_t mask_t * logp_t / max(sum_t mask_t, 1)   (IPO uses this length-normalised form)
    A sequence with no masked-in tokens gets 0 (not NaN) in both modes.
    """
    out, dt = float_dtypes(token_logps)
    keep = mask.bool()
    # `where`, not multiplication: a -inf log-prob at a padded position would give -inf * 0 = NaN.
    total = torch.where(keep, token_logps.to(dt), 0).sum(-1)  # accumulate in >= fp32
    if average:
        total = total / keep.sum(-1).clamp(min=1).to(dt)
    return total.to(out)


def pairwise_rm_loss(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, margin: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bradley-Terry reward-model loss and pairwise accuracy.

    loss     = mean_i -log sigmoid(r_c,i - r_r,i - m_i)   (Ouyang et al. 2022, InstructGPT;
               the margin m is the Llama-2 variant, Touvron et al. 2023; m = 0 if None)
    accuracy = mean_i [r_c,i > r_r,i]   (ties count as wrong; the margin does not enter)
    """
    out, dt = float_dtypes(chosen_rewards, rejected_rewards)
    diff = chosen_rewards.to(dt) - rejected_rewards.to(dt)
    if margin is not None:
        diff = diff - torch.as_tensor(margin, dtype=dt, device=diff.device)
    loss = -F.logsigmoid(diff).mean()
    accuracy = (chosen_rewards > rejected_rewards).to(dt).mean()
    return loss.to(out), accuracy.to(out)


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "dpo",
    label_smoothing: float = 0.0,
) -> PreferenceLossOutput:
    """Direct preference losses on per-sequence log-probs, all built on the log-ratio margin

        h = (pi_c - ref_c) - (pi_r - ref_r)

    dpo  (Rafailov et al. 2023):  -log sigmoid(beta h)
    cdpo (conservative DPO, label smoothing eps in [0, 0.5); Mitchell 2023):
                                  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
    ipo  (Azar et al. 2023):      (h - 1 / (2 beta))^2
    each averaged over the batch. IPO is defined on token-averaged log-probs, so the trainer
    passes `sequence_logprobs(..., average=True)` for it; this function uses whatever it is given.
    Rewards are beta * (pi - ref) (detached), margins = chosen - rejected rewards,
    accuracy = mean(margins > 0).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if loss_type == "cdpo" and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5) for loss_type='cdpo', got {label_smoothing}")
    if loss_type != "cdpo" and label_smoothing != 0.0:
        raise ValueError(
            f"label_smoothing must be 0 for loss_type={loss_type!r}, got {label_smoothing}; "
            "use loss_type='cdpo' for label smoothing"
        )
    out, dt = float_dtypes(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    chosen_ratio = policy_chosen_logps.to(dt) - ref_chosen_logps.detach().to(dt)
    rejected_ratio = policy_rejected_logps.to(dt) - ref_rejected_logps.detach().to(dt)
    h = chosen_ratio - rejected_ratio
    if loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    elif loss_type == "cdpo":
        eps = label_smoothing
        losses = -(1.0 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    else:
        losses = -F.logsigmoid(beta * h)
    chosen_rewards = (beta * chosen_ratio).detach()
    rejected_rewards = (beta * rejected_ratio).detach()
    margins = chosen_rewards - rejected_rewards
    accuracy = (margins > 0).to(dt).mean()
    return PreferenceLossOutput(
        losses.mean().to(out), chosen_rewards.to(out), rejected_rewards.to(out), margins.to(out), accuracy.to(out)
    )


def mismatched_pairs(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Index j(i) = (i + 1) % n: a deterministic derangement (j(i) != i for every i).

    KTO (Ethayarajh et al. 2024) estimates the reference point z0 = KL(pi || ref) from
    completions that do *not* answer their prompt: the mismatched batch pairs prompt i with
    completion j(i), so the estimate measures how far the policy drifted in general rather than
    on the very completions being rewarded. A cyclic shift is a derangement for n >= 2 and
    is reproducible across ranks and steps; n = 1 has none, hence the error.
    """
    if n < 2:
        raise ValueError(f"mismatched_pairs needs n >= 2 samples to pair unrelated completions, got n={n}")
    return torch.roll(torch.arange(n, device=device), -1)


def kto_kl_estimate(policy_mismatched_logps: torch.Tensor, ref_mismatched_logps: torch.Tensor) -> torch.Tensor:
    """KTO reference point before clamping: mean_i (pi(y_j(i)|x_i) - ref(y_j(i)|x_i)), detached.

    A Monte-Carlo estimate of KL(pi || ref) on mismatched pairs (see `mismatched_pairs`),
    Ethayarajh et al. 2024. Left unclamped so callers can all-reduce (average) it across ranks
    first; `kto_loss` applies the clamp at 0.
    """
    out, dt = float_dtypes(policy_mismatched_logps, ref_mismatched_logps)
    return (policy_mismatched_logps.to(dt) - ref_mismatched_logps.to(dt)).mean().detach().to(out)


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    is_desirable: torch.Tensor,
    kl_estimate: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> KTOLossOutput:
    """Kahneman-Tversky Optimisation loss (Ethayarajh et al. 2024) on unpaired feedback.

    r_i = pi_i - ref_i,  z0 = max(kl_estimate, 0) (detached)
    desirable:   l_i = w_d * (1 - sigmoid(beta (r_i - z0)))
    undesirable: l_i = w_u * (1 - sigmoid(beta (z0 - r_i)))
    loss = mean_i l_i over the whole batch (TRL's normalisation: the weighted per-sample losses
    of both kinds concatenated and averaged), so one-sided batches need no special case. The
    paper suggests w_d n_d / (w_u n_u) in [1, 4/3]. Reported rewards are beta * r_i, averaged
    per kind (0 for a kind absent from the batch).
    """
    if is_desirable.dtype != torch.bool:
        raise ValueError(f"is_desirable must be a bool tensor, got {is_desirable.dtype}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(
            f"desirable_weight and undesirable_weight must be >= 0, got {desirable_weight}, {undesirable_weight}"
        )
    out, dt = float_dtypes(policy_logps, ref_logps, kl_estimate)
    r = policy_logps.to(dt) - ref_logps.detach().to(dt)
    z0 = kl_estimate.detach().to(dt).clamp(min=0)
    # 1 - sigmoid(x) == sigmoid(-x), without cancellation once sigmoid(x) rounds to 1.
    losses = torch.where(
        is_desirable,
        desirable_weight * torch.sigmoid(beta * (z0 - r)),
        undesirable_weight * torch.sigmoid(beta * (r - z0)),
    )
    rewards = (beta * r).detach()
    n_d = is_desirable.sum()
    n_u = is_desirable.numel() - n_d
    # Sums over masks divided by clamped counts: an empty group gives 0 instead of 0/0 = NaN.
    chosen_mean = torch.where(is_desirable, rewards, 0).sum() / n_d.clamp(min=1)
    rejected_mean = torch.where(is_desirable, 0, rewards).sum() / n_u.clamp(min=1)
    return KTOLossOutput(losses.mean().to(out), chosen_mean.to(out), rejected_mean.to(out), z0.to(out))
