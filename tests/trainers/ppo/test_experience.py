"""How a rollout's batch is packed, split over ranks and joined again (the Ray driver sends
`ExperienceBatch` row shards to every role's ranks: forward passes, updates, and back the scores)."""

from __future__ import annotations

import torch

from hpcrlhf.trainers.ppo.experience import ExperienceBatch, collate_experience


def batch(lengths: list[int]) -> ExperienceBatch:
    width, n = max(lengths), len(lengths)
    ids = torch.zeros(n, width, dtype=torch.long)
    labels = torch.full((n, width), -100)
    for i, length in enumerate(lengths):
        ids[i, :length] = torch.arange(1, length + 1) + 100 * i
        labels[i, 1 : length - 1] = ids[i, 2:length]  # the last two positions predict the response
    floats = torch.randn(n, width, generator=torch.Generator().manual_seed(0))
    return ExperienceBatch({"input_ids": ids, "labels": labels, "old_logps": floats, "advantages": floats * 2,
                            "returns": floats * 3, "values": None, "ref_logps": None}, lengths)


def test_rows_are_trimmed_to_their_lengths_and_shards_concatenate_to_the_whole():
    b = batch([5, 3, 7, 2, 6])
    rows = b.rows()
    assert [len(e.input_ids) for e in rows] == [5, 3, 7, 2, 6]
    assert rows[1].values is None and torch.equal(rows[2].advantages, b.tensors["advantages"][2, :7])
    shards = b.split(2)
    assert [s.lengths for s in shards] == [[5, 3, 7], [2, 6]]
    assert shards[1].tensors["input_ids"].shape == (2, 7)  # rows keep the batch's width
    again = [e for s in shards for e in s.rows()]
    for x, y in zip(rows, again):
        assert all(torch.equal(getattr(x, f), getattr(y, f)) for f in ("input_ids", "labels", "old_logps", "returns"))
    joined = ExperienceBatch.concat(shards)
    assert joined.lengths == b.lengths and joined.tensors["values"] is None
    assert all(torch.equal(joined.tensors[k], b.tensors[k]) for k in ("input_ids", "labels", "old_logps", "returns"))
    # the collated shard is what the single-machine learner collates from the same rows
    collated = collate_experience(shards[0].rows(), 0, torch.device("cpu"))
    assert torch.equal(collated["input_ids"], collate_experience(rows[:3], 0, torch.device("cpu"))["input_ids"])


def test_padded_shards_give_every_rank_the_same_rows_and_join_to_the_batch():
    """ZeRO-3 ranks run equal numbers of forward passes; the repeated rows are dropped on joining."""
    b = batch([5, 3, 7, 2, 6])
    shards = b.split(2, pad_to_equal=True)
    assert [len(s) for s in shards] == [3, 3] and shards[1].lengths == [2, 6, 6]
    joined = ExperienceBatch.concat([s.head(n) for s, n in zip(shards, (3, 2))])
    assert joined.lengths == b.lengths and torch.equal(joined.tensors["labels"], b.tensors["labels"])
    assert [s.lengths for s in b.split(5, pad_to_equal=True)] == [[5], [3], [7], [2], [6]]


def test_scores_join_the_batch_they_were_computed_for():
    """A role's scores come back as a batch of their own fields; the driver adds them to the rollout's."""
    b = batch([5, 3])
    scores = ExperienceBatch({"ref_logps": torch.ones(2, 7), "score": torch.tensor([1.0, 2.0])}, b.lengths)
    both = b.with_tensors(**scores.tensors)
    assert torch.equal(both.tensors["ref_logps"], torch.ones(2, 7)) and both.tensors["input_ids"] is b.tensors["input_ids"]
    assert torch.equal(ExperienceBatch.concat(scores.split(2)).tensors["score"], scores.tensors["score"])


def test_a_trajectorys_environment_tokens_are_no_training_targets():
    """Prompt [1, 2], then the model's [3, 4], the environment's [5, 6], the model's [7]: the targets
    (labels[t] = the token at t + 1) are the model's tokens only, written out by hand; a one-turn
    response beside it keeps every response token."""
    from hpcrlhf.engines.rollout import Generation
    from hpcrlhf.rewards.response import Response
    from hpcrlhf.trainers.online import Rollout
    from hpcrlhf.trainers.ppo.experience import rollout_batch

    agent = Generation([1, 2], [3, 4, 5, 6, 7], [-0.1, -0.2, 0.0, 0.0, -0.3], True, [True, True, False, False, True])
    plain = Generation([1, 2], [8, 9], [-0.5, -0.6], True)
    responses = [Response("p", "t", tuple(g.prompt_ids + g.response_ids), {}) for g in (agent, plain)]
    batch = rollout_batch(Rollout(["p", "p"], [agent, plain], responses, torch.zeros(2), {}), pad_id=0)
    assert batch.tensors["labels"].tolist() == [[-100, 3, 4, -100, -100, 7, -100],
                                             [-100, 8, 9, -100, -100, -100, -100]]
    assert batch.tensors["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7], [1, 2, 8, 9, 0, 0, 0]]


def test_turn_rewards_go_to_their_turns_last_model_tokens():
    """agent.reward_placement turn on the transcript above: the judged turns' rewards (times the env source's
    weight, 2) land at the positions whose targets are each turn's last model token -- 4 and 7 -- and nowhere
    without it (agent.reward_placement end)."""
    from types import SimpleNamespace

    from hpcrlhf.agents.record import EpisodeRecord
    from hpcrlhf.config.schema.agent import AgentConfig
    from hpcrlhf.config.schema.online import RewardConfig, RewardSourceConfig
    from hpcrlhf.engines.rollout import Generation
    from hpcrlhf.rewards.response import Response
    from hpcrlhf.trainers.online import Rollout
    from hpcrlhf.trainers.ppo.driver import PPOTrainer
    from hpcrlhf.trainers.ppo.experience import rollout_batch

    record = EpisodeRecord(turns=2, turn_rewards=[0.5, 1.0], reward_turns=[0, 1], turn_ends=[1, 4])
    agent = Generation([1, 2], [3, 4, 5, 6, 7], [-0.1, -0.2, 0.0, 0.0, -0.3], True, [True, True, False, False, True],
                       record)
    responses = [Response("p", "t", tuple(agent.prompt_ids + agent.response_ids), {}, episode=record)]
    rollout = Rollout(["p"], [agent], responses, torch.zeros(1), {})
    labels = rollout_batch(rollout, pad_id=0).tensors["labels"][0]
    reward = RewardConfig(sources=(RewardSourceConfig(rule="task"), RewardSourceConfig(env=True, weight=2.0)))
    driver = SimpleNamespace(cfg=SimpleNamespace(agent=AgentConfig(reward_placement="turn"), reward=reward))
    ((positions, values),) = PPOTrainer.turn_rewards(driver, rollout)
    assert (positions, values) == ([2, 5], [1.0, 2.0]) and [int(labels[p]) for p in positions] == [4, 7]
    driver.cfg.agent = AgentConfig()
    assert PPOTrainer.turn_rewards(driver, rollout) is None
