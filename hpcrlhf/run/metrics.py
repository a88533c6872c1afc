"""Metrics: `metrics.jsonl` (one JSON object per logged step, always with `step`), then the run's
trackers (TensorBoard, W&B, MLflow: hpcrlhf.run.trackers).

Keys are stable and namespaced (`train/loss`, `eval/task_score`, `timing/step`) so that runs,
plots and benchmarks can be compared. Only rank 0 writes.

A line is appended whole or not at all: when a write fails (a full disk), the file is cut back to
its previous end, so a rerun never meets half a line; never through a link, never into a FIFO
(hpcrlhf.run.files.append). `read_metrics` also drops a torn last line
(a crash or power loss mid-write) with a warning, and names the line of any other bad one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hpcrlhf.errors import DataError
from hpcrlhf.logs import get_logger
from hpcrlhf.run.diskspace import RESUME_HINT, out_of_space_is_an_error
from hpcrlhf.run.files import append


class MetricsWriter:
    """metrics.jsonl, then the run's trackers, if any (`hpcrlhf.run.trackers.Trackers`: TensorBoard, W&B,
    MLflow; it reads metrics.jsonl, so it is given, not imported)."""

    def __init__(self, run_dir: Path, *, enabled: bool = True, trackers: Any = None):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.trackers = trackers

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with out_of_space_is_an_error(self.path.parent, self.path.name, resume_hint=RESUME_HINT):
            append(self.path, (json.dumps(record) + "\n").encode())
        if self.trackers is not None:
            self.trackers.log(step, record)

    def close(self, ended: str = "done") -> None:
        if self.trackers is not None:
            self.trackers.close(ended)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible instead of invalid output
    return value


def read_json_lines(path: Path, *, torn: str, fix: str) -> list[Any]:
    """The JSON value of each line of `path`, in order (blank lines skipped). A torn last line (no newline,
    not JSON: a crash mid-write) is left out with a warning ending in `torn`; any other bad line is a
    DataError naming it and `fix`."""
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    values = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            values.append(json.loads(line))
        except ValueError as e:
            if number == len(lines) and not text.endswith("\n"):
                get_logger().warning(f"{path}:{number}: the last line is incomplete (a write cut short); {torn}")
                break
            raise DataError(f"{path}:{number}: not a JSON line ({e}); {fix}") from None
    return values


def read_metrics(run_dir: Path | str) -> list[dict[str, Any]]:
    """Every record of a run's metrics.jsonl, in order. A torn last line (no newline, not JSON: a
    crash mid-write) is left out with a warning; any other bad line is a DataError naming it."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    fix = "fix or delete that line"
    records = read_json_lines(path, torn="ignoring it", fix=fix)
    for record in records:
        if not isinstance(record, dict) or "step" not in record:
            raise DataError(f"{path}: {str(record)[:80]!r} is not a metrics record (a JSON object with a step); {fix}")
    return records
