"""What each advantage estimator needs: the one record config validation, the PPO trainer and
the node map (`hpcrlhf plan`) ask. The maths is in `algos.advantages` (same names); this module
imports nothing, so configs and plans load without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Estimator:
    name: str
    needs_critic: bool
    """Learns a value model (the critic role) and uses its values."""
    needs_groups: bool
    """Compares the samples of each prompt: rollout.samples_per_prompt >= 2."""
    sequence_level: bool
    """Works on one score per response, so a per-token KL penalty joins the score (summed over
    the response) before the baseline, instead of the per-token rewards."""
    summary: str


ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    Estimator("gae", needs_critic=True, needs_groups=False, sequence_level=False,
              summary="a critic and GAE (PPO)"),
    Estimator("grpo", needs_critic=False, needs_groups=True, sequence_level=True,
              summary="group-normalised scores (Shao et al. 2024)"),
    Estimator("dr_grpo", needs_critic=False, needs_groups=True, sequence_level=True,
              summary="group-centred scores without the std division (Liu et al. 2025)"),
    Estimator("rloo", needs_critic=False, needs_groups=True, sequence_level=True,
              summary="leave-one-out baseline (Ahmadian et al. 2024)"),
    Estimator("reinforce++", needs_critic=False, needs_groups=False, sequence_level=False,
              summary="globally whitened returns (Hu 2025)"),
    Estimator("reinforce_baseline", needs_critic=False, needs_groups=True, sequence_level=True,
              summary="REINFORCE with a per-prompt mean baseline, whitened over the batch (OpenRLHF)"),
)}
ADVANTAGE_ESTIMATORS = tuple(ESTIMATORS)
CRITIC_FREE = frozenset(name for name, e in ESTIMATORS.items() if not e.needs_critic)
CRITIC_FREE_NAMES = tuple(name for name in ADVANTAGE_ESTIMATORS if name in CRITIC_FREE)
"""The critic-free estimators in registration order (for messages)."""
