"""`eval.keep_best`: the run's best evaluation by one metric, and its model in `best/` of the run folder.

After each periodic evaluation and the final one, a value better than the best so far (`keep_best_mode`:
larger or smaller) exports the model into `best/` with `best.json` ({metric, mode, value, step}) written
in the same export, so the folder and its record never disagree (`models.export` writes through a
staging folder renamed into place). `model/` stays the final model. A resumed run reads `best.json` and
keeps that best until an evaluation beats it, even when it resumes from a checkpoint older than the best
step (that model existed, and its folder is kept).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcrlhf.config.schema import EvalConfig
from hpcrlhf.config.stop_rule import reported
from hpcrlhf.errors import ConfigError

BEST_FOLDER = "best"
RECORD = "best.json"


@dataclass
class BestModel:
    metric: str
    mode: str
    value: float | None = None
    step: int | None = None

    @classmethod
    def of_run(cls, cfg: EvalConfig, run_dir: Path) -> BestModel | None:
        """The run's best so far (from `best/best.json` when there is one), or None without eval.keep_best."""
        if not cfg.keep_best:
            return None
        best = cls(cfg.keep_best, cfg.keep_best_mode)
        record = Path(run_dir) / BEST_FOLDER / RECORD
        if record.exists():
            saved = json.loads(record.read_text())
            if (saved.get("metric"), saved.get("mode")) == (best.metric, best.mode):  # else: a new choice, a new best
                best.value, best.step = float(saved["value"]), int(saved["step"])
        return best

    def require_metric(self, evaluation: Mapping[str, float]) -> None:
        """The metric must be one the job's evaluation reports (checked at the first evaluation)."""
        if self.metric not in evaluation:
            raise ConfigError(f"eval.keep_best: {self.metric!r} is not reported by this job's evaluation (it reports: "
                              f"{reported(evaluation)}); use one of those")

    def improved(self, evaluation: Mapping[str, float]) -> bool:
        """Whether `evaluation` beats the best so far (a NaN never does)."""
        value = evaluation[self.metric]
        if not math.isfinite(value):
            return False
        if self.value is None:
            return True
        return value > self.value if self.mode == "max" else value < self.value

    def files(self, evaluation: Mapping[str, float], step: int) -> dict[str, str]:
        """`best.json` of `evaluation` at `step`, to export with its model; this becomes the best so far."""
        self.value, self.step = float(evaluation[self.metric]), step
        return {RECORD: json.dumps(self.summary(), indent=2) + "\n"}

    def summary(self) -> dict:
        return {"metric": self.metric, "mode": self.mode, "value": self.value, "step": self.step}
