"""`eval.keep_best`'s record: which evaluation is better, and the best a resumed run reads back."""

from __future__ import annotations

import json

import pytest

from hpcrlhf.config.schema import EvalConfig
from hpcrlhf.errors import ConfigError
from hpcrlhf.trainers.best import BestModel


def test_the_best_follows_the_mode_ignores_nan_and_is_read_back_by_a_resumed_run(tmp_path):
    assert BestModel.of_run(EvalConfig(), tmp_path) is None
    best = BestModel.of_run(EvalConfig(keep_best="eval/loss", keep_best_mode="min"), tmp_path)
    assert best.improved({"eval/loss": 2.0})  # the first evaluation is the best so far
    files = best.files({"eval/loss": 2.0}, step=10)
    assert not best.improved({"eval/loss": 2.5}) and not best.improved({"eval/loss": float("nan")})
    assert best.improved({"eval/loss": 1.5})
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text(files["best.json"])
    again = BestModel.of_run(EvalConfig(keep_best="eval/loss", keep_best_mode="min"), tmp_path)
    assert (again.value, again.step) == (2.0, 10) and json.loads(files["best.json"])["metric"] == "eval/loss"
    # another metric or mode starts a new best
    other = BestModel.of_run(EvalConfig(keep_best="eval/loss", keep_best_mode="max"), tmp_path)
    assert other.value is None and other.improved({"eval/loss": -5.0})
    with pytest.raises(ConfigError, match=r"eval.keep_best: 'eval/loss' is not reported .* eval/task_score"):
        best.require_metric({"eval/task_score": 1.0})


@pytest.mark.parametrize("kwargs, message", [
    ({"keep_best": "task_score"}, r"eval.keep_best: 'task_score' is invalid: name an evaluation metric"),
    ({"keep_best": "eval/loss", "every_steps": 0}, r"eval.keep_best: 'eval/loss' is invalid: the best model is chosen"),
])
def test_bad_keep_best_names_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EvalConfig(**kwargs)
