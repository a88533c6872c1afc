"""Evaluation of several sampled answers per prompt (`eval.samples_per_prompt` > 1): each metric's
mean over the samples (mean@n), pass@k and the majority vote's value (maj@n), from the values the
metrics gave every sample (`EvalMetrics.values`). The maths is `hpcrlhf.algos.pass_at_k`.

Responses come prompt-major, `n` consecutive samples per prompt (`trainers.online.flatten_generations`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hpcrlhf.algos.pass_at_k import majority, pass_at_k
from hpcrlhf.config.schema.rules import RulesConfig
from hpcrlhf.config.schema.sections import EvalConfig
from hpcrlhf.rewards.math_answers import final_answer, last_number


@dataclass(frozen=True)
class Sampling:
    n: int
    """Samples per prompt."""
    ks: tuple[int, ...]
    """The k of pass@k."""
    threshold: float
    """A sample counts as correct when its value reaches this."""
    answer: Callable[[str], str | None] | None
    """A sample's answer for the majority vote (None: no maj@n)."""


def sampling_for(cfg: EvalConfig, rules: RulesConfig, task) -> Sampling | None:
    """How `cfg` asks several samples per prompt to be judged (None with one sample per prompt)."""
    if cfg.samples_per_prompt == 1:
        return None
    vote = cfg.vote
    if vote == "auto":
        vote = rules.math.extract if "math" in cfg.metrics else "last_number" if task is not None else "none"
    answer = None if vote == "none" else last_number if vote == "last_number" else (lambda text: final_answer(text, "boxed"))
    return Sampling(cfg.samples_per_prompt, cfg.ks, cfg.pass_threshold, answer)


def sampled_stats(values: Mapping[str, Sequence[float]], texts: Sequence[str], sampling: Sampling,
                  suffix: str = "") -> dict[str, tuple[float, float]]:
    """{key: (sum, count)} of every metric in `values` (one value per sample, prompt-major; `texts`
    the samples' answers): `eval/<m><suffix>` summed over samples, `eval/<m><suffix>/pass@k` and
    `/maj@n` over prompts."""
    n = sampling.n
    if len(texts) % n:
        raise ValueError(f"{len(texts)} samples are no whole number of prompts of {n} samples each")
    prompts = len(texts) // n
    votes = [majority([sampling.answer(t) for t in texts[p * n:(p + 1) * n]]) if sampling.answer else None
             for p in range(prompts)]
    out: dict[str, tuple[float, float]] = {}
    for name, v in values.items():
        key = f"eval/{name}{suffix}"
        out[key] = (float(sum(v)), float(len(v)))
        correct = [sum(x >= sampling.threshold for x in v[p * n:(p + 1) * n]) for p in range(prompts)]
        for k in sampling.ks:
            out[f"{key}/pass@{k}"] = (sum(pass_at_k(n, c, k) for c in correct), float(prompts))
        if sampling.answer is not None:
            out[f"{key}/maj@{n}"] = (float(sum(v[p * n + i] for p, i in enumerate(votes) if i is not None)),
                                     float(prompts))
    return out
