"""What a rule is: the contract every rule and evaluation metric keeps, and how a rule's name
becomes a rule.

A rule scores a generated response with a number: as a reward source (`reward.sources[i].rule`,
weighted and summed by `hpcrlhf.rewards.sources.RewardSet`) or as an evaluation metric
(`eval.metrics`, see `EvalMetrics`). A name is one of

- a built-in rule (`math`, `code`, `format`; `hpcrlhf.rewards.builtin`), set in the `rules` section;
- `task` (the bundled task's exact answer, 1 or 0) or `task_partial` (share of digits right);
- a user's `package.module:function` of (prompt, response, row). `row` is the prompt's dataset row
  (other fields, e.g. a reference answer, reach the rule through it).

Every rule scores a batch at once (`scores(responses)`): a built-in rule spreads its checks over
processes. A function is called once per response, and its contract is checked on every call
(`Rule`): it takes (prompt, response, row) and returns a real number -- an int, a float, a bool
(True counts 1.0 and False 0.0, so a pass/fail check is a rule), a numpy scalar or a 0-d tensor.
None, strings (even "1.0"), lists and complex numbers are refused, and so is an exception raised
inside the function: the error names the config field, the rule, the prompt with its row's origin
(`prompts.jsonl:17`) and what the function returned (or raised, and where). A NaN or Inf reward is
passed on: the NaN/Inf guard (`train.on_nonfinite`) skips or stops the step that would learn from
it. A metric must be finite (a mean over a NaN would hide which answer caused it).
`rule_names(cfg)` lists every `module:function` a config names, `check_rules` imports them all.

Each call gets its own copy of the row (what a rule changes in it, no other rule, metric or later
evaluation sees) and runs as the user's code (`hpcrlhf.run.usercode`): past its deadline
(`reward.rule_timeout_s`, `eval.metric_timeout_s`), or on `sys.exit()` and other exceptions that
would end the job, it fails with a RuleError naming the rule; a stop request interrupts it.
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hpcrlhf.config.schema import (BUILTIN_RULES, DEFAULT_USER_CODE_TIMEOUT_S, KNOWN_RULES, TASK_RULES, JobConfig,
                                   RulesConfig, metric_name)
from hpcrlhf.data.sources import brief
from hpcrlhf.errors import ConfigError, RuleError
from hpcrlhf.rewards.builtin import build_builtin
from hpcrlhf.rewards.response import Response, Scorer
from hpcrlhf.rewards.sampled import Sampling, sampled_stats
from hpcrlhf.run.signals import Interrupted, StopRequested
from hpcrlhf.run.usercode import UserCodeTimeout, load_named, raised_at, real_number, user_code

RuleFn = Callable[[str, str, Mapping[str, Any]], Any]
DEFAULT_RULES = RulesConfig()
"""The built-in rules' default settings (where a caller gives none)."""
CONTRACT = "a rule returns a real number: an int, a float or a bool (True counts 1.0, False 0.0)"


