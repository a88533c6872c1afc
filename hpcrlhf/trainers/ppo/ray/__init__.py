"""PPO on Ray: the same driver (`trainers.ppo.driver.PPOTrainer`), its roles on Ray workers placed by
the node map.

    entry.py        `run_ray_ppo`: plan, check, start or join the cluster, reserve, train, clean up
    roles.py        `RayRoles` (the driver's roles interface on worker groups), `RemoteRewards`
    workers.py      the role workers (actor, critic, reference, reward), one Ray actor per rank
    weight_push.py  `WeightPush`: the actor's weights into the vLLM engines
"""
