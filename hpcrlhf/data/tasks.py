"""Bundled synthetic tasks with checkable answers.

The point of a bundled task is that every algorithm in hpcrlhf (SFT, reward model, DPO, KTO,
PPO, GRPO, rejection sampling) can be shown to *learn* on a tiny model on a laptop CPU, without
downloading anything: the right answer is known, so rewards are exact and progress is
measurable.

The task is integer addition written the way a person writes it. The prompt is the question
and the response is the sum, nothing else (trainers append the end-of-sequence token):

    prompt  "12+345="
    response "357"

Train and eval problems are disjoint: every problem (its tuple of operands) is assigned to one
split by a stable hash of the operands and the seed, so the eval score measures whether the
model learned to add, not whether it memorised the training set. Every row list is
deterministic given the task's fields, and a list of `n` rows is a prefix of a list of `n + k`
rows, so growing a dataset never reshuffles the rows already used.

Row kinds, one method each (all take `split` = "train" or "eval" and a row count `n`):

- `sft_rows`        {"prompt", "response"}                    correct demonstrations
- `prompt_rows`     {"prompt", "answer"}                      prompts for RL and evaluation
- `preference_rows` {"prompt", "chosen", "rejected"}          chosen right, rejected wrong
- `mixed_preference_rows` the same plus "difficulty": easy and hard pairs mixed
- `unpaired_rows`   {"prompt", "completion", "label"}         half right (True), half wrong

`score(prompt, response)` is the exact, rule-based reward (1.0 or 0.0) and `partial_score` a
dense variant (fraction of digits right), both usable as reward functions.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from hpcrlhf.errors import ConfigError, DataError

SPLITS = ("train", "eval")

# Problem spaces up to this size are enumerated and shuffled (so rows are distinct until the
# split is exhausted); larger ones are sampled with replacement.
_ENUMERATE_LIMIT = 200_000

# The question: operands joined by "+" and closed by "=". The last such question in the text
# counts, so a prompt wrapped in a chat template still parses.
_PROMPT_RE = re.compile(r"(\d+(?:\+\d+)+)=")
# The answer: the integer the response starts with (after whitespace); whatever follows
# (an EOS marker, a newline, more text) is ignored.
_ANSWER_RE = re.compile(r"\s*(\d+)")


def _unit_hash(*parts: object) -> float:
    """A stable hash of `parts` mapped to [0, 1) (unlike hash(), the same in every process)."""
    text = "|".join(str(p) for p in parts).encode()
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _rng(*parts: object) -> random.Random:
    """A private random stream named by `parts` (string seeds are hashed stably by Python)."""
    return random.Random("|".join(str(p) for p in parts))


def _split_of(operands: tuple[int, ...], eval_fraction: float, seed: int) -> str:
    key = "+".join(str(x) for x in operands)
    return "eval" if _unit_hash("split", seed, key) < eval_fraction else "train"


@functools.lru_cache(maxsize=8)
def _partition(min_operand: int, max_operand: int, num_operands: int, eval_fraction: float,
               seed: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    """An enumerable problem space split into train and eval (`_split_of`), in enumeration order:
    once per process for every task of these settings (a job builds several task objects and asks
    each for both splits; hashing the problems every time was ~2 s of each job's start)."""
    out: dict[str, list[tuple[int, ...]]] = {split: [] for split in SPLITS}
    for p in itertools.product(range(min_operand, max_operand + 1), repeat=num_operands):
        out[_split_of(p, eval_fraction, seed)].append(p)
    return {split: tuple(problems) for split, problems in out.items()}


@dataclass(frozen=True)
class ArithmeticTask:
    """Multi-digit integer addition: prompt "12+345=", response "357"."""

    name: ClassVar[str] = "arithmetic"
    """Its `task.name`; the lengths its null settings default to are the config's
    (`hpcrlhf.config.schema.BUNDLED_TASKS`)."""

    max_operand: int = 99
    """Largest operand; operands are drawn uniformly from 0..max_operand."""

    num_operands: int = 2
    """How many numbers are added (2 gives "a+b=")."""

    eval_fraction: float = 0.1
    """Share of the problem space held out for the eval split (disjoint from train)."""

    seed: int = 0
    """Seeds the train/eval partition and every row stream; same seed, same rows."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_operand, int) or self.max_operand < max(1, self.min_operand):
            raise ConfigError(
                f"{type(self).__name__}.max_operand={self.max_operand!r} is invalid: use an integer >= "
                f"{max(1, self.min_operand)}"
            )
        if not isinstance(self.num_operands, int) or self.num_operands < 2:
            raise ConfigError(
                f"ArithmeticTask.num_operands={self.num_operands!r} is invalid: "
                "use an integer >= 2"
            )
        if not 0.0 < float(self.eval_fraction) < 1.0:
            raise ConfigError(
                f"ArithmeticTask.eval_fraction={self.eval_fraction!r} is invalid: "
                "use a number strictly between 0 and 1, e.g. 0.1"
            )
        if self._space_size() <= _ENUMERATE_LIMIT:
            for split in SPLITS:
                if not self._problems_of(split):
                    raise ConfigError(
                        f"ArithmeticTask with max_operand={self.max_operand}, "
                        f"num_operands={self.num_operands}, eval_fraction={self.eval_fraction} "
                        f"leaves the {split!r} split empty: raise max_operand or move "
                        "eval_fraction away from 0/1"
                    )

    # ----- problem space -------------------------------------------------------------------

    min_operand: ClassVar[int] = 0
    """Smallest operand."""

    def _space_size(self) -> int:
        return (self.max_operand + 1 - self.min_operand) ** self.num_operands

    def split_of(self, operands: tuple[int, ...]) -> str:
        """The split ("train" or "eval") a problem belongs to; fixed by operands and seed."""
        return _split_of(operands, self.eval_fraction, self.seed)

    def _problems_of(self, split: str) -> tuple[tuple[int, ...], ...]:
        return _partition(self.min_operand, self.max_operand, self.num_operands, self.eval_fraction, self.seed)[split]

    def _problem_stream(self, split: str) -> Iterator[tuple[int, ...]]:
        """An endless, deterministic stream of the split's problems."""
        rng = _rng("problems", self.seed, split)
        if self._space_size() <= _ENUMERATE_LIMIT:
            problems = list(self._problems_of(split))
            while True:  # one shuffled pass per epoch, so rows are distinct within an epoch
                rng.shuffle(problems)
                yield from problems
        while True:
            problem = tuple(rng.randint(self.min_operand, self.max_operand) for _ in range(self.num_operands))
            if self.split_of(problem) == split:
                yield problem

    def _problems(self, split: str, n: int) -> list[tuple[int, ...]]:
        if split not in SPLITS:
            raise ConfigError(f"split={split!r} is invalid: use one of {', '.join(SPLITS)}")
        if not isinstance(n, int) or n < 0:
            raise ConfigError(f"n={n!r} is invalid: use a row count >= 0")
        return list(itertools.islice(self._problem_stream(split), n))

    @staticmethod
    def format_prompt(operands: tuple[int, ...]) -> str:
        return "+".join(str(x) for x in operands) + "="

    # ----- rows ----------------------------------------------------------------------------

    def sft_rows(self, split: str, n: int) -> list[dict[str, str]]:
        """`n` demonstrations {"prompt", "response"} with the correct sum as response."""
        return [
            {"prompt": self.format_prompt(p), "response": str(sum(p))}
            for p in self._problems(split, n)
        ]

    def prompt_rows(self, split: str, n: int) -> list[dict[str, str]]:
        """`n` prompts {"prompt", "answer"} (answer is the correct sum as a string)."""
        return [
            {"prompt": self.format_prompt(p), "answer": str(sum(p))}
            for p in self._problems(split, n)
        ]

    def preference_rows(self, split: str, n: int, hard: bool = False,
                        near_miss: str = "digit") -> list[dict[str, str]]:
        """`n` pairs {"prompt", "chosen", "rejected"}: chosen is the sum, rejected is wrong.

        Easy pairs (default) reject an answer with the wrong number of digits; hard pairs
        reject a near miss of the kind `near_miss` names (see `NEAR_MISSES`).
        """
        if near_miss not in NEAR_MISSES:
            raise ConfigError(f"near_miss={near_miss!r} is unknown: valid kinds are {', '.join(NEAR_MISSES)}")
        extra = () if near_miss == "digit" else (near_miss,)  # `digit` rows stay as they always were
        rng = _rng("preference", self.seed, split, hard, *extra)
        wrong = NEAR_MISSES[near_miss] if hard else _far_miss
        rows = []
        for p in self._problems(split, n):
            answer = sum(p)
            rows.append(
                {
                    "prompt": self.format_prompt(p),
                    "chosen": str(answer),
                    "rejected": str(wrong(answer, rng)),
                }
            )
        return rows

    def mixed_preference_rows(self, split: str, n: int, hard_fraction: float,
                              near_miss: str = "digit") -> list[dict[str, str]]:
        """`n` pairs like `preference_rows`, each hard with probability `hard_fraction` (a stable
        per-row draw), with a "difficulty" field ("easy" or "hard") for per-kind evaluation."""
        easy = self.preference_rows(split, n)
        hard = self.preference_rows(split, n, hard=True, near_miss=near_miss)
        rows = []
        for i, (e, h) in enumerate(zip(easy, hard)):  # same problem at the same index
            is_hard = _unit_hash("difficulty", self.seed, split, i) < hard_fraction
            rows.append({**(h if is_hard else e), "difficulty": "hard" if is_hard else "easy"})
        return rows

    def unpaired_rows(self, split: str, n: int) -> list[dict[str, Any]]:
        """`n` rows {"prompt", "completion", "label"}; labels alternate True/False (balanced).

        Wrong completions are half near misses, half clearly wrong answers.
        """
        rng = _rng("unpaired", self.seed, split)
        rows: list[dict[str, Any]] = []
        for i, p in enumerate(self._problems(split, n)):
            answer = sum(p)
            label = i % 2 == 0
            if label:
                completion = answer
            else:
                completion = (_near_miss if rng.random() < 0.5 else _far_miss)(answer, rng)
            rows.append(
                {"prompt": self.format_prompt(p), "completion": str(completion), "label": label}
            )
        return rows

    # ----- rewards -------------------------------------------------------------------------

    def parse_prompt(self, prompt: str) -> tuple[int, ...]:
        """The operands of the (last) "a+b=" question in `prompt`; DataError if none."""
        matches = _PROMPT_RE.findall(prompt)
        if not matches:
            raise DataError(
                f"cannot parse arithmetic prompt {prompt!r}: expected operands joined by '+' "
                "and ending with '=', e.g. '12+34='"
            )
        return tuple(int(x) for x in matches[-1].split("+"))

    def answer(self, prompt: str) -> int:
        """The correct sum for `prompt`."""
        return sum(self.parse_prompt(prompt))

    def score(self, prompt: str, response: str) -> float:
        """1.0 if the integer `response` starts with equals the sum, else 0.0."""
        target = self.answer(prompt)
        match = _ANSWER_RE.match(response)
        return 1.0 if match is not None and int(match.group(1)) == target else 0.0

    def partial_score(self, prompt: str, response: str) -> float:
        """Fraction of digits right, aligned from the right (the units digit first).

        Divided by the longer of answer and response, so missing or extra digits cost too;
        1.0 exactly when `score` is 1.0 (up to leading zeros), 0.0 when there is no number.
        """
        target = str(self.answer(prompt))
        match = _ANSWER_RE.match(response)
        if match is None:
            return 0.0
        given = match.group(1)
        right = sum(a == b for a, b in zip(reversed(target), reversed(given)))
        return right / max(len(target), len(given))


def _far_miss(answer: int, rng: random.Random) -> int:
    """A clearly wrong answer: a random number with a different digit count."""
    length = len(str(answer))
    other = rng.choice([k for k in range(1, length + 2) if k != length])
    if other == 1:
        return rng.randint(0, 9)
    return rng.randint(10 ** (other - 1), 10**other - 1)


def _near_miss(answer: int, rng: random.Random) -> int:
    """A plausible wrong answer: off by 1 or 10, or two adjacent digits swapped."""
    candidates = {answer + 1, answer + 10}
    if answer >= 1:
        candidates.add(answer - 1)
    if answer >= 10:
        candidates.add(answer - 10)
    digits = str(answer)
    for i in range(len(digits) - 1):
        swapped = digits[:i] + digits[i + 1] + digits[i] + digits[i + 2 :]
        if swapped[0] != "0":
            candidates.add(int(swapped))
    candidates.discard(answer)
    return rng.choice(sorted(candidates))


def _offset_miss(answer: int, rng: random.Random) -> int:
    """The wrong answers a partly trained small model gives: off by 1 to 3 or by 10."""
    return rng.choice([answer + k for k in (-10, -3, -2, -1, 1, 2, 3, 10) if answer + k >= 0])


MULTIPLY_TOOL = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first factor."},
                                                    "b": {"type": "integer", "description": "The second factor."}},
                   "required": ["a", "b"]},
    "return": {"type": "integer"}}}
