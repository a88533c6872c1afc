"""Train and eval rows for a job: from the configured files, or from the bundled task; and the
held-out prompts a job's evaluation answers and scores (task score, `eval.metrics`).

Which task applies is `TaskConfig.resolve`: with `task.name: auto` (the default) the bundled task
supplies data and score only when `data.train_path` is unset; `task_note` says so in the log.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Sequence

from hpcrlhf.config.schema import DataSourceConfig, TaskConfig
from hpcrlhf.data.sources import Row, brief, read_rows, require_text, rows_from_records
from hpcrlhf.data.tasks import build_task
from hpcrlhf.errors import DataError

TaskRecords = Callable[[Any, str, int], list[dict]]
"""(task, split, n) -> the task's rows of the kind a job trains on."""


def load_rows(data: DataSourceConfig, task_cfg: TaskConfig, task_records: TaskRecords) -> tuple[list[Row], list[Row]]:
    """(train rows, eval rows). A train file without an eval file gives no eval rows; the task
    supplies both splits when no train file is set."""
    train = load_train_rows(data, task_cfg, task_records)
    if data.eval_path:
        evals = read_rows(data.eval_path, split=data.split)
    elif not data.train_path:
        evals = _task_rows(data, task_cfg, task_records, "eval", task_cfg.eval_size)
    else:
        evals = []
    return train, evals


def load_train_rows(data: DataSourceConfig, task_cfg: TaskConfig, task_records: TaskRecords) -> list[Row]:
    """The training rows: `data.train_path`'s (up to `data.max_samples`), else the task's."""
    if data.train_path:
        return read_rows(data.train_path, split=data.split, limit=data.max_samples)
    return _task_rows(data, task_cfg, task_records, "train", data.max_samples or task_cfg.train_size)


def _task_rows(data: DataSourceConfig, task_cfg: TaskConfig, task_records: TaskRecords, split: str, n: int) -> list[Row]:
    task = build_task(task_cfg, data)
    return rows_from_records(task_records(task, split, n), f"task:{task.name}[{split}]")


def held_out_prompt_rows(data: DataSourceConfig, task_cfg: TaskConfig, limit: int | None = None
                         ) -> tuple[list[Row], str]:
    """(rows, prompt field) of the held-out prompts evaluation answers: the first `limit` rows of
    `data.eval_path`, else the task's held-out prompts (at most `task.eval_size`) when a task
    applies, else none. Rows are checked here, before any model loads: a prompt field on every row,
    and, with a task, prompts that are its questions."""
    task = build_task(task_cfg, data)
    if data.eval_path:
        rows = read_rows(data.eval_path, split=data.split, limit=limit)
        require_text(rows, (data.prompt_key,), key_option={data.prompt_key: "data.prompt_key"})
        require_task_prompts(rows, data.prompt_key, task_cfg, data)
        return rows, data.prompt_key
    if task is None:
        return [], data.prompt_key
    n = task_cfg.eval_size if limit is None else min(limit, task_cfg.eval_size)
    return _task_rows(data, task_cfg, lambda t, split, k: t.prompt_rows(split, k), "eval", n), "prompt"


def require_task_prompts(rows: Sequence[Row], key: str, task_cfg: TaskConfig, data: DataSourceConfig) -> None:
    """With a task applying to rows of a data file, every prompt must be one of the task's questions
    (its score and the `task` rules parse them): the first one that is not is named by file and line."""
    task = build_task(task_cfg, data)
    if task is None:
        return
    for row in rows:
        try:
            task.answer(row.data[key])
        except DataError as e:
            if task_cfg.name == "auto":  # no train file: the task supplies the training data
                setting, fix = (f"task.name is auto (so {task.name}, as data.train_path is unset)",
                                f"give {task.name} questions, or your own training data (data.train_path) with "
                                "task.name=auto or null")
            else:
                setting, fix = (f"task.name is {task.name}", "set task.name=auto (or null) to use your own prompts "
                                "without the bundled task")
            raise DataError(f"{row.origin}: {setting}, and prompt {brief(row.data[key])} is no {task.name} question "
                            f"({e}); {fix}") from None


def task_note(task_cfg: TaskConfig, data: DataSourceConfig) -> str | None:
    """The log line that says which task a job uses when that is not plain from the config: always
    for `task.name: auto`, and for a task named on purpose next to data files."""
    name = task_cfg.resolve(data)
    if task_cfg.name == "auto":
        if name is None:
            return ("task.name=auto: data.train_path is set, so the bundled task is off: your prompts get no task "
                    "score and no `task` reward rule (set task.name=arithmetic to apply it anyway)")
        return f"task.name=auto: data.train_path is unset, so the bundled {name} task supplies the data and the task score"
    if name is not None and (data.train_path or data.eval_path):
        return (f"task.name={name}: the bundled {name} task scores the answers to your prompts (they must be {name} "
                "questions; task.name=auto or null leaves them unscored)")
    return None