@dataclass(frozen=True)
class Rule:
    """A function as a rule or metric: `rule(prompt, response, row, origin)` is its value, checked."""

    label: str
    """What the errors call it: the config field and the rule (`reward.sources[1].rule 'pkg.mod:fn'`)."""
    fn: RuleFn
    finite: bool = False
    """Refuse NaN and Inf (metrics); rewards pass them on to the NaN/Inf guard."""
    timeout_s: float = DEFAULT_USER_CODE_TIMEOUT_S
    """How long one call may take."""
    timeout_key: str = "reward.rule_timeout_s"
    """The setting that gives `timeout_s`, for the error."""

    def __call__(self, prompt: str, response: str, row: Mapping[str, Any], origin: str = "") -> float:
        row = copy.deepcopy(row)  # the call's own: what the rule changes in it, nothing else sees
        try:
            with user_code(self.timeout_s):
                value = self.fn(prompt, response, row)
                number = real_number(value)  # a returned object's own methods (item, __float__) run too
        except (StopRequested, Interrupted):  # the run stops; the step's scores are not used
            raise
        except UserCodeTimeout:
            raise RuleError(f"{self.label} did not return within {self.timeout_s:g} s ({self.timeout_key}) "
                            f"{_answer(prompt, response, origin)}: does it loop forever, or wait on something that "
                            f"never comes? Fix the function, or raise {self.timeout_key} if it needs longer") from None
        except Exception as e:  # the user's code: anything can happen in it
            raise RuleError(f"{self.label} raised {self._described(e)}{raised_at(e)}, "
                            f"{_answer(prompt, response, origin)}; fix the function") from e
        except BaseException as e:  # sys.exit(), a KeyboardInterrupt of its own, GeneratorExit...
            raise RuleError(f"{self.label} raised {self._described(e)}{raised_at(e)}, which would end the job: a "
                            f"rule returns a number (or raises an Exception), {_answer(prompt, response, origin)}; "
                            "fix the function") from None
        if number is None:
            raise RuleError(f"{self.label} returned {self._shown(value)} ({type(value).__name__}) "
                            f"{_answer(prompt, response, origin)}: {CONTRACT}")
        if self.finite and not math.isfinite(number):
            raise RuleError(f"{self.label} returned {number} {_answer(prompt, response, origin)}: an evaluation "
                            "metric must be finite (its mean is reported)")
        return number

    def scores(self, responses: Sequence[Response]) -> list[float]:
        return [self(r.prompt, r.text, r.row, r.origin) for r in responses]

    def _described(self, e: BaseException) -> str:
        """`Type: message` of what the code raised (`SystemExit (sys.exit(0))`)."""
        name = type(e).__name__
        if isinstance(e, SystemExit):
            return f"{name} (sys.exit({self._shown(e.code)}))"
        text = self._as_user_code(lambda: str(e))
        if text is None:
            return f"{name} (its message cannot be shown)"
        return f"{name}: {text}" if text else name

    def _shown(self, value: Any) -> str:
        """`brief(value)` of what the code returned."""
        return self._as_user_code(lambda: brief(value)) or "an object whose repr fails"

    def _as_user_code(self, show: Callable[[], str]) -> str | None:
        """show() -- a message or repr made by the user's own methods (`__str__`, `__repr__`) -- run
        as the user's code: None when it raises or passes the deadline."""
        try:
            with user_code(self.timeout_s):
                return show()
        except (StopRequested, Interrupted):
            raise
        except BaseException:
            return None


def _answer(prompt: str, response: str, origin: str) -> str:
    return f"on the response {brief(response)} to prompt {brief(prompt)}" + (f" ({origin})" if origin else "")


def resolve_rule(name: str, task, field: str = "reward.sources", *, finite: bool = False,
                 timeout_s: float = DEFAULT_USER_CODE_TIMEOUT_S, timeout_key: str = "reward.rule_timeout_s",
                 rules: RulesConfig = DEFAULT_RULES) -> Scorer:
    """The rule `name` (a built-in rule set by `rules`, `task`, `task_partial` or
    `package.module:function`), imported and checked before anything runs; `field` is the config
    field that names it, for the errors; each call of a function may take `timeout_s` (the setting
    `timeout_key`)."""
    label = f"{field} {name!r}"
    limits = dict(timeout_s=timeout_s, timeout_key=timeout_key)
    if name in BUILTIN_RULES:
        return build_builtin(name, rules, label)
    if name in TASK_RULES:
        if task is None:
            raise ConfigError(f"{field}: rule '{name}' scores the bundled task's answers, but task.name is null "
                              "(or auto with data.train_path set); set task.name=arithmetic, or use a reward model or "
                              "a module:function rule")
        score = task.score if name == "task" else task.partial_score
        return Rule(label, lambda prompt, response, row: score(prompt, response), finite, **limits)
    module_name, sep, fn_name = name.partition(":")
    if not sep or not module_name or not fn_name:
        raise ConfigError(f"{field}: rule '{name}' is not a known rule; use {', '.join(KNOWN_RULES)}, or "
                          "package.module:function")
    fn = load_named(name, f"{field}: rule '{name}'", "function")
    if not callable(fn) or not _takes_three_arguments(fn):
        raise ConfigError(f"{field}: rule '{name}' must be a function of (prompt, response, row)")
    return Rule(label, fn, finite, **limits)


