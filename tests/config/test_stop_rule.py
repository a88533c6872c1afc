"""`eval.stop_when`: what a rule accepts, what it means, and the message for what it refuses."""

from __future__ import annotations

import pytest

from hpcrlhf.config.schema import EvalConfig
from hpcrlhf.config.stop_rule import StopRule, parse_stop_rule
from hpcrlhf.errors import ConfigError


@pytest.mark.parametrize("text, rule", [
    ("eval/task_score>=0.9", StopRule("eval/task_score", ">=", 0.9)),
    ("  eval/loss <= 5e-2 ", StopRule("eval/loss", "<=", 0.05)),
    ("eval/accuracy_hard>=-1", StopRule("eval/accuracy_hard", ">=", -1.0)),
    ("eval/task_score/pass@8>=0.95", StopRule("eval/task_score/pass@8", ">=", 0.95)),  # sampled evaluation's keys
    ("", None),
    ("   ", None),
])
def test_parses(text, rule):
    assert parse_stop_rule(text) == rule


@pytest.mark.parametrize("text", ["task_score>=0.9", "eval/task_score>0.9", "eval/task_score==0.9",
                                  "eval/task_score>=", "eval/task_score>=high", "eval/loss<=nan",
                                  "eval/loss<=inf", "eval/loss<=0.1 or so", ">=0.5"])
def test_refuses_with_the_field_and_the_form(text):
    with pytest.raises(ConfigError) as err:
        parse_stop_rule(text)
    assert str(err.value).startswith(f"eval.stop_when: {text!r} is invalid: write '<eval metric> >= <number>'")


@pytest.mark.parametrize("op, value, met", [(">=", 0.5, True), (">=", 0.49, False), ("<=", 0.5, True), ("<=", 0.51, False)])
def test_met_compares_inclusively(op, value, met):
    rule = StopRule("eval/x", op, 0.5)
    assert rule.met({"eval/x": value, "eval/y": 0.0}) is met


def test_a_metric_the_evaluation_lacks_is_named_with_those_it_has():
    with pytest.raises(ConfigError, match=r"names 'eval/x', which this job's evaluation does not report "
                                          r"\(it reports: eval/loss, eval/task_score\); use one of those"):
        StopRule("eval/x", ">=", 1.0).met({"eval/task_score": 0.2, "eval/loss": 1.0})


def test_config_needs_periodic_evaluation():
    assert EvalConfig(stop_when="eval/loss<=0.1", every_steps=10).stop_when == "eval/loss<=0.1"
    with pytest.raises(ConfigError, match="eval.stop_when: 'eval/loss<=0.1' is checked at periodic evaluations, but "
                                          "eval.every_steps is 0"):
        EvalConfig(stop_when="eval/loss<=0.1", every_steps=0)
