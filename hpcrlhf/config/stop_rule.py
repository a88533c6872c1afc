"""Early stopping on an evaluation metric: `eval.stop_when: "eval/task_score>=0.9"`.

A rule is one metric, `>=` or `<=`, and a finite number. The trainer checks it after each
periodic evaluation and ends the run at the first one that meets it (checkpoint, exported model
and summary as at a normal end), as Lightning's `EarlyStopping(stopping_threshold=...)` does.
Pure parsing and comparison here; the loop is in hpcrlhf.trainers.loop.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from collections.abc import Mapping

from hpcrlhf.errors import ConfigError

FIELD = "eval.stop_when"
METRIC = r"eval/[\w./@-]+"
"""An evaluation metric's name, as a rule (and eval.keep_best) names it: `eval/task_score/pass@8`."""
_RULE = re.compile(rf"^\s*(?P<metric>{METRIC})\s*(?P<op>>=|<=)\s*(?P<value>\S+)\s*$")
EXAMPLE = "e.g. eval/task_score>=0.9 or eval/loss<=0.05"


@dataclass(frozen=True)
class StopRule:
    metric: str
    op: str
    threshold: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"

    def met(self, metrics: Mapping[str, float]) -> bool:
        """Whether `metrics` (one evaluation's) meets the rule; a ConfigError when they lack its metric."""
        self.require_metric(metrics)
        value = metrics[self.metric]
        return value >= self.threshold if self.op == ">=" else value <= self.threshold

    def require_metric(self, metrics: Mapping[str, float]) -> None:
        if self.metric not in metrics:
            raise ConfigError(f"{FIELD}: {str(self)!r} names {self.metric!r}, which this job's evaluation does not "
                              f"report (it reports: {reported(metrics)}); use one of those")


def reported(metrics: Mapping[str, float]) -> str:
    """The evaluation metrics of one evaluation, listed for an error message."""
    return ", ".join(sorted(k for k in metrics if k.startswith("eval/"))) or "none"


def parse_stop_rule(text: str) -> StopRule | None:
    """The rule written in `text`; None for an empty string (no early stop)."""
    if not text.strip():
        return None
    match = _RULE.match(text)
    value = _number(match["value"]) if match else None
    if value is None:
        raise ConfigError(f"{FIELD}: {text!r} is invalid: write '<eval metric> >= <number>' or "
                          f"'<eval metric> <= <number>', {EXAMPLE}")
    return StopRule(match["metric"], match["op"], value)


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
