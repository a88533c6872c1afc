"""The rules hpcrlhf ships, by the name `reward.sources[i].rule` and `eval.metrics` give them, each
set by its section of `rules` (`hpcrlhf.config.schema.rules`; docs/rewards.md):

- `math` (`math_answers.MathRule`): the final answer checked against the row's reference: 1 or 0;
- `code` (`code_tests.CodeRule`): the response's program run against the row's tests in a sandbox:
  the share of tests passed;
- `format` (`FormatRule`): 1 when the response matches a regular expression, else 0.

`BUILTIN` is the registry: name -> the rule's class, built from the `rules` section and the label
its errors give (`reward.sources[0].rule 'math'`). A built-in rule scores a batch
(`scores(responses)`, the `hpcrlhf.rewards.rules.Scorer` protocol), spreading its checks over
processes (`rules.workers`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import regex

from hpcrlhf.config.schema import FormatRuleConfig, RulesConfig
from hpcrlhf.logs import get_logger
from hpcrlhf.rewards.code_tests import CodeRule
from hpcrlhf.rewards.math_answers import MathRule
from hpcrlhf.rewards.response import Response, Scorer

log = get_logger()


class FormatRule:
    """`rules.format.pattern` fully matched by the response, surrounding whitespace removed: 1, else 0.
    Matched with the `regex` package, whose matching a timeout ends (`re` cannot be interrupted:
    a pattern such as `(a|aa)+b` takes exponential time on a long response)."""

    def __init__(self, rules: RulesConfig, label: str):
        cfg: FormatRuleConfig = rules.format
        self.label, self.timeout_s = label, cfg.timeout_s
        self.pattern = regex.compile(cfg.pattern)

    def _matches(self, text: str) -> float | None:
        """1.0 or 0.0; None when matching took longer than the timeout."""
        try:
            return 1.0 if self.pattern.fullmatch(text.strip(), timeout=self.timeout_s) else 0.0
        except TimeoutError:
            return None

    def scores(self, responses: Sequence[Response]) -> list[float]:
        found = [self._matches(r.text) for r in responses]
        slow = sum(v is None for v in found)
        if slow:
            log.warning(f"{self.label}: matching rules.format.pattern took longer than rules.format.timeout_s "
                        f"({self.timeout_s:g} s) on {slow} of {len(found)} responses, which score 0: simplify the "
                        "pattern (overlapping alternatives under a repeat, such as (a|aa)+, take exponential time)")
        return [v or 0.0 for v in found]


BUILTIN: dict[str, Callable[[RulesConfig, str], Scorer]] = {"math": MathRule, "code": CodeRule, "format": FormatRule}
"""The built-in rules by name (`BUILTIN_RULES`): each built from the `rules` section and its label."""


def build_builtin(name: str, rules: RulesConfig, label: str) -> Scorer:
    """The built-in rule `name`, set by `rules`; `label` names it in errors (config field and rule)."""
    return BUILTIN[name](rules, label)
