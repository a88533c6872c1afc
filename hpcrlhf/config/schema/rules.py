"""The built-in rules' settings (`rules`): `math`, `code` and `format`, named in `reward.sources`
(`{rule: math, weight: 1}`) and in `eval.metrics` (`[math, format]`, reported as `eval/math`).

One section per rule, shared by every place that names it, so a run rewards and evaluates a rule
the same way; what each rule does with them: `hpcrlhf.rewards.builtin` and docs/rewards.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import regex

from hpcrlhf.config.schema.checks import PathText, require, require_finite, require_timeout
from hpcrlhf.errors import ConfigError

BUILTIN_RULES = ("math", "code", "format")
"""Rules hpcrlhf ships, by the name `reward.sources[i].rule` and `eval.metrics` give them."""

THINK_ANSWER = r"(?s)<think>.*?</think>\s*<answer>.*?</answer>"
"""The reasoning format of DeepSeek-R1 (Guo et al. 2025): reasoning in think tags, then the answer."""


@dataclass(frozen=True)
class MathRuleConfig:
    answer_key: str = "answer"
    """The row field with the reference answer: a number, or text as written inside \\boxed{}
    (`0.5`, `\\frac{1}{2}`, `x^2+1`); from text holding a \\boxed{} (a worked solution) its last box."""
    extract: Literal["boxed", "last_number"] = "boxed"
    """Where the response's answer is: `boxed`, the content of its last complete `\\boxed{...}`;
    `last_number`, the last number written in digits (`-12`, `3.5`, `1,234`, `3/4`). A response
    without one scores 0."""
    timeout_s: float = 5.0
    """Longest one check (reading both answers and comparing them) may take, in seconds: past it the
    checking process is killed and the answer scores 0 (a hostile answer such as `9^{9^{9^9}}` would
    never finish)."""
    memory_mb: int = 1024
    """Address space of each checking process (RLIMIT_AS), in MiB: an answer that needs more scores 0."""

    def __post_init__(self) -> None:
        require_finite(self, "rules.math")
        require(bool(self.answer_key), "rules.math.answer_key", self.answer_key, "name the row field, e.g. answer")
        require_timeout(self.timeout_s, "rules.math.timeout_s")
        require(self.memory_mb >= 256, "rules.math.memory_mb", self.memory_mb,
                "use at least 256 (the checker itself needs about 64 MiB)")


@dataclass(frozen=True)
class CodeRuleConfig:
    tests_key: str = "tests"
    """The row field with the tests: a list of assert-style tests (each a string of Python run after
    the program, e.g. `assert add(1, 2) == 3`), or of stdin/stdout pairs (`{input: "1 2\\n", output:
    "3\\n"}`), or one mapping of two lists (`{input: [...], output: [...]}`)."""
    input_key: str = "input"
    """The key of a stdin/stdout test's input."""
    output_key: str = "output"
    """The key of a stdin/stdout test's expected output (compared with the program's output, each
    line's trailing whitespace and trailing blank lines ignored)."""
    block: str | None = "python"
    """The program is the response's last fenced block with this language (```python ... ```);
    empty: the last fenced block of any language; null: the whole response. No such block scores 0."""
    python: PathText | None = None
    """The interpreter that runs the programs; null: the job's own. Run as root, hpcrlhf runs programs
    as the user nobody, which must be able to run it: a Python under /root cannot (the job then
    fails at the start and says so), use e.g. /usr/bin/python3."""
    timeout_s: float = 10.0
    """Wall-clock time one test's run may take, in seconds; past it every process of the run is
    killed and the test fails."""
    cpu_time_s: int = 5
    """CPU time of each process of a run (RLIMIT_CPU), in seconds."""
    memory_mb: int = 1024
    """Address space of each process of a run (RLIMIT_AS), in MiB."""
    file_size_mb: int = 16
    """Largest file a run may write (RLIMIT_FSIZE; its output counts too), and the most its folder
    (/tmp, a tmpfs of its own, which holds the program) may hold in all, in MiB."""
    processes: int = 16
    """Processes and threads a run may have at once, the program itself included (RLIMIT_NPROC in a
    user namespace of its own): a fork bomb stops there."""
    allow_host_network: bool = False
    """Where the kernel cannot give runs namespaces of their own (unprivileged user namespaces off),
    run them anyway, on the host's network and filesystem (they can reach both), instead of refusing
    to start (docs/rewards.md)."""

    def __post_init__(self) -> None:
        require_finite(self, "rules.code")
        for key in ("tests_key", "input_key", "output_key"):
            require(bool(getattr(self, key)), f"rules.code.{key}", getattr(self, key), "name the field")
        require_timeout(self.timeout_s, "rules.code.timeout_s")
        require(self.cpu_time_s >= 1, "rules.code.cpu_time_s", self.cpu_time_s, "use at least 1 second")
        require(self.memory_mb >= 64, "rules.code.memory_mb", self.memory_mb,
                "use at least 64 (a Python interpreter needs about 30 MiB of address space)")
        require(self.file_size_mb >= 1, "rules.code.file_size_mb", self.file_size_mb, "use at least 1")
        require(self.processes >= 1, "rules.code.processes", self.processes, "use at least 1 (the program itself)")


