"""KL estimates and the KL coefficient's controllers.

* KL estimators (Schulman 2020, "Approximating KL Divergence", the k1/k2/k3 estimators), from
  samples of pi with log_ratio = log pi - log ref:  k1 = log_ratio (unbiased, can be negative),
  k2 = log_ratio^2 / 2 (biased, low variance), k3 = exp(-log_ratio) - 1 + log_ratio
  (unbiased and non-negative).
* The KL penalty's coefficient beta (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
  Preferences") is fixed or adapted towards a target KL:  e = clip(KL / target - 1, -0.2, 0.2),
  beta <- beta (1 + e n_steps / horizon). The penalised rewards: `reward_shaping.shape_rewards`.
"""

from __future__ import annotations

from typing import Literal

import torch

from hpcrlhf.algos.logprobs import float_dtypes

KL_ESTIMATORS = ("k1", "k2", "k3")

# exp(20) ~ 4.9e8: far beyond any ratio that carries a useful signal, yet finite in fp32/bf16
# (exp overflows there beyond ~88) and, squared or multiplied by a reward, still finite.
MAX_LOG_RATIO = 20.0
# The estimate itself is bounded too, as OpenRLHF's `compute_approx_kl` (every estimator) and verl's
# low-variance KL (k3) bound theirs: k3 grows as exp(-log_ratio), so one token the policy has made
# e^11 times less likely than the reference gives ~6e4 (gradient ~-6e4) -- at init_kl_coef 0.05 that
# takes ~3,000 off its sequence's score, or dominates the loss's gradient with kl_loss_coef.
MAX_KL = 10.0


def kl_estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    estimator: Literal["k1", "k2", "k3"],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi (Schulman's k1/k2/k3).

    log_ratio = logp - ref_logp; k1 = log_ratio, k2 = log_ratio^2 / 2,
    k3 = exp(-log_ratio) - 1 + log_ratio. Two bounds, for every estimator:
    - the log-ratio is first clamped to [-20, 20]: a token the reference (or the policy) gives
      log-prob -inf makes it +-inf, so k1 and k2 would be inf and k3's exp(-log_ratio) overflows
      in fp32 already below -88; a single inf poisons the reward or loss of the whole batch;
    - the estimate is then clamped to [-10, 10] (MAX_KL), as OpenRLHF and verl bound theirs. PPO's
      ratio clip bounds pi / pi_old, not pi / pi_ref, so nothing else keeps one token's k3
      (exp(11) - 12 ~ 6e4 at log-ratio -11) from outweighing the batch; off-policy training makes
      such tokens likelier. k3 reaches 10 at log-ratio ~ -2.5 (the policy ~12x below the
      reference on that token) and ~ +11; k2 at |log-ratio| ~ 4.5; k1 at |log-ratio| 10.
    k2 and k3 stay non-negative. Gradients flow to both inputs inside the bounds (GRPO puts k3 in
    the loss), none outside them; 0 where mask is 0.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    out, dt = float_dtypes(logp, ref_logp)
    lr = (logp.to(dt) - ref_logp.to(dt)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if estimator == "k1":
        kl = lr
    elif estimator == "k2":
        kl = 0.5 * lr.square()
    else:
        # expm1 keeps precision for small lr, where exp(-lr) - 1 and lr nearly cancel.
        kl = torch.expm1(-lr) + lr
    kl = kl.clamp(-MAX_KL, MAX_KL)
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
