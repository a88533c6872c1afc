"""The `math` rule: the response's final answer checked for mathematical equivalence with the row's
reference answer, 1 or 0 (`rules.math`).

The final answer is found here (`final_answer`): the content of the response's last `\\boxed{...}`
(braces balanced; an unclosed last box -- a response cut off -- is no answer), or the last number
written in digits (`last_number`). The reference is the row's `rules.math.answer_key` field: a
number, or text as written inside a box; a text holding a box (a worked solution) gives its last
box. Comparing the two is math-verify's work, done by worker processes
(`hpcrlhf.rewards.math_worker`) so that a check past `rules.math.timeout_s` can be ended: the
worker is killed and the answer scores 0 (SIGALRM, what math-verify's own timeout uses, cannot
interrupt the C code of a hostile answer such as `9^{9^{9^9}}`).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path
from collections.abc import Sequence

from hpcrlhf.config.schema import MathRuleConfig, RulesConfig
from hpcrlhf.data.sources import brief
from hpcrlhf.errors import ConfigError, RuleError
from hpcrlhf.logs import get_logger
from hpcrlhf.rewards.response import Response, row_value
from hpcrlhf.rewards.workers import WorkerError, WorkerPool, default_workers

log = get_logger()

BOX = "\\boxed"
NUMBER = re.compile(r"(?<!\d)-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?")
"""A number written in digits: `-12`, `3.5`, `1,234` (thousands separated by commas), `3/4`."""


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` of `text`, braces balanced (`\\{` and `\\}` are text);
    None when there is none, or the last one is not a complete box."""
    start = text.rfind(BOX + "{")
    if start < 0:
        return None
    depth, i = 0, start + len(BOX)
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(BOX) + 1 : i]
        i += 1
    return None


def last_number(text: str) -> str | None:
    """The last number written in digits in `text` (thousands separators removed), or None."""
    found = NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def final_answer(text: str, extract: str) -> str | None:
    """The response's final answer as `rules.math.extract` says (`boxed`, `last_number`), or None."""
    return last_boxed(text) if extract == "boxed" else last_number(text)


class MathRule:
    """The `math` rule (see the module docstring)."""

    def __init__(self, rules: RulesConfig, label: str):
        cfg: MathRuleConfig = rules.math
        self.cfg, self.label = cfg, label
        if importlib.util.find_spec("math_verify") is None:
            raise ConfigError(f"{label}: the math rule checks answers with the math-verify package, which is not "
                              "installed in this Python: pip install math-verify==0.9.0 (hpcrlhf's requirements have it)")
        root = str(Path(__file__).resolve().parents[2])  # this hpcrlhf, whatever the worker's sys.path holds
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
        self.pool = WorkerPool([sys.executable, "-m", "hpcrlhf.rewards.math_worker", str(cfg.memory_mb)],
                               rules.workers or default_workers(), cfg.timeout_s, env)

    def _reference(self, r: Response) -> str:
        value = row_value(self.label, r, self.cfg.answer_key, "rules.math.answer_key")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return repr(value)
        if isinstance(value, str) and value.strip():
            if BOX + "{" not in value:
                return value.strip()
            boxed = last_boxed(value)
            if boxed is not None:
                return boxed
        raise self._bad_reference(r, value, "a number, a non-empty text, or a text whose last \\boxed{} is complete")

    def _bad_reference(self, r: Response, value, what: str) -> RuleError:
        where = f" ({r.origin})" if r.origin else ""
        return RuleError(f"{self.label}: the reference answer {brief(value)} (field {self.cfg.answer_key!r}, "
                         f"rules.math.answer_key) of the row of prompt {brief(r.prompt)}{where} is not {what}; fix the row")

    def scores(self, responses: Sequence[Response]) -> list[float]:
        references = [self._reference(r) for r in responses]  # every row checked before any work
        answers = [final_answer(r.text, self.cfg.extract) for r in responses]
        asked = [i for i, a in enumerate(answers) if a is not None]
        try:
            replies = self.pool.ask_all([{"answer": answers[i], "reference": references[i]} for i in asked])
        except WorkerError as e:
            raise RuleError(f"{self.label}: the answer checker (python -m hpcrlhf.rewards.math_worker) could not start: "
                            f"{e}") from None
        out = [0.0] * len(responses)
        for i, reply in zip(asked, replies):
            if reply is not None and "unreadable" in reply:
                raise self._bad_reference(responses[i], responses[i].row[self.cfg.answer_key], "readable as math")
            out[i] = 1.0 if reply and reply.get("equal") else 0.0
        unchecked = sum(reply is None for reply in replies)
        if unchecked:
            log.warning(f"{self.label}: {unchecked} of {len(responses)} answers were not checked within "
                        f"rules.math.timeout_s ({self.cfg.timeout_s:g} s) and rules.math.memory_mb "
                        f"({self.cfg.memory_mb} MiB), and score 0")
        failed = [(i, reply["error"]) for i, reply in zip(asked, replies) if reply and "error" in reply]
        if failed:
            i, error = failed[0]
            log.warning(f"{self.label}: math-verify failed on {len(failed)} of {len(responses)} answers, which score 0; "
                        f"the first: {error} (answer {brief(answers[i])}, reference {brief(references[i])})")
        return out
