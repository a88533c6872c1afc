"""How a rollout's experience is packed, split over ranks and unpacked again (the Ray driver sends
`ExperienceBatch` shards to the actor and critic ranks; row shards of forward-pass batches)."""

from __future__ import annotations

import pytest
import torch

from hpcrlhf.cluster.worker_group import even_bounds
from hpcrlhf.trainers.ppo.experience import ExperienceBatch, collate_experience
from hpcrlhf.trainers.ppo.ray.roles import pad_rows


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
    shards = [b.shard(a, z) for a, z in even_bounds(len(b), 2)]
    assert [s.lengths for s in shards] == [[5, 3, 7], [2, 6]]
    assert shards[1].tensors["input_ids"].shape == (2, 6)  # padding cut to the shard's longest row
    again = [e for s in shards for e in s.rows()]
    for x, y in zip(rows, again):
        assert all(torch.equal(getattr(x, f), getattr(y, f)) for f in ("input_ids", "labels", "old_logps", "returns"))
    # the collated shard is what the single-machine learner collates from the same rows
    collated = collate_experience(shards[0].rows(), 0, torch.device("cpu"))
    assert torch.equal(collated["input_ids"], collate_experience(rows[:3], 0, torch.device("cpu"))["input_ids"])


@pytest.mark.parametrize("n, parts, sizes", [(10, 3, [4, 3, 3]), (4, 4, [1, 1, 1, 1]), (2, 3, [1, 1, 0]), (0, 2, [0, 0])])
def test_even_bounds_are_contiguous_and_balanced(n, parts, sizes):
    bounds = even_bounds(n, parts)
    assert [b - a for a, b in bounds] == sizes
    assert bounds[0][0] == 0 and bounds[-1][1] == n and all(x[1] == y[0] for x, y in zip(bounds, bounds[1:]))


def test_pad_rows_gives_every_rank_the_same_rows_and_keeps_the_order():
    rows = {"input_ids": torch.arange(10).reshape(5, 2), "labels": torch.arange(10, 20).reshape(5, 2)}
    shards, n = pad_rows(rows, 2)
    assert n == 5 and [s["input_ids"].shape[0] for s in shards] == [3, 3]  # ZeRO-3 ranks run equal passes
    joined = torch.cat([s["labels"] for s in shards])
    assert torch.equal(joined[:n], rows["labels"]) and torch.equal(joined[n], rows["labels"][-1])
    same, _ = pad_rows(rows, 5)
    assert all(torch.equal(s["input_ids"], rows["input_ids"][i : i + 1]) for i, s in enumerate(same))
