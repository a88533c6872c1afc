"""Step counts past what a run's schedule can represent (2**31 - 1 steps) are refused when the config
loads, naming the field, the value and the limit; the limit itself is accepted."""

from __future__ import annotations

import re

import pytest

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import MAX_STEPS, PPOConfig, RSConfig, SFTConfig
from hpcrlhf.errors import ConfigError


@pytest.mark.parametrize("cls, setting, value", [
    (SFTConfig, "train.max_steps", 10**35),  # the value: the run would never leave warm-up
    (PPOConfig, "train.max_steps", MAX_STEPS + 1),
    (SFTConfig, "train.epochs", 10**35),
])
def test_step_counts_past_the_schedule_are_refused(cls, setting, value):
    with pytest.raises(ConfigError, match=re.escape(f"{setting}: {value} is invalid: use 1 to 2,147,483,647 (2**31 - 1")):
        load_config(cls, None, [f"{setting}={value}"])


def test_rejection_sampling_rounds_times_steps_are_bounded_too():
    with pytest.raises(ConfigError, match=r"rs.steps_per_iteration: 1000000000 is invalid: rs.iterations \(1000\) x "
                                          r"rs.steps_per_iteration steps must be at most 2,147,483,647"):
        load_config(RSConfig, None, ["rs.iterations=1000", "rs.steps_per_iteration=1000000000"])


def test_the_limit_itself_is_a_valid_run_length():
    assert load_config(SFTConfig, None, [f"train.max_steps={MAX_STEPS}"]).train.max_steps == MAX_STEPS
    assert load_config(RSConfig, None, ["rs.iterations=2", f"rs.steps_per_iteration={MAX_STEPS // 2}"]).rs.iterations == 2
