"""Catching NaN/Inf in a training step: rewards before they are learned from, the loss and the
gradients of every update, and the step's metrics.

What each case does (`train.on_nonfinite`):

* Gradients (and so a non-finite loss, whose gradients are non-finite too): the optimizer step is
  not applied — weights, optimizer moments and the learning-rate schedule stay as they were.
  DeepSpeed does this itself at ZeRO 1-3 and in bf16; `TrainingEngine` does it for plain fp32
  data parallel, where DeepSpeed would write NaN into every weight. Because gradients are
  all-reduced before the check, every rank decides the same.
* Rewards: checked right after scoring, agreed over the ranks with one small all-reduce, before
  any update uses them.
* `skip` goes on with the next step (its samples are not retried, so a resumed run still sees
  each sample at most once); after `train.max_consecutive_skips` skipped steps in a row the run
  stops, since a run that keeps producing NaN is broken, not unlucky. `stop` ends the run at the
  first one. Either way the message names the step and the tensor, and the latest checkpoint
  never contains a non-finite update (stopping raises before the step's checkpoint).

Before the first step, `require_finite_start` checks the trained model's weights and the first
evaluation instead: NaN/Inf there comes from the models as loaded, not from training (a damaged
file, an overflowing precision), so the run ends at once (`ModelError`, exit 2) naming the metric,
the damaged tensors, the models and the cause.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from hpcrlhf.errors import ModelError, TrainingError
from hpcrlhf.logs import get_logger

log = get_logger()

SKIPPED_SUFFIX = "skipped_updates"
"""Metrics whose key ends with this count optimizer steps the engines refused (non-finite gradients)."""


class NonFiniteError(TrainingError):
    """The guard ends the run (`train.on_nonfinite=stop`, or too many skipped steps in a row)."""


class SkipStep(Exception):
    """Raised inside a step whose inputs are non-finite, on every rank alike; `fit` counts it as a
    skipped step (internal: never reaches the user)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


def describe_nonfinite(t: torch.Tensor) -> str | None:
    """'2 NaN and 1 Inf of 64 values' for a tensor with non-finite entries, else None."""
    t = t.detach()
    if not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return None
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    parts = [f"{n} {name}" for n, name in ((nan, "NaN"), (inf, "Inf")) if n]
    return f"{' and '.join(parts)} of {t.numel()} values"


def nonfinite_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Name -> what is wrong, for the tensors holding NaN or Inf."""
    found = {name: describe_nonfinite(t) for name, t in tensors.items()}
    return {name: what for name, what in found.items() if what is not None}


def nonfinite_metrics(metrics: Mapping[str, float | None]) -> list[str]:
    """Keys of the metrics that are NaN or +-Inf."""
    return sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))


def skipped_updates(metrics: Mapping[str, float | None]) -> float:
    """Optimizer steps the engines refused during a step (sum over every `*skipped_updates` metric)."""
    return sum(v or 0.0 for k, v in metrics.items() if k.endswith(SKIPPED_SUFFIX))


class NonFiniteGuard:
    """Decides, step by step, whether a run with NaN/Inf goes on (`skip`) or ends (`stop`)."""

    def __init__(self, policy: str, max_consecutive_skips: int):
        self.policy, self.max_consecutive = policy, max_consecutive_skips
        self.in_a_row = 0
        self.skipped = 0
        self.step = 0
        """The step being run, as logged (1 for the first)."""
        self.nonfinite: str | None = None
        """What made the current step's update impossible (NaN/Inf inputs or gradients), else None."""

    def begin(self, step: int) -> None:
        self.step = step
        self.nonfinite = None

    def check_inputs(self, tensors: Mapping[str, torch.Tensor], *, all_ranks=None) -> None:
        """Before an update learns from `tensors` (e.g. rewards): raise SkipStep (policy skip) or
        TrainingError (stop) when any holds NaN/Inf on any rank. `all_ranks(flag) -> flag summed
        over ranks` makes every rank decide alike (None: this process alone)."""
        bad = nonfinite_tensors(tensors)
        anywhere = bool(bad) if all_ranks is None else all_ranks(float(bool(bad))) > 0
        if not anywhere:
            return
        what = "; ".join(f"{name} has {desc}" for name, desc in bad.items()) or "another rank's inputs are non-finite"
        self._fail_or_skip(what, applied=False)
        raise SkipStep(what)

    def after_step(self, metrics: Mapping[str, float | None] | None, skipped_inputs: str | None = None) -> bool:
        """Judge a finished step (`metrics` None with `skipped_inputs` when check_inputs skipped it).
        Returns True when the step counts as skipped (keep its metrics out of the averages)."""
        if skipped_inputs is not None:
            return self._count_skip()
        refused = skipped_updates(metrics or {})
        bad = [k for k in nonfinite_metrics(metrics or {}) if not k.endswith("grad_norm")]
        if not refused and not bad:
            self.in_a_row = 0
            return False
        if refused:
            what = (f"non-finite gradients ({refused:g} optimizer step(s) not applied)"
                    + (f"; non-finite {', '.join(bad)}" if bad else ""))
            self._fail_or_skip(what, applied=False)
            return self._count_skip()
        # finite gradients, but a metric is not: the update was applied; nothing to undo
        self._fail_or_skip(f"non-finite {', '.join(bad)}", applied=True)
        self.in_a_row = 0
        return False

    def _fail_or_skip(self, what: str, *, applied: bool) -> None:
        where = f"step {self.step}: {what}"
        if not applied:
            self.nonfinite = where
        if self.policy == "stop":
            raise NonFiniteError(
                f"{where}; stopped (train.on_nonfinite=stop). The step was "
                + ("applied" if applied else "not applied")
                + "; rerun the same command to resume from the last checkpoint (lower optim.lr or check the data"
                  " and reward sources), or set train.on_nonfinite=skip to skip such steps")
        if applied:
            log.warning(f"{where} (the update's gradients were finite and it was applied)")
        elif self.in_a_row + 1 > self.max_consecutive:
            raise NonFiniteError(
                f"{where}; that is {self.in_a_row + 1} skipped steps in a row > train.max_consecutive_skips="
                f"{self.max_consecutive}: the run is diverging; lower optim.lr, check the data and reward sources, "
                "then rerun to resume from the last checkpoint (or raise train.max_consecutive_skips)")
        else:
            log.warning(f"{where}; skipped the step (weights, optimizer state and schedule unchanged)")

    def _count_skip(self) -> bool:
        self.in_a_row += 1
        self.skipped += 1
        return True


