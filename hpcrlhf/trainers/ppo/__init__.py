"""Which runtime runs a PPO job: this process (and its torchrun peers) with every model here, or
Ray, with every role on its own workers placed by the node map (`placement.runtime`)."""

from __future__ import annotations

from hpcrlhf.config.schema import PPOConfig


def run_ppo(cfg: PPOConfig) -> dict:
    if cfg.placement.runtime == "ray":
        from hpcrlhf.trainers.ppo.ray.entry import run_ray_ppo

        return run_ray_ppo(cfg)
    from hpcrlhf.trainers.ppo.driver import PPOTrainer

    return PPOTrainer(cfg).fit()
