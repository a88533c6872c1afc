"""Train and eval rows for a job: from the configured files, or from the bundled task."""

from __future__ import annotations

from typing import Any, Callable

from hpcrlhf.config.schema import DataSourceConfig, TaskConfig
from hpcrlhf.data.sources import Row, read_rows, rows_from_records
from hpcrlhf.data.tasks import build_task

TaskRecords = Callable[[Any, str, int], list[dict]]
"""(task, split, n) -> the task's rows of the kind a job trains on."""


def load_rows(data: DataSourceConfig, task_cfg: TaskConfig, task_records: TaskRecords) -> tuple[list[Row], list[Row]]:
    """(train rows, eval rows). A train file without an eval file gives no eval rows; the task
    supplies both splits when no train file is set."""
    task = build_task(task_cfg)
    origin = f"task:{task_cfg.name}"
    if data.train_path:
        train = read_rows(data.train_path, split=data.split, limit=data.max_samples)
    else:
        train = rows_from_records(task_records(task, "train", data.max_samples or task_cfg.train_size), f"{origin}[train]")
    if data.eval_path:
        evals = read_rows(data.eval_path, split=data.split)
    elif not data.train_path:
        evals = rows_from_records(task_records(task, "eval", task_cfg.eval_size), f"{origin}[eval]")
    else:
        evals = []
    return train, evals
