import pytest

from hpcrlhf.config.schema import TrainConfig
from hpcrlhf.errors import ConfigError
from hpcrlhf.trainers.batches import BatchPlan


def test_plan_derives_accumulation_and_steps():
    p = BatchPlan.build(TrainConfig(global_batch_size=32, micro_batch_size=4, epochs=2), num_rows=100, data_parallel_size=2)
    assert (p.grad_accum_steps, p.rows_per_rank_per_step, p.steps_per_epoch, p.total_steps) == (4, 16, 3, 6)


def test_plan_rejects_indivisible_batch_with_fix():
    with pytest.raises(ConfigError) as e:
        BatchPlan.build(TrainConfig(global_batch_size=30, micro_batch_size=4), num_rows=100, data_parallel_size=2)
    msg = str(e.value)
    assert "train.global_batch_size" in msg and "30" in msg and "24 or 32" in msg


def test_plan_rejects_batch_larger_than_data():
    with pytest.raises(ConfigError, match="larger than the training data"):
        BatchPlan.build(TrainConfig(global_batch_size=64, micro_batch_size=8), num_rows=10, data_parallel_size=1)


def test_rows_for_step_cover_each_epoch_once_across_ranks():
    p = BatchPlan.build(TrainConfig(global_batch_size=8, micro_batch_size=2, epochs=2), num_rows=24, data_parallel_size=2)
    for epoch in range(2):
        seen = []
        for step in range(epoch * p.steps_per_epoch, (epoch + 1) * p.steps_per_epoch):
            for rank in range(2):
                seen += p.rows_for_step(24, step, seed=5, rank=rank)
        assert sorted(seen) == list(range(24))  # no sample lost or repeated within an epoch
    assert p.rows_for_step(24, 0, 5, 0) != p.rows_for_step(24, p.steps_per_epoch, 5, 0)  # reshuffled per epoch