def _takes_three_arguments(fn: Callable) -> bool:
    try:
        inspect.signature(fn).bind("", "", {})
    except (TypeError, ValueError):  # ValueError: no signature to read
        return False
    return True


def rule_names(cfg: JobConfig) -> list[tuple[str, str]]:
    """(config field, rule) of every `package.module:function` a job or generate config names: its
    reward rules (`reward.sources[i].rule`) and its evaluation metrics (`eval.metrics[i]`, or
    `metrics[i]` for generate). These import the user's code, so a node that runs the job must be
    able to import them; `check_rules(cfg)` does."""
    out = []
    reward = getattr(cfg, "reward", None)
    for i, source in enumerate(reward.sources if reward is not None else ()):
        if source.rule is not None and source.rule not in KNOWN_RULES:
            out.append((f"reward.sources[{i}].rule", source.rule))
    metrics, field = (cfg.eval.metrics, "eval.metrics") if hasattr(cfg, "eval") else (getattr(cfg, "metrics", ()), "metrics")
    out += [(f"{field}[{i}]", rule) for i, rule in enumerate(metrics) if rule not in KNOWN_RULES]
    for j, dataset in enumerate(getattr(cfg, "datasets", ())):  # hpcrlhf eval's own metrics per dataset
        out += [(f"datasets[{j}].metrics[{i}]", rule) for i, rule in enumerate(dataset.metrics or ())
                if rule not in KNOWN_RULES]
    return out


def check_rules(cfg: JobConfig) -> None:
    """Import and check every `package.module:function` of `cfg` (`rule_names`): a ConfigError names
    the first field whose rule cannot be imported or is no function of (prompt, response, row)."""
    for field, rule in rule_names(cfg):
        resolve_rule(rule, None, field)


class EvalMetrics:
    """What evaluation reports about each generated answer: the task score (with a task) and the
    metrics of `eval.metrics` (built-in rules set by `rules`, reported under their name;
    `package.module:function`s, under the function's name). `stats` gives `eval/<name>` sums for
    `TrainingLoop.eval_means`, `values` each answer's."""

    def __init__(self, metrics: Sequence[str], task, field: str = "eval.metrics",
                 timeout_s: float = DEFAULT_USER_CODE_TIMEOUT_S, timeout_key: str = "eval.metric_timeout_s",
                 rules: RulesConfig = DEFAULT_RULES):
        self.rules: dict[str, Scorer] = {}
        limits = dict(timeout_s=timeout_s, timeout_key=timeout_key)
        if task is not None:
            self.rules["task_score"] = Rule(f"the task score (task {task.name!r})",
                                            lambda prompt, response, row: task.score(prompt, response), True, **limits)
        for i, rule in enumerate(metrics):
            name = metric_name(rule)
            if name in self.rules:  # a second metric of that name is refused when the config loads
                raise ConfigError(f"{field}[{i}]: '{rule}' would be reported as eval/{name}, which the bundled task's "
                                  "score already is; rename the function (or set task.name=null)")
            self.rules[name] = resolve_rule(rule, task, f"{field}[{i}]", finite=True, rules=rules, **limits)

    def values(self, responses: Sequence[Response]) -> dict[str, list[float]]:
        return {name: rule.scores(responses) for name, rule in self.rules.items()}

    def stats(self, responses: Sequence[Response], suffix: str = "", sampling: Sampling | None = None
              ) -> dict[str, tuple[float, float]]:
        """{`eval/<name><suffix>`: (sum, count)} over `responses`; with `sampling` (several samples per
        prompt, prompt-major), also pass@k and maj@n over the prompts (`rewards.sampled`)."""
        return self.summed(self.values(responses), [r.text for r in responses], suffix, sampling)

    @staticmethod
    def summed(values: Mapping[str, Sequence[float]], texts: Sequence[str], suffix: str = "",
               sampling: Sampling | None = None) -> dict[str, tuple[float, float]]:
        """`stats` of the metrics' `values` of answers `texts` (already scored)."""
        if sampling is not None:
            return sampled_stats(values, texts, sampling, suffix)
        return {f"eval/{name}{suffix}": (sum(v), len(v)) for name, v in values.items()}
