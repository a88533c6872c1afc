"""Scoring responses: reward models, rule-based rewards, and their weighted combination.

A `RewardSet` holds the sources of `reward.sources` (PPO, rejection sampling, `hpcrlhf
generate`). Each source gives one number per response; the score is their weighted sum:

    score = sum_i weight_i * r_i

- A reward model source runs the model on prompt + response (the tokens the policy produced,
  re-tokenised from text when the reward model has a different vocabulary) and takes the value
  at the last token, standardised with the model's stored reward mean/std when `normalize`.
- A rule source is a Python function `(prompt, response, row) -> number`: the bundled task's
  `task` (exact answer, 1 or 0) and `task_partial` (share of digits right), or a user's
  `package.module:function`. `row` is the prompt's dataset row (other fields, e.g. a reference
  answer, reach the rule through it).

Rules and evaluation metrics (`eval.metrics`, see `EvalMetrics`) share one contract, checked on
every call (`Rule`): the function takes (prompt, response, row) and returns a real number -- an
int, a float, a bool (True counts 1.0 and False 0.0, so a pass/fail check is a rule), a numpy
scalar or a 0-d tensor. None, strings (even "1.0"), lists and complex numbers are refused, and so
is an exception raised inside the function: the error names the config field, the rule, the
prompt with its row's origin (`prompts.jsonl:17`) and what the function returned (or raised, and
where). A NaN or Inf reward is passed on: the NaN/Inf guard (`train.on_nonfinite`) skips or stops
the step that would learn from it. A metric must be finite (a mean over a NaN would hide which
answer caused it). `rule_names(cfg)` lists every `module:function` a config names, `check_rules`
imports them all.

Each call gets its own copy of the row (what a rule changes in it, no other rule, metric or later
evaluation sees) and runs as the user's code (`hpcrlhf.run.usercode`): past its deadline
(`reward.rule_timeout_s`, `eval.metric_timeout_s`), or on `sys.exit()` and other exceptions that
would end the job, it fails with a RuleError naming the rule; a stop request interrupts it.

`adjust_scores` then applies the configured penalties (length, missing EOS). Reward models are
frozen models (see `ModelFactory.build_frozen_model`): sharded under ZeRO-3, so every rank must call
`score` with the same number of sequences.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import math
import numbers
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import torch

from hpcrlhf.config.schema import DEFAULT_USER_CODE_TIMEOUT_S, TASK_RULES, JobConfig, RewardConfig, RewardSourceConfig
from hpcrlhf.data.sources import brief
from hpcrlhf.errors import ConfigError, RuleError
from hpcrlhf.models.value import last_token_values, reward_stats
from hpcrlhf.run.signals import Interrupted, StopRequested
from hpcrlhf.run.usercode import UserCodeTimeout, user_code

RuleFn = Callable[[str, str, Mapping[str, Any]], Any]
CONTRACT = "a rule returns a real number: an int, a float or a bool (True counts 1.0, False 0.0)"


@dataclass(frozen=True)
class Response:
    """One generated response, as the reward sources see it."""

    prompt: str
    text: str
    """The decoded response (special tokens removed)."""
    sequence_ids: tuple[int, ...]
    """Prompt + response token ids (EOS included when generated); empty where only the text is
    scored (evaluation metrics)."""
    row: Mapping[str, Any]
    """The prompt's dataset row."""
    origin: str = ""
    """Where that row came from (`prompts.jsonl:17`, `task:arithmetic[eval]: row 3`); empty if unknown."""


