"""PPO and its critic-free relatives (GRPO, Dr. GRPO, RLOO, REINFORCE++, DAPO's dynamic sampling):
`run_ppo` runs a job in this process (and its torchrun peers) with every model here, or on Ray
with every role on its own workers placed by the node map (`placement.runtime`).

One step, file by file (local runtime; docs/architecture.md walks it in more detail):

    driver.py       PPOTrainer.train_step: rollout -> experience -> updates -> weight sync
    ../online.py    launch_rollout / score_rollout: generate, then score with the reward set
    experience.py   rollout_batch: the rollout as one ExperienceBatch, the shape every role sees
    roles.py        LocalRoles: score_tokens (log-probs, values), learn, push_weights
    learner.py      token_scores (forward passes) and PPOLearner.update (the PPO epochs)

Around them: phases.py (who sleeps between phases), staleness.py (a rollout generated one step
ahead), dynamic_sampling.py (DAPO's refill rounds); on Ray, ray/ replaces roles.py's LocalRoles.
"""

from __future__ import annotations

from hpcrlhf.config.schema import PPOConfig


def run_ppo(cfg: PPOConfig) -> dict:
    # Imported here, not at the top: this __init__ runs whenever any module of the package is
    # imported (every Ray role worker imports ppo.ray.workers), and those need neither the driver
    # nor the Ray entry point.
    if cfg.placement.runtime == "ray":
        from hpcrlhf.trainers.ppo.ray.entry import run_ray_ppo  # as said above

        return run_ray_ppo(cfg)
    from hpcrlhf.trainers.ppo.driver import PPOTrainer  # as said above

    trainer = PPOTrainer(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()  # an engine loop's thread and engine, an agent's environment workers
