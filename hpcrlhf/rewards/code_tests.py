"""The `code` rule: the response's program run against the row's tests, each test in a sandbox of
its own (`hpcrlhf.rewards.sandbox`); the score is the share of tests passed (`rules.code`).

The program is the response's last fenced block of `rules.code.block`'s language (```python),
or the whole response (block null); a response without one scores 0. The row's tests
(`rules.code.tests_key`) are either

- assert-style: strings of Python run after the program, in its namespace (`assert add(1, 2) == 3`).
  A test passes when program and test run to their end: the harness then prints a secret it read
  from its stdin before the program started; a program that exits early (`sys.exit(0)`) or fails
  does not pass. The program runs as `__main__` with an empty stdin.
- stdin/stdout pairs (`{input: "1 2\\n", output: "3\\n"}`, or one mapping of two lists): the program
  runs with the input on stdin and passes when it exits with status 0 and its output equals the
  expected one, each line's trailing whitespace and trailing blank lines aside.

Runs go `rules.workers` at a time; a test past `rules.code.timeout_s`, or beyond its CPU, memory,
file size or process limits, fails.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import sys
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping, Sequence

from hpcrlhf.config.schema import CodeRuleConfig, RulesConfig
from hpcrlhf.data.sources import brief
from hpcrlhf.errors import ConfigError, RuleError
from hpcrlhf.logs import get_logger
from hpcrlhf.rewards.response import Response, row_value
from hpcrlhf.rewards.sandbox import CANNOT_RUN, Limits, Sandbox, SandboxError
from hpcrlhf.rewards.workers import default_workers, run_parallel

log = get_logger()

FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
"""A fenced block: ```info string, newline, the code, ```."""
HARNESS = """\
import os, sys


def main():
    secret = sys.stdin.readline().strip()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(os.devnull)
    out = os.fdopen(os.dup(1), "w")
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    for name in ("solution.py", "test.py"):
        with open(name, encoding="utf-8") as f:
            exec(compile(f.read(), name, "exec"), scope)
    sys.stdout.flush()
    out.write("\\n" + secret + "\\n")
    out.flush()


main()
"""
"""Runs an assert-style test: program, then test, in one namespace; the secret printed only after both."""


@dataclass(frozen=True)
class Test:
    """One test: Python run after the program (`code`), or stdin and the expected stdout."""

    code: str | None = None
    stdin: str = ""
    expected: str = ""


def program_in(text: str, block: str | None) -> str | None:
    """The program of a response: the last complete fenced block whose language (the info string's
    first word, any case) is `block` ("" any language), or the whole text (`block` None)."""
    if block is None:
        return text
    blocks = [code for info, code in FENCE.findall(text) if not block or info.strip().split(" ")[0].lower() == block.lower()]
    return blocks[-1] if blocks else None


def normalized(output: str) -> str:
    """Output as compared: each line's trailing whitespace and the trailing blank lines removed."""
    return "\n".join(line.rstrip() for line in output.splitlines()).rstrip("\n")


