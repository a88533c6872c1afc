"""From a run's per-step metrics to the numbers a benchmark compares (pure functions).

Protocol: the first `warmup` steps are dropped (engine start-up, allocator and kernel warm-up),
every figure is the median over the remaining steps. Phases:

- generate:        rollout engine time (`timing/generate`, and the scoring done while the engines
                   still generated, `timing/reward_overlap`: the generation's wall time)
- make_experience: scoring -- reward models (`timing/reward`) plus the actor, reference and
                   critic forward passes and the advantage maths (`timing/make_experience`)
- train:           wall time of the PPO updates (`timing/train`; actor and critic may overlap)
- weight_sync:     actor weights into the rollout engines (`timing/weight_sync`)
- other:           the rest of the step (metrics, the KL controller, Python)

Idle shares (`util/<role>_idle`, the share of a step a role's workers waited) and the bytes of a
weight sync are reported where the run measures them (Ray runs; the collective sync).

samples/s = samples per step / median step seconds; samples/device/s divides by the devices of
the allocation; tokens/s counts prompt + response tokens; MFU = training FLOPs per step /
(median train seconds x devices x the measured matmul peak of one device).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from hpcrlhf.errors import HpcrlhfError

PHASES = ("generate", "make_experience", "train", "weight_sync", "other")
_PHASE_KEYS = {"generate": ("timing/generate", "timing/generate_ahead_wait", "timing/reward_overlap"),
               "make_experience": ("timing/reward", "timing/make_experience"),
               "train": ("timing/train",), "weight_sync": ("timing/weight_sync",)}


@dataclass(frozen=True)
class Throughput:
    steps: int
    """Measured steps (after warm-up)."""
    step_s: float
    phases_s: dict[str, float]
    samples_per_step: float
    samples_per_s: float
    samples_per_device_s: float
    tokens_per_s: float
    """Prompt + response tokens per second."""
    generated_tokens_per_s: float
    generation_share: float
    train_flops_per_step: float
    mfu: float | None
    """Training-phase model FLOPs utilisation against the measured peak (None: no train time)."""
    idle: dict[str, float] = field(default_factory=dict)
    """Median share of a step each role's workers waited (`util/<role>_idle`; Ray runs measure it)."""
    sync_bytes: float | None = None
    """Median bytes of a weight sync (`weight_sync/bytes`; None where the run does not report it)."""
    overlap_s: float | None = None
    """Median seconds generation ran during the step's training (`timing/overlap`, rollout.max_staleness
    1; None where the run does not overlap). `generate` then counts only the seconds the step waited."""
    staleness: float | None = None
    """Median of the steps' mean sample age in updates (`rollout/staleness`; None: a synchronous run)."""
    partial_share: float | None = None
    """Median share of a step's samples generated across a weight sync (`rollout/partial_share`)."""
    engine_rows: float | None = None
    """Median of the samples under way in a mean engine step (`rollout/engine_rows`, the engine loop's)."""

    def to_dict(self) -> dict:
        return asdict(self)


def step_rows(rows: Sequence[Mapping[str, float]], warmup: int, tail: int = 0) -> list[Mapping[str, float]]:
    """The measured steps: rows that timed a step, in order, minus the first `warmup` and the last `tail`."""
    steps = [r for r in rows if "timing/step" in r]
    if len(steps) <= warmup + tail:
        raise HpcrlhfError(f"the run logged {len(steps)} timed step(s); the protocol drops {warmup} warm-up and {tail} "
                           "tail step(s) and needs at least one more: run more steps")
    return steps[warmup:len(steps) - tail]


def phase_seconds(row: Mapping[str, float]) -> dict[str, float]:
    """One step's seconds per phase; `other` is what the named phases leave of the step."""
    phases = {p: sum(float(row.get(k, 0.0)) for k in keys) for p, keys in _PHASE_KEYS.items()}
    phases["other"] = max(0.0, float(row["timing/step"]) - sum(phases.values()))
    return phases


def summarize(rows: Sequence[Mapping[str, float]], *, warmup: int, samples: int, prompt_tokens: float, devices: int,
              train_flops_per_step: float, peak_flops: float, tail: int = 0) -> Throughput:
    """The throughput figures of one system's run of `samples` PPO samples per step (see the module
    docstring for the definitions; `tail`: steps run after the measured ones, dropped)."""
    measured = step_rows(rows, warmup, tail)

    def median(values: list[float]) -> float:
        return float(statistics.median(values))

    step_s = median([float(r["timing/step"]) for r in measured])
    per_phase = [phase_seconds(r) for r in measured]
    phases = {p: median([ph[p] for ph in per_phase]) for p in PHASES}
    response = median([float(r["rollout/response_length"]) for r in measured])
    train_s = phases["train"]
    return Throughput(
        steps=len(measured), step_s=step_s, phases_s=phases, samples_per_step=samples,
        samples_per_s=samples / step_s, samples_per_device_s=samples / step_s / devices,
        tokens_per_s=samples * (prompt_tokens + response) / step_s, generated_tokens_per_s=samples * response / step_s,
        generation_share=phases["generate"] / step_s, train_flops_per_step=train_flops_per_step,
        mfu=train_flops_per_step / (train_s * devices * peak_flops) if train_s > 0 else None,
        idle={key.removeprefix("util/").removesuffix("_idle"): median([float(r[key]) for r in measured])
              for key in sorted(measured[-1]) if key.startswith("util/") and key.endswith("_idle")
              and all(key in r for r in measured)},
        sync_bytes=median_of(measured, "weight_sync/bytes"), overlap_s=median_of(measured, "timing/overlap"),
        staleness=median_of(measured, "rollout/staleness"), partial_share=median_of(measured, "rollout/partial_share"),
        engine_rows=median_of(measured, "rollout/engine_rows"),
    )


def median_of(rows: Sequence[Mapping[str, float]], key: str) -> float | None:
    """The median of metric `key` over `rows`, or None unless every row has it."""
    if not rows or not all(key in r for r in rows):
        return None
    return float(statistics.median(float(r[key]) for r in rows))
