"""Metrics of n sampled answers per prompt: pass@k and the majority vote.

* pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", sec. 2.1): with n
  samples of which c are correct, 1 - C(n - c, k) / C(n, k) is an unbiased estimate of the chance
  that at least one of k samples is correct, for k <= n. Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i)
  in float64 (no large binomials), and exactly 1 when n - c < k.
* The majority vote (maj@n, "self-consistency", Wang et al. 2023): the sample whose answer is the most
  common among the samples that have one; its value is the prompt's maj@n. Answers are compared as
  stripped text (deciding mathematical equivalence between every pair would cost O(n^2) checks).

Pure Python: no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with `c` correct among `n` samples (1 <= k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n correct samples, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority(answers: Sequence[str | None]) -> int | None:
    """Index of the first sample holding the most common answer (None answers abstain; a tie goes to
    the answer seen first), or None when no sample has an answer."""
    stripped = [a.strip() if a is not None else None for a in answers]
    counts = Counter(a for a in stripped if a is not None)
    if not counts:
        return None
    most = max(counts.values())
    return next(i for i, a in enumerate(stripped) if a is not None and counts[a] == most)
