"""What a rollout engine takes and returns, whichever backend: `SamplingParams` in, one list of
`Generation`s per prompt out; `launch` starts a batch (`Pending`) on engines that run elsewhere.
Checkpoints pickle `Generation`s (the rollout generated ahead, `ahead_rank*.pt`): those written
when it was `hpcrlhf.engines.rollout.Generation` load through the package's name for it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

BACKENDS = ("hf", "vllm")

ENGINE_MEMORY = ("weights", "kv_cache")
"""The memory an engine releases when it sleeps and takes back when it wakes (vLLM's sleep-mode
tags), in the order they are woken."""


@dataclass(frozen=True)
class SamplingParams:
    """How responses are drawn; backend-neutral (each engine maps it to its own options)."""

    n: int = 1
    """Responses per prompt."""
    temperature: float = 1.0
    """Softmax temperature for sampling (> 0; ignored when `greedy`)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with this much probability; 1 = off."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = off."""
    max_new_tokens: int = 8
    """Longest response, EOS included."""
    min_new_tokens: int = 0
    """EOS is not generated before this many tokens (benchmarks set it to `max_new_tokens`:
    every response then has exactly that length)."""
    greedy: bool = False
    """Argmax decoding. With n > 1 every sample of a prompt is the same greedy response
    (computed once, returned n times)."""
    seed: int | None = None
    """Makes sampling reproducible: same seed, weights, prompts and params give the same
    responses. None draws from the engine's own random stream."""
    first_index: int = 0
    """Position of this call's first prompt in the caller's whole batch. vLLM seeds prompt i by
    (seed, first_index + i), so a batch split over several engines samples exactly as one
    engine given the whole batch would."""
    lengths: tuple[int, ...] | None = None
    """A benchmark's fixed response lengths, one per prompt of the call (`rollout.length_key`): prompt i's
    samples have exactly `lengths[i]` tokens (EOS suppressed until then, cut there). vLLM engines only."""

    def at(self, i: int) -> SamplingParams:
        """Prompt i's params: with `lengths`, its own length as its limit and minimum."""
        if self.lengths is None:
            return self
        return replace(self, max_new_tokens=self.lengths[i], min_new_tokens=self.lengths[i], lengths=None)

    def part(self, a: int, b: int) -> SamplingParams:
        """The params of prompts a..b-1 of this call, sent as a call of their own (`first_index` moved on)."""
        return replace(self, first_index=self.first_index + a,
                       lengths=None if self.lengths is None else self.lengths[a:b])

    def __post_init__(self) -> None:
        problems = []
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            problems.append(f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            problems.append(f"temperature must be > 0 when sampling (greedy=True for argmax), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.lengths is not None and not all(1 <= n <= self.max_new_tokens for n in self.lengths):
            problems.append(f"lengths must be in [1, max_new_tokens={self.max_new_tokens}], got "
                            f"{sorted(set(self.lengths))[:5]}")
        if problems:
            raise ValueError("SamplingParams: " + "; ".join(problems))


@dataclass
class Generation:
    """One response to one prompt."""

    prompt_ids: list[int]
    response_ids: list[int]
    """Generated tokens, EOS included when the model produced it; never padding."""
    logprobs: list[float]
    """log p(token | context) of each response token under the model's unmodified distribution
    (softmax of the raw logits: temperature 1, no top-p/top-k), fp32; len == len(response_ids)."""
    finished: bool
    """True if the response ended with EOS, False if it was cut at max_new_tokens."""
    action_mask: list[bool] | None = None
    """A multi-turn trajectory's: True at the model's tokens, False at the environment's (which
    the loss, the values and the advantages leave out; their log-probs are 0.0). None: every
    response token is the model's."""
    episode: Any = None
    """A multi-turn trajectory's `hpcrlhf.agents.record.EpisodeRecord`: how it ended, its turns,
    rewards and tool calls. (These three default at class level: generations pickled before load.)"""
    versions: list[tuple[int, int]] | None = None
    """The policy versions (updates done) that sampled the response: (first response index, version)
    per span, in order -- one span, (0, v), unless the generation was paused across a weight sync and
    continued. None: not recorded (the trainer stamps its batch's launch version: `stamp_version`)."""


def head_version(g: Generation) -> int:
    """The version of the response's first token: a sample's age is that of its oldest token."""
    if not g.versions:
        raise ValueError("the generation's versions were not recorded")
    return g.versions[0][1]


def token_versions(g: Generation) -> list[int]:
    """The version of each response token (an environment's tokens: that of the span they lie in)."""
    if not g.versions or g.versions[0][0] != 0:
        raise ValueError(f"versions must start at response index 0, got {g.versions!r}")
    bounds = [start for start, _ in g.versions[1:]] + [len(g.response_ids)]
    out: list[int] = []
    for (start, version), end in zip(g.versions, bounds):
        if not start <= end <= len(g.response_ids):
            raise ValueError(f"versions {g.versions!r} do not split the {len(g.response_ids)} response tokens in order")
        out += [version] * (end - start)
    return out


def stamp_version(generations: Iterable[Generation], version: int) -> None:
    """Record `version` as the one span of each generation whose engine recorded none."""
    for g in generations:
        if g.versions is None:
            g.versions = [(0, version)]


Groups = list[tuple[int, list[Generation]]]
"""Finished prompts of a batch: (the prompt's index in the batch, its n generations) each."""


class RolloutEngine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        """`params.n` generations per prompt: result[i][j] is sample j of prompts[i]."""
        ...

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Replace the engine's weights by the causal LM's full weights in checkpoint names
        (`models.export.checkpoint_names`): a state dict, or (name, tensor) pairs that may be
        streamed (each pair is used before the next is asked for)."""
        ...

    def close(self) -> None:
        """Free the engine's resources (processes, memory)."""
        ...


class Pending(Protocol):
    """A batch of generations under way (`launch`)."""

    launched: float
    """time.monotonic() when it was handed to the engine."""

    def result(self) -> list[list[Generation]]:
        """The generations, once done (waits)."""
        ...

    def finished(self) -> float | None:
        """time.monotonic() when the last of it was done; None while it is still under way."""
        ...

    def as_finished(self) -> Iterator[Groups]:
        """The prompts' groups as they finish: each item holds those finished since the last one
        (at once those already done), every prompt once over all calls, in any order; `result()`
        then waits no more."""
        ...


class EndCallbacks:
    """What a batch under way calls once it ends (its `add_done_callback`, which a `Pending` may offer so that a
    caller learns of each end in O(1)): `add(fn)` before the end queues fn, after it calls fn at once; the batch's
    owner calls `fire()` once it ended (on whatever thread saw the end; again: nothing)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[Callable[[], None]] | None = []
        """None once fired."""

    def add(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._waiting is not None:
                self._waiting.append(fn)
                return
        fn()

    def fire(self) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting or [], None
        for fn in waiting:
            fn()


class Done:
    """A batch generated at launch (engines that generate in the caller: nothing runs meanwhile)."""

    def __init__(self, generations: list[list[Generation]]) -> None:
        self.generations, self.launched, self._given = generations, time.monotonic(), False

    def result(self) -> list[list[Generation]]:
        return self.generations

    def finished(self) -> float:
        return self.launched

    def as_finished(self) -> Iterator[Groups]:
        if not self._given:
            self._given = True
            yield list(enumerate(self.generations))


def all_at_once(pending: Pending) -> Iterator[Groups]:
    """A batch's groups as one item, once all of it is generated (`Pending.as_finished` of a batch that cannot
    give its groups earlier, or a caller that wants them whole)."""
    yield list(enumerate(pending.result()))


def launch(engine, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Pending:
    """Start generating: on an engine that runs elsewhere (`launch` method: Ray engine actors) the
    batch is under way when this returns; any other engine generates it here and now."""
    if hasattr(engine, "launch"):
        return engine.launch(prompts, params)
    return Done(engine.generate(prompts, params))


def check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"rollout: prompts {empty[:5]} are empty; every prompt needs at least one token")


def greedy_copies(g: Generation, n: int) -> list[Generation]:
    """n copies of one (greedy) generation, each with its own lists so callers may edit one."""
    return [Generation(list(g.prompt_ids), list(g.response_ids), list(g.logprobs), g.finished,
                       versions=None if g.versions is None else list(g.versions)) for _ in range(n)]