@dataclass(frozen=True)
class Rule:
    """A resolved rule or metric: `rule(prompt, response, row, origin)` is the function's value, checked."""

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
            raise RuleError(f"{self.label} raised {self._described(e)}{_raised_at(e)}, "
                            f"{_answer(prompt, response, origin)}; fix the function") from e
        except BaseException as e:  # sys.exit(), a KeyboardInterrupt of its own, GeneratorExit...
            raise RuleError(f"{self.label} raised {self._described(e)}{_raised_at(e)}, which would end the job: a "
                            f"rule returns a number (or raises an Exception), {_answer(prompt, response, origin)}; "
                            "fix the function") from None
        if number is None:
            raise RuleError(f"{self.label} returned {self._shown(value)} ({type(value).__name__}) "
                            f"{_answer(prompt, response, origin)}: {CONTRACT}")
        if self.finite and not math.isfinite(number):
            raise RuleError(f"{self.label} returned {number} {_answer(prompt, response, origin)}: an evaluation "
                            "metric must be finite (its mean is reported)")
        return number

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


def real_number(value: Any) -> float | None:
    """`value` as a float when it is a real number (int, float, bool, Fraction, a numpy scalar, a 0-d
    array or tensor), else None; an int too large for a float is +-Inf."""
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        value = value.item()  # numpy scalars (np.bool_ is no numbers.Real) and 0-d arrays or tensors
    if not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _answer(prompt: str, response: str, origin: str) -> str:
    return f"on the response {brief(response)} to prompt {brief(prompt)}" + (f" ({origin})" if origin else "")


def _raised_at(e: BaseException) -> str:
    """` at file:line in function` of the innermost frame the exception passed through (in the rule
    or in what it called); empty when it came from C code called directly by `Rule.__call__`."""
    frames = traceback.extract_tb(e.__traceback__)[1:]
    return f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""