"""The calculator's tool as the chat template shows it: the schema of
`hpcrlhf.agents.calculator.Calculator.multiply` (tests/agents/test_calculator.py checks they agree)."""


@dataclass(frozen=True)
class CalculatorTask(ArithmeticTask):
    """Two-digit products with a calculator tool (agents, issue 39): prompt "37*59=", answer "= 2183".
    Its SFT rows are conversations (`data.messages_key`): a share `tool_share` of them (per row index,
    so no problem is learned as "tool" or "direct") answer through a `multiply` call and its result,
    the rest directly. Its environment is `hpcrlhf.agents.calculator:Calculator`. Only SFT and the
    online jobs use it (it has no preference rows)."""

    name: ClassVar[str] = "calculator"
    min_operand: ClassVar[int] = 10
    tool_share: float = 0.3
    """Share of the SFT demonstrations that call the tool."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= float(self.tool_share) <= 1.0:
            raise ConfigError(f"CalculatorTask.tool_share={self.tool_share!r} is invalid: use a share in [0, 1], e.g. 0.3")

    @staticmethod
    def format_prompt(operands: tuple[int, ...]) -> str:
        return "*".join(str(x) for x in operands) + "="

    def sft_rows(self, split: str, n: int) -> list[dict[str, Any]]:
        """`n` conversations {"messages", "tools"} answering each problem right, a `tool_share` of them
        through the `multiply` tool."""
        tools = [MULTIPLY_TOOL]
        rows = []
        for i, p in enumerate(self._problems(split, n)):
            product, question = p[0] * p[1], self.format_prompt(p)
            answer = {"role": "assistant", "content": f"= {product}"}
            if _unit_hash("tool", self.seed, split, i) < self.tool_share:
                call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": p[0], "b": p[1]}}}
                messages = [{"role": "user", "content": question}, {"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "name": "multiply", "content": str(product)}, answer]
            else:
                messages = [{"role": "user", "content": question}, answer]
            rows.append({"messages": messages, "tools": tools})
        return rows

    def prompt_rows(self, split: str, n: int) -> list[dict[str, str]]:
        return [{"prompt": self.format_prompt(p), "answer": str(p[0] * p[1])} for p in self._problems(split, n)]

    def preference_rows(self, *args: Any, **kwargs: Any) -> list[dict[str, str]]:
        raise ConfigError("task.name: calculator has no preference rows; use it with sft, ppo, rs or generate")

    mixed_preference_rows = unpaired_rows = preference_rows

    def parse_prompt(self, prompt: str) -> tuple[int, ...]:
        matches = _PRODUCT_RE.findall(prompt)
        if not matches:
            raise DataError(f"cannot parse calculator prompt {prompt!r}: expected two numbers joined by '*' and "
                            "ending with '=', e.g. '37*59='")
        return tuple(int(x) for x in matches[-1])

    def answer(self, prompt: str) -> int:
        a, b = self.parse_prompt(prompt)
        return a * b

    def score(self, prompt: str, response: str) -> float:
        """1.0 if the integer the response starts with (after an optional "=") is the product."""
        match = _RESULT_RE.match(response)
        return 1.0 if match is not None and int(match.group(1)) == self.answer(prompt) else 0.0

    def partial_score(self, prompt: str, response: str) -> float:
        match = _RESULT_RE.match(response)
        return super().partial_score(prompt, match.group(1) if match else "")


_PRODUCT_RE = re.compile(r"(\d+)\*(\d+)=")
_RESULT_RE = re.compile(r"\s*=?\s*(\d+)")


NEAR_MISSES: dict[str, Callable[[int, random.Random], int]] = {"digit": _near_miss, "offset": _offset_miss}
"""Kinds of hard rejected answers: `digit` (off by 1 or 10, or two adjacent digits swapped) and
`offset` (off by 1 to 3 or by 10: what a partly trained policy gets wrong, so what a reward model
for PPO on this task must tell apart)."""

TASKS: dict[str, type] = {ArithmeticTask.name: ArithmeticTask, CalculatorTask.name: CalculatorTask}
"""The bundled tasks by `task.name`: the names the config declares (`hpcrlhf.config.schema.BUNDLED_TASKS`,
which the config checks `task.name` against and takes default lengths from)."""


def get_task(name: str, **kwargs: Any) -> Any:
    """An instance of the registered task `name` built with `kwargs` (its fields)."""
    if name not in TASKS:
        raise DataError(f"unknown task {name!r}: valid names are {', '.join(sorted(TASKS))}")
    cls = TASKS[name]
    valid = [f.name for f in fields(cls)]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ConfigError(
            f"task {name!r} has no field(s) {', '.join(unknown)}: valid fields are "
            f"{', '.join(valid)}"
        )
    return cls(**kwargs)


def build_task(task_cfg: Any, data: Any) -> Any | None:
    """The task that applies to a job with config sections `task` and `data` (`TaskConfig.resolve`:
    `task.name: auto` is the bundled task unless `data.train_path` is set); None when no task applies."""
    name = task_cfg.resolve(data)
    if name is None:
        return None
    try:
        extra = {"tool_share": task_cfg.tool_share} if name == "calculator" else {}
        return get_task(name, max_operand=task_cfg.max_operand, seed=task_cfg.seed, **extra)
    except ConfigError as e:  # the task names its own fields; the user wrote the config's
        raise ConfigError(f"task.max_operand: {task_cfg.max_operand} is too small for task {name!r} with "
                          f"task.seed {task_cfg.seed} ({e}); raise task.max_operand, e.g. to 99") from None
