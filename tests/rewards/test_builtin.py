"""The built-in rules by name: `format` against hand-written responses, and what the config says
about rules and metrics that name them (`rules` section, `reward.sources`, `eval.metrics`)."""

from __future__ import annotations

import time

import pytest

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import FormatRuleConfig, GenerateConfig, PPOConfig, RulesConfig
from hpcrlhf.errors import ConfigError
from hpcrlhf.rewards.builtin import build_builtin
from hpcrlhf.rewards.response import Response
from hpcrlhf.rewards.rules import EvalMetrics, rule_names


def responses(*texts: str) -> list[Response]:
    return [Response("Q:", text, (), {}) for text in texts]


def test_format_default_is_think_then_answer():
    rule = build_builtin("format", RulesConfig(), "eval.metrics[0] 'format'")
    assert rule.scores(responses(
        "<think>2+2 is 4\nsurely</think> <answer>4</answer>",  # newlines inside, space between
        "  <think>x</think><answer>4</answer>\n",               # surrounding whitespace ignored
        "<answer>4</answer>",                                    # no reasoning
        "<think>x</think><answer>4</answer> and more",           # text after the answer: not a full match
        "<think>x<answer>4</answer>",                            # an unclosed tag
        "4")) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_format_with_your_pattern_and_a_catastrophic_one_that_times_out(caplog):
    own = build_builtin("format", RulesConfig(format=FormatRuleConfig(pattern=r"Answer: -?\d+")), "format")
    assert own.scores(responses("Answer: 12", "Answer: twelve", "answer: 12")) == [1.0, 0.0, 0.0]
    slow = build_builtin("format", RulesConfig(format=FormatRuleConfig(pattern=r"(a|aa)+b", timeout_s=0.2)), "format")
    start = time.monotonic()
    assert slow.scores(responses("a" * 5000, "aab")) == [0.0, 1.0]
    assert time.monotonic() - start < 5
    assert "took longer than rules.format.timeout_s (0.2 s) on 1 of 2 responses" in caplog.text


@pytest.mark.parametrize("overrides, message", [
    (["rules.format.pattern='(unclosed'"], "rules.format.pattern: '(unclosed' is invalid: not a regular expression"),
    (["rules.math.extract=first"], "rules.math.extract"),
    (["rules.math.timeout_s=0"], "rules.math.timeout_s: 0.0 is invalid"),
    (["rules.code.memory_mb=10"], "rules.code.memory_mb: 10 is invalid: use at least 64"),
    (["rules.workers=0"], "rules.workers: 0 is invalid"),
    (["reward.sources=[{rule: maths}]"], "reward.sources[0].rule: 'maths' is invalid: use a known rule (math, code, format, "
                                         "task, task_partial) or package.module:function (did you mean 'math'?)"),
    (["eval.metrics=[math, fromat]"], "eval.metrics[1]: 'fromat' is invalid: use a built-in rule (math, code, format)"),
    (["eval.metrics=[math, mine:math]"], "eval.metrics[1]: 'mine:math' and 'math' would both be reported as eval/math"),
])
def test_bad_rule_settings_fail_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(PPOConfig, overrides=overrides)
    assert message in str(e.value), str(e.value)


def test_built_in_rules_are_named_in_sources_and_metrics_and_import_no_user_code():
    cfg = load_config(PPOConfig, overrides=["task.name=null", "data.train_path=prompts.jsonl",
                                            "data.eval_path=held_out.jsonl", "reward.sources=[{rule: math}, {rule: format, weight: 0.1}]",
                                            "eval.metrics=[math, format, 'mine:exact']",
                                            "rules.math.answer_key=solution", "rules.format.pattern='A: .*'"])
    assert [s.rule for s in cfg.reward.sources] == ["math", "format"]
    assert cfg.rules.math.answer_key == "solution" and cfg.rules.format.pattern == "A: .*"
    assert rule_names(cfg) == [("eval.metrics[2]", "mine:exact")]  # only the user's code is imported to check it
    generate = load_config(GenerateConfig, overrides=["metrics=[format]", "rules.format.pattern=ok"])
    metrics = EvalMetrics(generate.metrics, None, "metrics", rules=generate.rules)
    assert metrics.stats(responses("ok", "no")) == {"eval/format": (1.0, 2)}
