"""Bounded staleness (rollout.max_staleness k), in plan order: which steps' rollouts are generated ahead,
and the rollouts generated ahead in a checkpoint.

Step s trains on its planned prompts, generated with the weights of step max(0, s - k) (`ahead_steps`): with
k = 1, step n's rollout is scored, and while the roles make experience and train on it, the engines
already generate step n+1's -- with the weights step n started from, one update behind the weights
that will learn from it; with k = 2 the first step launches steps 1 and 2 as well, and every later step
n launches step n+2's. The new weights go into the engines once what they generate is done
(`PPOTrainer.await_ahead`): each sample of a planned batch is exactly min(s, k) updates old; the samples'
ages (their recorded versions, `Generation.versions`) are logged by `staleness_stats`.

A checkpoint holds the rollouts generated ahead (`save_ahead`), so a run resumed from it -- after a time
limit or a stop signal as well -- scores the samples the run that saved it does: done ones whole (the checkpoint
waits for them), and with rollout.partial on an engine loop those under way as far as they got
(`EngineLoop.suspend`: the checkpoint does not wait for a long tail), to go on in the resumed run.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpcrlhf.engines.rollout import Generation
from hpcrlhf.engines.rollout.contract import head_version, token_versions
from hpcrlhf.run.stats import Stats
from hpcrlhf.trainers.online import LaunchedRollout


def ahead_steps(step: int, total_steps: int, max_staleness: int, launched: Collection[int] = ()) -> list[int]:
    """The steps (0-based) whose rollouts step `step` launches ahead, before it trains: those of the next
    `max_staleness` steps that will run and are not `launched` yet -- at step 0 all of them, later the last."""
    return [s for s in range(step + 1, min(step + max_staleness, total_steps - 1) + 1) if s not in launched]


@dataclass
class Ahead:
    """A rollout generated ahead: for step `step`, launched when `rollout.version` updates were done."""

    step: int
    rollout: LaunchedRollout


def ahead_file(folder: Path, rank: int) -> Path:
    return folder / f"ahead_rank{rank}.pt"


def save_ahead(ahead: Sequence[Ahead], folder: Path, rank: int, under_way: Mapping[int, tuple[int, Any]] = {}) -> None:
    """Into a checkpoint folder: the rollouts generated ahead for the next steps -- `ahead` done (waited for
    here), `under_way` as far as they got (step -> (updates done at its launch, its `BatchState`)) -- so that a
    run resumed there scores the samples this one does."""
    done = [{"step": a.step, "launched_at": a.rollout.version, "generations": a.rollout.pending.result(),
             "agent_batch": a.rollout.agent_batch()} for a in ahead]
    going = [{"step": step, "launched_at": launched_at, "under_way": state, "agent_batch": None}
             for step, (launched_at, state) in under_way.items()]
    if done or going:
        torch.save({"ahead": sorted(done + going, key=lambda a: a["step"])}, ahead_file(folder, rank))


@dataclass
class Saved:
    """A rollout generated ahead as a checkpoint holds it (`load_ahead`): for step `step`, launched after
    `launched_at` updates; done (`generations`, a multi-turn batch's scheduling figures `agent_batch`) or kept
    under way (`under_way`: what its engine's `suspend` gave, for its `relaunch`)."""

    step: int
    launched_at: int
    generations: list[list[Generation]] | None = None
    agent_batch: dict | None = None
    under_way: Any = None


def load_ahead(folder: Path, rank: int) -> list[Saved]:
    """The rollouts `save_ahead` kept in a checkpoint folder; a checkpoint of before max_staleness > 1 holds
    one, launched a step before its own."""
    path = ahead_file(folder, rank)
    if not path.exists():
        return []
    state = torch.load(path, weights_only=False)
    kept = state.get("ahead", [state])
    return [Saved(a["step"], a.get("launched_at", a["step"] - 1), a.get("generations"), a.get("agent_batch"),
                  a.get("under_way")) for a in kept]


def staleness_stats(generations: Sequence[Generation], version: int, k: int) -> Stats:
    """How old the samples trained after `version` updates are (their recorded versions), as (sum, count)
    pairs that add up over ranks: rollout/staleness -- the mean age of a sample, that of its first token (its
    oldest) --, rollout/staleness_tokens -- the mean age of a model token --, and rollout/staleness_share/<a>
    for a = 0..k and `older` (more than k: arrival order with rollout.stale_groups keep, or a run resumed with a
    smaller k, which trains the batches generated ahead under the larger one) -- the share of samples a updates
    old (they sum to 1; the same keys on every rank, whatever its samples) --, and rollout/partial_share --
    the share of samples generated across a weight sync (rollout.partial: more than one version; a trajectory's
    turn paused and continued, or its later turns begun after the sync)."""
    n = len(generations)
    heads = [version - head_version(g) for g in generations]
    if any(a < 0 for a in heads):
        raise ValueError(f"samples of versions after {version} cannot be trained at it: {sorted(set(heads))}")
    tokens = [(version - v) * m for g in generations
              for v, m in zip(token_versions(g), g.action_mask or [True] * len(g.response_ids))]
    model = sum(sum(g.action_mask) if g.action_mask is not None else len(g.response_ids) for g in generations)
    return {"rollout/staleness": (float(sum(heads)), n), "rollout/staleness_tokens": (float(sum(tokens)), model),
            "rollout/partial_share": (float(sum(len(g.versions or ()) > 1 for g in generations)), n),
            **{f"rollout/staleness_share/{a}": (float(heads.count(a)), n) for a in range(k + 1)},
            "rollout/staleness_share/older": (float(sum(a > k for a in heads)), n)}