def resolve_rule(name: str, task, field: str = "reward.sources", *, finite: bool = False,
                 timeout_s: float = DEFAULT_USER_CODE_TIMEOUT_S, timeout_key: str = "reward.rule_timeout_s") -> Rule:
    """The rule `name` (`task`, `task_partial` or `package.module:function`), imported and checked
    before anything runs; `field` is the config field that names it, for the errors; each call may
    take `timeout_s` (the setting `timeout_key`)."""
    label = f"{field} {name!r}"
    limits = dict(timeout_s=timeout_s, timeout_key=timeout_key)
    if name in TASK_RULES:
        if task is None:
            raise ConfigError(f"{field}: rule '{name}' scores the bundled task's answers, but task.name is null "
                              "(or auto with data.train_path set); set task.name=arithmetic, or use a reward model or "
                              "a module:function rule")
        score = task.score if name == "task" else task.partial_score
        return Rule(label, lambda prompt, response, row: score(prompt, response), finite, **limits)
    module_name, sep, fn_name = name.partition(":")
    if not sep or not module_name or not fn_name:
        raise ConfigError(f"{field}: rule '{name}' is not a known rule; use task, task_partial, or "
                          "package.module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while it is imported
        raise ConfigError(f"{field}: rule '{name}' cannot be imported ({type(e).__name__}: {e}); check the module "
                          "is on PYTHONPATH and imports") from None
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise ConfigError(f"{field}: rule '{name}' cannot be imported (module '{module_name}' has no "
                          f"'{fn_name}'); check the module defines the function")
    if not callable(fn) or not _takes_three_arguments(fn):
        raise ConfigError(f"{field}: rule '{name}' must be a function of (prompt, response, row)")
    return Rule(label, fn, finite, **limits)


def _takes_three_arguments(fn: Callable) -> bool:
    try:
        inspect.signature(fn).bind("", "", {})
    except (TypeError, ValueError):  # ValueError: no signature to read
        return False
    return True


def metric_name(rule: str) -> str:
    """The name a metric `package.module:function` is reported under: `function` (`eval/function`)."""
    return rule.partition(":")[2]


def rule_names(cfg: JobConfig) -> list[tuple[str, str]]:
    """(config field, rule) of every `package.module:function` a job or generate config names: its
    reward rules (`reward.sources[i].rule`) and its evaluation metrics (`eval.metrics[i]`, or
    `metrics[i]` for generate). These import the user's code, so a node that runs the job must be
    able to import them; `check_rules(cfg)` does."""
    out = []
    reward = getattr(cfg, "reward", None)
    for i, source in enumerate(reward.sources if reward is not None else ()):
        if source.rule is not None and source.rule not in TASK_RULES:
            out.append((f"reward.sources[{i}].rule", source.rule))
    metrics, field = (cfg.eval.metrics, "eval.metrics") if hasattr(cfg, "eval") else (getattr(cfg, "metrics", ()), "metrics")
    out += [(f"{field}[{i}]", rule) for i, rule in enumerate(metrics)]
    return out


def check_rules(cfg: JobConfig) -> None:
    """Import and check every `package.module:function` of `cfg` (`rule_names`): a ConfigError names
    the first field whose rule cannot be imported or is no function of (prompt, response, row)."""
    for field, rule in rule_names(cfg):
        resolve_rule(rule, None, field)


class EvalMetrics:
    """What evaluation reports about each generated answer: the task score (with a task) and the
    user's metrics (`eval.metrics`: `package.module:function` rules, reported under the function's
    name). `stats` gives `eval/<name>` sums for `TrainingLoop.eval_means`, `values` each answer's."""

    def __init__(self, metrics: Sequence[str], task, field: str = "eval.metrics",
                 timeout_s: float = DEFAULT_USER_CODE_TIMEOUT_S, timeout_key: str = "eval.metric_timeout_s"):
        self.rules: dict[str, Rule] = {}
        limits = dict(timeout_s=timeout_s, timeout_key=timeout_key)
        if task is not None:
            self.rules["task_score"] = Rule(f"the task score (task {task.name!r})",
                                            lambda prompt, response, row: task.score(prompt, response), True, **limits)
        for i, rule in enumerate(metrics):
            name = metric_name(rule)
            if name in self.rules:  # a second metric of that name is refused when the config loads
                raise ConfigError(f"{field}[{i}]: '{rule}' would be reported as eval/{name}, which the bundled task's "
                                  "score already is; rename the function (or set task.name=null)")
            self.rules[name] = resolve_rule(rule, task, f"{field}[{i}]", finite=True, **limits)

    def values(self, responses: Sequence[Response]) -> dict[str, list[float]]:
        return {name: [rule(r.prompt, r.text, r.row, r.origin) for r in responses] for name, rule in self.rules.items()}

    def stats(self, responses: Sequence[Response], suffix: str = "") -> dict[str, tuple[float, float]]:
        """{`eval/<name><suffix>`: (sum, count)} over `responses`."""
        return {f"eval/{name}{suffix}": (sum(v), len(v)) for name, v in self.values(responses).items()}


def source_name(index: int, source: RewardSourceConfig) -> str:
    """Metric name of a source: `rule_<name>` or `model<i>_<folder name>`."""
    if source.rule is not None:
        return "rule_" + source.rule.replace(":", ".").replace("/", ".")
    return f"model{index}_{Path(source.model).name or 'rm'}"


class RewardModelScorer:
    """A frozen reward model scoring prompt + response sequences at their last token."""

    def __init__(self, model, tokenizer, policy_tokenizer, source: RewardSourceConfig, batch_size: int, device):
        self.model, self.tokenizer = model, tokenizer
        self.same_vocab = tokenizer.get_vocab() == policy_tokenizer.get_vocab()
        self.stats = reward_stats(model.module.config) if source.normalize else None
        self.pad_id, self.batch_size, self.device = tokenizer.pad_token_id, batch_size, device

    def _sequence(self, r: Response) -> list[int]:
        if self.same_vocab:
            return list(r.sequence_ids)
        # Another vocabulary: the model sees the text, ending in its own EOS like its training data.
        return self.tokenizer(r.prompt + r.text, add_special_tokens=True)["input_ids"] + [self.tokenizer.eos_token_id]

    @torch.no_grad()
    def __call__(self, responses: Sequence[Response]) -> torch.Tensor:
        from hpcrlhf.engines.hf_generate import right_pad  # transformers (+3 s): `hpcrlhf sbatch` checks rules here

        out = []
        for start in range(0, len(responses), self.batch_size):
            ids, mask = right_pad([self._sequence(r) for r in responses[start : start + self.batch_size]], self.pad_id)
            values = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
            out.append(last_token_values(values, mask.to(self.device)).float().cpu())
        rewards = torch.cat(out) if out else torch.zeros(0)
        if self.stats is not None:
            mean, std = self.stats
            rewards = (rewards - mean) / max(std, 1e-8)
        return rewards


class RewardSet:
    """All sources of a `RewardConfig`; `score` returns the weighted sum and each source's values.

    `load_model(path, field)` gives a frozen value model (`FrozenModel` of a `ValueModel`) for a
    reward model folder named by config field `field`."""

    def __init__(self, cfg: RewardConfig, load_model: Callable[[str, str], Any], tokenizer, task, device,
                 trust_remote_code: bool = False):
        from hpcrlhf.models.loading import load_tokenizer  # transformers (+3 s): `hpcrlhf sbatch` checks rules here

        self.cfg = cfg
        self.weights = [s.weight for s in cfg.sources]
        self.names = [source_name(i, s) for i, s in enumerate(cfg.sources)]
        # Rules are resolved first: a typo fails before any reward model is loaded.
        rules = {i: resolve_rule(s.rule, task, f"reward.sources[{i}].rule", timeout_s=cfg.rule_timeout_s)
                 for i, s in enumerate(cfg.sources) if s.rule is not None}
        self.scorers: list[Callable[[Sequence[Response]], torch.Tensor]] = []
        for i, source in enumerate(cfg.sources):
            if i in rules:
                self.scorers.append(RuleScorer(rules[i]))
            else:
                rm_tokenizer = load_tokenizer(source.model, trust_remote_code=trust_remote_code,
                                              key=f"reward.sources[{i}].model")
                self.scorers.append(RewardModelScorer(load_model(source.model, f"reward.sources[{i}].model"), rm_tokenizer,
                                                      tokenizer, source,
                                                      cfg.batch_size, device))

    def score(self, responses: Sequence[Response]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(weighted sum, {source name: values}) for each response, float32 on the CPU. Reward models
        score first: every rank runs their forwards (sharded under ZeRO-3) before a rule can be cut
        short by a stop request (StopRequested) on one rank."""
        models_first = sorted(zip(self.names, self.scorers), key=lambda item: isinstance(item[1], RuleScorer))
        computed = {name: scorer(responses) for name, scorer in models_first}
        parts = {name: computed[name] for name in self.names}
        total = torch.zeros(len(responses))
        for weight, values in zip(self.weights, parts.values()):
            total += weight * values
        return total, parts


@dataclass(frozen=True)
class RuleScorer:
    """A rule as a reward source: its value for each response."""

    rule: Rule

    def __call__(self, responses: Sequence[Response]) -> torch.Tensor:
        return torch.tensor([self.rule(r.prompt, r.text, r.row, r.origin) for r in responses], dtype=torch.float32)


def adjust_scores(scores: torch.Tensor, lengths: torch.Tensor, finished: torch.Tensor, cfg: RewardConfig,
                  max_new_tokens: int) -> torch.Tensor:
    """Scores with the length penalty (per response token), the missing-EOS penalty and DAPO's
    overlong shaping (`overlong_penalty`) applied."""
    out = scores - cfg.length_penalty * lengths.float()
    if cfg.missing_eos_penalty is not None:
        out = out + cfg.missing_eos_penalty * (~finished.bool()).float()
    if cfg.overlong_buffer:
        out = out + overlong_penalty(lengths, max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty).to(out.dtype)
    return out


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), per response: 0 up to
    max_new_tokens - buffer tokens, then falling linearly to -penalty at max_new_tokens (and
    below it past the limit, which a cut response never is)."""
    expected = max_new_tokens - buffer
    return torch.clamp(-(lengths.double() - expected) / buffer * penalty, max=0.0)