@dataclass(frozen=True)
class FormatRuleConfig:
    pattern: str = THINK_ANSWER
    """A regular expression (Python's `re` syntax, as the `regex` package reads it) the whole
    response, leading and trailing whitespace removed, must match (a full match: 1, else 0). Inline
    flags set the rest: `(?s)` lets `.` match newlines. The default: reasoning in <think> tags, then
    the answer in <answer> tags (DeepSeek-R1)."""
    timeout_s: float = 1.0
    """Longest matching one response may take, in seconds (a pattern such as `(a|aa)+b` can take
    exponential time): past it the response scores 0."""

    def __post_init__(self) -> None:
        require_finite(self, "rules.format")
        require_timeout(self.timeout_s, "rules.format.timeout_s")
        require(bool(self.pattern), "rules.format.pattern", self.pattern, "give a regular expression")
        try:
            regex.compile(self.pattern)
        except regex.error as e:
            require(False, "rules.format.pattern", self.pattern, f"not a regular expression ({e})")


@dataclass(frozen=True)
class RulesConfig:
    """Settings of the built-in rules, wherever they are named (`reward.sources`, `eval.metrics`)."""

    math: MathRuleConfig = field(default_factory=MathRuleConfig)
    """`math`: the response's final answer checked for mathematical equivalence with the row's
    reference (math-verify): 1 or 0."""
    code: CodeRuleConfig = field(default_factory=CodeRuleConfig)
    """`code`: the response's program run against the row's tests in a sandbox: the share of tests
    passed."""
    format: FormatRuleConfig = field(default_factory=FormatRuleConfig)
    """`format`: 1 when the response matches a regular expression, else 0."""
    workers: int | None = None
    """Checks (`math`) and test runs (`code`) at once, each in its own process; null: the CPU cores
    this process may use, shared among the training processes of its node (LOCAL_WORLD_SIZE)."""

    def __post_init__(self) -> None:
        require(self.workers is None or self.workers >= 1, "rules.workers", self.workers,
                "use at least 1, or null for the CPU cores")


def is_user_function(name: str) -> bool:
    """Whether a rule's name has the form `package.module:function`."""
    module, sep, function = name.partition(":")
    return bool(sep and module and function.isidentifier())


def metric_name(rule: str) -> str:
    """The name a metric is reported under (`eval/<name>`): a built-in rule's own (`math`), a
    `package.module:function`'s function name."""
    return rule.partition(":")[2] or rule


def require_metrics(metrics: tuple[str, ...], key: str) -> None:
    """Metrics are built-in rules (`BUILTIN_RULES`) or `package.module:function`s, with distinct names
    (`metric_name`); importing them is the job's business (hpcrlhf.rewards)."""
    seen: dict[str, str] = {}
    for i, rule in enumerate(metrics):
        require(rule in BUILTIN_RULES or is_user_function(rule), f"{key}[{i}]", rule,
                f"use a built-in rule ({', '.join(BUILTIN_RULES)}) or package.module:function, a function of (prompt, "
                "response, row) returning a number")
        name = metric_name(rule)
        if name in seen:
            raise ConfigError(f"{key}[{i}]: {rule!r} and {seen[name]!r} would both be reported as eval/{name}; "
                              "wrap one in a function of another name")
        seen[name] = rule
