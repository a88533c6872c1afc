"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO", sec. 3.2): a group whose samples all got the
same score has zero group-relative advantage everywhere, so it only dilutes the step. (DAPO
compares accuracy, not the shaped reward: a group of wrong answers whose overlong penalties differ
teaches nothing about the task, so the comparison is the reward sources' sum before the penalties by
default, `ppo.dynamic_sampling_filter`.) With
`ppo.dynamic_sampling` such groups are dropped and the step is refilled with the groups of
further prompts, generated in further rounds, until it holds rollout.prompts_per_step informative
groups -- or `ppo.dynamic_sampling_max_rounds` rounds ran, after which dropped groups fill the rest
(counted) instead of stopping a long run. The batch shape never changes.

Every rank takes part in every round while any rank still misses groups (a round's generation and
checks are collective on several ranks), and each round's prompts and sampling seeds follow from
(seed, step, round, rank): a resumed step generates exactly what the first attempt did."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from collections.abc import Callable, Sequence

import torch

from hpcrlhf.run.stats import add_stats, new_stats
from hpcrlhf.trainers.online import Rollout

SAME_SCORE_TOL = 1e-6
"""Scores of a group within this of each other count as one score."""


def informative_groups(scores: torch.Tensor, n: int, tol: float = SAME_SCORE_TOL) -> list[bool]:
    """For each group of `n` consecutive samples: whether its scores differ (max - min > tol)."""
    if scores.numel() % n:
        raise ValueError(f"{scores.numel()} scores do not form groups of {n}")
    groups = scores.reshape(-1, n).double()
    return ((groups.max(dim=1).values - groups.min(dim=1).values) > tol).tolist()


def filtered_values(rollout: Rollout, what: str) -> torch.Tensor:
    """What `ppo.dynamic_sampling_filter` compares within each group: "score" (the reward sources'
    weighted sum before the penalties), "shaped" (after them) or one source's values (its metric name)."""
    if what == "score":
        return rollout.sources if rollout.sources is not None else rollout.scores
    if what == "shaped":
        return rollout.scores
    return rollout.parts[what]


def take_groups(rollout: Rollout, groups: Sequence[int], n: int) -> Rollout:
    """The samples of `groups` (group indices, in the order given) of a prompt-major rollout."""
    rows = [g * n + i for g in groups for i in range(n)]
    index = torch.tensor(rows, dtype=torch.long)
    return Rollout([rollout.prompts[r] for r in rows], [rollout.generations[r] for r in rows],
                   [rollout.responses[r] for r in rows], rollout.scores[index],
                   {name: values[index] for name, values in rollout.parts.items()},
                   None if rollout.sources is None else rollout.sources[index])


def join_rollouts(parts: Sequence[Rollout]) -> Rollout:
    """One rollout of `parts` in order (each prompt-major, so the result is too)."""
    names = list(parts[0].parts)
    sources = [r.sources for r in parts]
    return Rollout([p for r in parts for p in r.prompts], [g for r in parts for g in r.generations],
                   [x for r in parts for x in r.responses], torch.cat([r.scores for r in parts]),
                   {name: torch.cat([r.parts[name] for r in parts]) for name in names},
                   None if any(s is None for s in sources) else torch.cat(sources))


@dataclass
class FilledStep:
    rollout: Rollout
    """`quota` groups: informative ones first (in generation order), then any dropped ones needed."""
    rounds: int
    informative_share: float
    """Share of the first round's groups that were informative (how much the task still teaches)."""
    dropped_groups: int
    """Groups generated but left out of the step (uninformative ones, and informative ones beyond
    the quota from the last round)."""
    extra_samples: int
    """Samples generated after the first round."""
    uninformative_kept: int
    """Uninformative groups that filled the step because max_rounds ran out."""
    picks: list[tuple[int, int]]
    """(round, group in its round) of each of the step's groups, in the step's order."""

    def metrics(self, reduce: Callable[[list[float]], list[float]] = lambda values: values) -> dict[str, float]:
        """The step's figures over all ranks (`reduce`: a sum over ranks): counts summed, the share
        averaged; the rounds are every rank's."""
        counts = [float(self.dropped_groups), float(self.extra_samples), float(self.uninformative_kept),
                  self.informative_share, 1.0]
        dropped, extra, kept, share, ranks = reduce(counts)
        return {"rollout/generation_rounds": float(self.rounds), "rollout/informative_share": share / ranks,
                "rollout/dropped_groups": dropped, "rollout/extra_samples": extra, "rollout/uninformative_kept": kept}


def fill_step(generate: Callable[[int], Rollout], n: int, max_rounds: int,
              missing_anywhere: Callable[[int], int] = lambda missing: missing, what: str = "score") -> FilledStep:
    """Generate rounds (`generate(round)` -> a scored, prompt-major rollout of groups of `n`, every
    round as many as the first: the step's quota) until the quota of informative groups (their
    `filtered_values(rollout, what)` differ) is in hand on every rank (`missing_anywhere(missing)`:
    this rank's missing count summed over the ranks) or `max_rounds` ran; returns the step's quota of
    groups."""
    rounds: list[Rollout] = []
    good: list[tuple[int, int]] = []  # (round, group) of each informative group, in generation order
    bad: list[tuple[int, int]] = []
    while True:
        rollout = generate(len(rounds))
        mask = informative_groups(filtered_values(rollout, what), n)
        good += [(len(rounds), g) for g, m in enumerate(mask) if m]
        bad += [(len(rounds), g) for g, m in enumerate(mask) if not m]
        rounds.append(rollout)
        quota = len(rounds[0].generations) // n
        if missing_anywhere(max(quota - len(good), 0)) == 0 or len(rounds) >= max_rounds:
            break
    filler = max(quota - len(good), 0)

    def groups(picks: list[tuple[int, int]]) -> list[Rollout]:
        return [take_groups(rounds[r], [g for rr, g in picks if rr == r], n) for r in sorted({rr for rr, _ in picks})]

    step = join_rollouts(groups(good[:quota]) + groups(bad[:filler]))
    if rounds[0].agent_batch is not None:  # multi-turn: every round's batch ran, whatever groups it gave
        step.agent_batch = dict(functools.reduce(add_stats, (r.agent_batch for r in rounds), new_stats()))
    first_share = sum(1 for r, _ in good if r == 0) / max(quota, 1)
    generated = len(rounds) * quota
    return FilledStep(step, len(rounds), first_share, generated - quota, (generated - quota) * n, filler,
                      good[:quota] + bad[:filler])