def require_finite_start(metrics: Mapping[str, float | None], models: Mapping[str, str],
                         weights: Iterable[tuple[str, torch.Tensor]] | None, precision: str) -> None:
    """Before the first step: raise ModelError when the trained model's weights hold NaN/Inf or
    the first evaluation has a NaN/Inf metric. `models`: config field -> path of each model the
    evaluation ran, the trained one first; `weights`: the trained model's (name, tensor) pairs
    (None: not held whole by this process, e.g. sharded by ZeRO-3)."""
    damaged = {name: describe_nonfinite(t) for name, t in (weights or ()) if _holds_nonfinite(t)}
    bad = nonfinite_metrics(metrics)
    if not bad and not damaged:
        return
    (field, path), others = next(iter(models.items())), [f"{k}={v}" for k, v in list(models.items())[1:]]
    if damaged:
        named = "; ".join(f"{name} has {what}" for name, what in list(damaged.items())[:3])
        more = f" and {len(damaged) - 3} more tensors" if len(damaged) > 3 else ""
        cause = (f"the weights loaded from {field}={path} hold NaN/Inf ({named}{more}): its files are damaged (a disk "
                 "or copy error can change a file's bytes but not its size, so size checks pass); restore the model "
                 "from a good copy (download or export it again)")
    else:
        looked = "hold no NaN/Inf" if weights is not None else "could not be searched for NaN/Inf in this process"
        fp32 = " (try engine.precision=fp32)" if precision != "fp32" else ""
        also = f", or a damaged {' / '.join(others)}" if others else ""
        cause = (f"the weights of {field}={path} {looked}; likely causes: weights damaged into huge values, or values "
                 f"overflowing engine.precision={precision}{fp32}{also}; check the model files against a good copy")
    when = (f"the first evaluation, before any training step, gave {', '.join(f'{k}={metrics[k]}' for k in bad)}"
            if bad else "before the first training step")
    raise ModelError(f"{when}: {cause}. Training from these weights could only spread the NaN, so the run stops "
                     "before its first step")


def _holds_nonfinite(t: torch.Tensor) -> bool:
    """Whether a weight holds NaN/Inf: its min and max (NaN propagates), without a full-size mask."""
    if not t.is_floating_point() or t.numel() == 0:
        return False
    return not bool(torch.isfinite(torch.stack(torch.aminmax(t.detach()))).all())