class CodeRule:
    """The `code` rule (see the module docstring)."""

    def __init__(self, rules: RulesConfig, label: str):
        cfg: CodeRuleConfig = rules.code
        self.cfg, self.label, self.workers = cfg, label, rules.workers or default_workers()
        python = shutil.which(cfg.python) if cfg.python else sys.executable
        if not python:
            raise ConfigError(f"rules.code.python: {cfg.python!r} is not a program found on PATH; give the interpreter "
                              "that runs the programs, e.g. /usr/bin/python3")
        self.sandbox = Sandbox(os.path.abspath(python),
                               Limits(cfg.timeout_s, cfg.cpu_time_s, cfg.memory_mb, cfg.file_size_mb, cfg.processes),
                               cfg.allow_host_network)
        self.isolation = self._probe()

    def _probe(self) -> Mapping:
        """Run a program that prints a word, before any training: the sandbox works here, or a
        ConfigError says why and what to set."""
        fix = ("set rules.code.allow_host_network=true to run programs on the host's network and filesystem, or run "
               "the job where unprivileged user namespaces are allowed")
        try:
            outcome = self.sandbox.run({"solution.py": "print('ready')"}, ["solution.py"])
        except SandboxError as e:
            if "cannot be run" in str(e):
                raise ConfigError(f"rules.code.python: {e}; name an interpreter it can run, e.g. /usr/bin/python3 "
                                  f"({self.label})") from None
            raise ConfigError(f"rules.code.allow_host_network: {e}; {fix} ({self.label})") from None
        if outcome.stdout.strip() != b"ready":
            why = "it could not be started" if outcome.exit_status == CANNOT_RUN else f"exit status {outcome.exit_status}"
            raise ConfigError(f"rules.code: the sandbox cannot run Python programs with {self.sandbox.python} ({why}): "
                              f"check rules.code.python and rules.code.memory_mb ({self.label})")
        got = outcome.isolation
        log.info(f"{self.label}: programs run with {self.sandbox.python} as {got.get('user')} with a {got.get('network')} "
                 f"network, {'a PID namespace' if got.get('pids') else 'no PID namespace'}, a filesystem "
                 f"{got.get('filesystem')}, process count {got.get('processes')}, up to {self.workers} at once")
        return got

    def _tests(self, r: Response) -> list[Test]:
        """The row's tests, or a RuleError naming rule, row, field and what is wrong with them."""
        cfg = self.cfg
        value = row_value(self.label, r, cfg.tests_key, "rules.code.tests_key")
        if isinstance(value, Mapping) and isinstance(value.get(cfg.input_key), list) \
                and isinstance(value.get(cfg.output_key), list) and len(value[cfg.input_key]) == len(value[cfg.output_key]):
            value = [{cfg.input_key: i, cfg.output_key: o} for i, o in zip(value[cfg.input_key], value[cfg.output_key])]
        if not isinstance(value, list) or not value:
            raise self._bad_tests(r, value, "a non-empty list of tests, or a mapping of two lists of the same length "
                                            f"({cfg.input_key!r}, {cfg.output_key!r})")
        return [self._test(r, j, item) for j, item in enumerate(value)]

    def _test(self, r: Response, j: int, item: Any) -> Test:
        cfg = self.cfg
        if isinstance(item, str):
            return Test(code=item)
        if isinstance(item, Mapping) and all(isinstance(item.get(key), str) for key in (cfg.input_key, cfg.output_key)):
            return Test(stdin=item[cfg.input_key], expected=item[cfg.output_key])
        raise self._bad_tests(r, item, f"a test (Python text, or a mapping of {cfg.input_key!r} and {cfg.output_key!r} "
                                       f"texts: rules.code.input_key, rules.code.output_key)", f"[{j}]")

    def _bad_tests(self, r: Response, value: Any, what: str, index: str = "") -> RuleError:
        where = f" ({r.origin})" if r.origin else ""
        return RuleError(f"{self.label}: field {self.cfg.tests_key!r}{index} (rules.code.tests_key) of the row of prompt "
                         f"{brief(r.prompt)}{where} is {brief(value)}, not {what}; fix the row")

    def _passes(self, job: tuple[str, Test]) -> bool:
        program, test = job
        if test.code is None:
            outcome = self.sandbox.run({"solution.py": program}, ["solution.py"], test.stdin.encode())
            printed = outcome.stdout.decode(errors="replace")
            return outcome.exit_status == 0 and normalized(printed) == normalized(test.expected)
        secret = secrets.token_hex(16)
        outcome = self.sandbox.run({"solution.py": program, "test.py": test.code, "harness.py": HARNESS}, ["harness.py"],
                                   (secret + "\n").encode())
        return outcome.exit_status == 0 and outcome.stdout.decode(errors="replace").endswith(f"\n{secret}\n")

    def scores(self, responses: Sequence[Response]) -> list[float]:
        tests = [self._tests(r) for r in responses]  # every row checked before anything runs
        programs = [program_in(r.text, self.cfg.block) for r in responses]
        jobs = [(i, (programs[i], test)) for i in range(len(responses)) if programs[i] is not None for test in tests[i]]
        self.sandbox.reopen()
        try:
            passed = run_parallel(self._passes, [job for _, job in jobs], self.workers, self.sandbox.kill_all)
        except SandboxError as e:
            raise RuleError(f"{self.label}: {e}") from None
        out = [0.0] * len(responses)
        for (i, _), ok in zip(jobs, passed):
            out[i] += ok / len(tests[i])
        return out
