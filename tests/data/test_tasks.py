"""The bundled arithmetic task: deterministic rows, disjoint splits, exact rewards."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpcrlhf.config.schema import BUNDLED_TASKS
from hpcrlhf.data.tasks import TASKS, ArithmeticTask, get_task
from hpcrlhf.errors import ConfigError, DataError

TASK = ArithmeticTask()


def test_rows_are_deterministic_and_prefixes():
    other = ArithmeticTask()
    assert TASK.sft_rows("train", 50) == other.sft_rows("train", 50)
    assert TASK.sft_rows("train", 20) == TASK.sft_rows("train", 50)[:20]
    hard = TASK.preference_rows("eval", 30, hard=True)
    assert TASK.preference_rows("eval", 7, hard=True) == hard[:7]
    assert TASK.unpaired_rows("train", 9) == TASK.unpaired_rows("train", 40)[:9]
    assert TASK.prompt_rows("eval", 0) == []


def test_rows_do_not_depend_on_the_process():
    # Python's hash() is randomised per process; the split and streams must not use it.
    code = (
        "from hpcrlhf.data.tasks import ArithmeticTask; "
        "print(ArithmeticTask().sft_rows('eval', 5))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(TASK.sft_rows("eval", 5))


def test_seed_changes_rows():
    assert ArithmeticTask(seed=1).sft_rows("train", 20) != TASK.sft_rows("train", 20)


def test_train_and_eval_are_disjoint():
    train = {r["prompt"] for r in TASK.prompt_rows("train", 3000)}
    evals = {r["prompt"] for r in TASK.prompt_rows("eval", 1500)}
    assert train and evals and not train & evals
    # The eval split holds roughly eval_fraction of the 100 * 100 problems.
    assert 800 < len(evals) < 1200


def test_rows_are_distinct_within_an_epoch():
    prompts = [r["prompt"] for r in TASK.prompt_rows("eval", 500)]
    assert len(set(prompts)) == len(prompts)


def test_row_contents():
    for row in TASK.sft_rows("train", 100):
        a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
        assert row["response"] == str(a + b)
        assert 0 <= a <= 99 and 0 <= b <= 99
    for row in TASK.prompt_rows("eval", 100):
        assert TASK.score(row["prompt"], row["answer"]) == 1.0


def test_three_operands_and_large_spaces():
    task = ArithmeticTask(max_operand=9999, num_operands=3)
    rows = task.sft_rows("train", 50)
    assert rows == task.sft_rows("train", 50)
    for row in rows:
        assert row["prompt"].count("+") == 2
        assert task.score(row["prompt"], row["response"]) == 1.0
    evals = {r["prompt"] for r in task.prompt_rows("eval", 50)}
    assert not evals & {r["prompt"] for r in rows}


@pytest.mark.parametrize(
    "response, expected",
    [
        ("357", 1.0),
        (" 357", 1.0),
        ("357<|eos|>", 1.0),
        ("357\nmore text", 1.0),
        ("357 12", 1.0),
        ("358", 0.0),
        ("35", 0.0),
        ("3570", 0.0),
        ("", 0.0),
        ("   ", 0.0),
        ("the answer is 357", 0.0),
        ("-357", 0.0),
    ],
)
def test_score(response, expected):
    assert TASK.score("12+345=", response) == expected


def test_score_parses_wrapped_prompts():
    chat = "<|bos|><|user|>\n12+345=<|eos|>\n<|assistant|>\n"
    assert TASK.score(chat, "357") == 1.0
    assert TASK.score("1+2+3=", "6") == 1.0


@pytest.mark.parametrize("prompt", ["", "hello", "12+=", "12=", "+3="])
def test_unparseable_prompt_raises(prompt):
    with pytest.raises(DataError, match="cannot parse arithmetic prompt"):
        TASK.score(prompt, "1")


@pytest.mark.parametrize(
    "response, expected",
    [
        ("357", 1.0),
        ("358", 2 / 3),
        ("457", 2 / 3),
        ("57", 2 / 3),  # two digits right, one missing
        ("1357", 3 / 4),  # all right, one extra
        ("000", 0.0),
        ("", 0.0),
        ("abc", 0.0),
    ],
)
def test_partial_score(response, expected):
    assert TASK.partial_score("12+345=", response) == pytest.approx(expected)


@pytest.mark.parametrize("hard", [False, True])
def test_preference_rows(hard):
    rows = TASK.preference_rows("train", 500, hard=hard)
    for row in rows:
        assert row["chosen"] != row["rejected"]
        assert TASK.score(row["prompt"], row["chosen"]) == 1.0
        assert TASK.score(row["prompt"], row["rejected"]) == 0.0
        assert int(row["rejected"]) >= 0
        gap = abs(int(row["rejected"]) - int(row["chosen"]))
        if hard:
            # near misses: off by 1 or 10, or two digits swapped
            assert gap in (1, 10) or sorted(row["rejected"]) == sorted(row["chosen"])
        else:
            assert len(row["rejected"]) != len(row["chosen"])


def test_offset_near_misses_are_the_policys_kind_of_mistake():
    rows = TASK.preference_rows("train", 2000, hard=True, near_miss="offset")
    gaps = [int(r["rejected"]) - int(r["chosen"]) for r in rows]
    assert set(gaps) == {-10, -3, -2, -1, 1, 2, 3, 10}  # every offset occurs, nothing else
    assert all(int(r["rejected"]) >= 0 for r in rows)
    assert 0.15 < sum(abs(g) == 10 for g in gaps) / len(gaps) < 0.35  # tens errors: about 1 in 4
    # the default kind's rows are unchanged by the new option
    assert TASK.preference_rows("train", 50, hard=True) == TASK.preference_rows("train", 50, hard=True, near_miss="digit")
    mixed = TASK.mixed_preference_rows("eval", 200, 1.0, near_miss="offset")
    assert all(abs(int(r["rejected"]) - int(r["chosen"])) in (1, 2, 3, 10) for r in mixed)
    with pytest.raises(ConfigError, match="near_miss='units'.*digit, offset"):
        TASK.preference_rows("train", 5, hard=True, near_miss="units")


def test_unpaired_rows_are_balanced_and_labelled_right():
    rows = TASK.unpaired_rows("train", 400)
    assert sum(r["label"] for r in rows) == 200
    for row in rows:
        assert TASK.score(row["prompt"], row["completion"]) == float(row["label"])


def test_registry():
    assert TASKS["arithmetic"] is ArithmeticTask
    assert get_task("arithmetic", max_operand=9) == ArithmeticTask(max_operand=9)
    with pytest.raises(DataError, match="arithmetic"):
        get_task("poetry")
    with pytest.raises(ConfigError, match="max_operand"):
        get_task("arithmetic", max_operandd=9)


def test_the_config_declares_exactly_the_registered_tasks():
    """The config checks `task.name` against, and takes the tasks' default lengths from, its own
    table (it imports no data code): the two must name the same tasks."""
    assert set(BUNDLED_TASKS) == set(TASKS)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_operand": 0}, "max_operand"),
        ({"num_operands": 1}, "num_operands"),
        ({"eval_fraction": 0.0}, "eval_fraction"),
        ({"eval_fraction": 1.5}, "eval_fraction"),
        ({"max_operand": 1, "eval_fraction": 0.01}, "split"),
    ],
)
def test_invalid_fields(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ArithmeticTask(**kwargs)


def test_invalid_split_and_count():
    with pytest.raises(ConfigError, match="split"):
        TASK.sft_rows("test", 3)
    with pytest.raises(ConfigError, match="n="):
        TASK.sft_rows("train", -1)
