"""Samples that outlive a weight update: partial rollouts on vLLM (issue 40, docs/design/streaming-staleness.md 3.5).

`VLLMStream` runs every sample as a vLLM request of its own (`LLMEngine.add_request`, n = 1, each with its own
token limit: an agent's turn has what is left of its trajectory's). With `partial` its new tokens and log-probs
come back after every engine step (`RequestOutputKind.DELTA`), so that nothing a sample has generated is
invisible, and `publish(version, receive)` takes new weights with samples under way -- the abort-and-continue of
the design (without it only a finished sample's output comes back, `FINAL_ONLY`: no cost per step):

1. every running request is aborted (what it sent is kept; a token sampled in the aborting step is lost and
   sampled again);
2. `receive()` loads the new weights (the engine holds no request, so its prefix cache can be dropped:
   `VLLMRollout.receive_weights`);
3. each paused sample goes on as a new request on prompt + its tokens so far, under the new weights: the prefix
   is prefilled again by them, so the continuation is drawn from, and its log-probs are, the new policy's. It
   opens a span (`Generation.versions`: (its first response index, the version)).

A sample never paused is exactly the request `VLLMRollout.generate` would have made for it: sample j of
prompt i is seeded `_prompt_seed(seed, first_index + i) + j` (vLLM's own seeds for the children of an n > 1
request), so a stream without a publish draws what a batch does. A continuation is seeded by the sample's seed
and its segment (`segment_seed`). Greedy samples need no seed.

The stream owns its engine while it runs (one thread; vLLM's engine is not thread-safe): nothing else may
submit to it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from hpcrlhf.engines.rollout.contract import Generation, SamplingParams
from hpcrlhf.engines.rollout.vllm import VLLMRollout, _prompt_seed, request_number, vllm_sampling

T = TypeVar("T")

_REQUEST_IDS = itertools.count(1)
"""Request ids of every stream of this process: never one twice (an aborted request's id stays unused)."""


def segment_seed(seed: int, segment: int) -> int:
    """The seed of segment `segment` (> 0) of a sample seeded `seed`: distinct from every prompt's seed
    (`_prompt_seed` of a negative index, which no prompt has)."""
    return _prompt_seed(seed, -segment)


@dataclass
class StreamSample:
    """One sample of a stream: what it has generated so far, under which versions."""

    key: str
    prompt_ids: list[int]
    seed: int | None
    max_new_tokens: int
    params: SamplingParams
    """How it is sampled (temperature, top-p/k, min_new_tokens; n and seed are the sample's own)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)
    segment: int = 0
    """How many times it was paused and continued."""
    finished: bool = False
    """True once it ended with EOS."""

    def generation(self) -> Generation:
        return Generation(list(self.prompt_ids), list(self.tokens), list(self.logprobs), self.finished,
                          versions=list(self.versions))


class VLLMStream:
    """Samples on `rollout`'s engine, each its own request, sampled as `params` say (`max_new_tokens`,
    `min_new_tokens`, temperature ...; n and the seed are taken per submit, which may bring params of its
    own); `step` gives those that ended. `version`: the policy version the engine holds now; `partial`:
    samples can be paused (`pause`, `publish`)."""

    def __init__(self, rollout: VLLMRollout, params: SamplingParams, version: int = 0, *, partial: bool = True) -> None:
        engine = rollout.llm.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("VLLMStream: requests are already under way on this engine (one owner at a time)")
        self.rollout, self.engine, self.params, self.version = rollout, engine, params, version
        self.partial = partial
        self.samples: dict[str, StreamSample] = {}
        """Every sample not yet given back by `step`, by key."""
        self.requests: dict[str, str] = {}
        """vLLM's request number -> the key of the sample it generates."""
        self.paused: list[str] = []
        self.ended: list[tuple[str, Generation]] = []
        """Samples that ended outside an engine step (no room left for a continuation), for the next `step`."""
        self.reprefilled = 0
        """Tokens of prefixes prefilled again by continuations (what partial rollouts cost)."""

    def submit(self, key: str, prompt_ids: Sequence[int], seed: int | None, max_new_tokens: int | None = None,
               params: SamplingParams | None = None) -> None:
        """Start a sample of `prompt_ids` (`seed`: its own, as `sample_seeds` gives; None: greedy or the
        engine's stream) of at most `max_new_tokens` (None: its params'), sampled as `params` say (None:
        the stream's)."""
        if key in self.samples:
            raise ValueError(f"VLLMStream: sample {key!r} is already under way")
        params = self.params if params is None else params
        most = params.max_new_tokens if max_new_tokens is None else max_new_tokens
        sample = StreamSample(key, [int(t) for t in prompt_ids], seed, most, params)
        self.samples[key] = sample
        self._request(sample)

    def resubmit(self, sample: StreamSample) -> None:
        """Continue a sample paused elsewhere (`pause`, its state kept by a checkpoint) under the version the
        engine holds now, as `resume` would have: its next segment, seeded by its seed and segment."""
        if sample.key in self.samples:
            raise ValueError(f"VLLMStream: sample {sample.key!r} is already under way")
        self.samples[sample.key] = sample
        self._request(sample)

    def submit_batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams, prefix: str = "") -> list[str]:
        """`params.n` samples of each prompt, seeded as `VLLMRollout.generate` seeds them; their keys,
        prompt-major (`prefix` + "i.j")."""
        keys = []
        for i, prompt in enumerate(prompts):
            for j, seed in enumerate(sample_seeds(params, i)):
                keys.append(f"{prefix}{i}.{j}")
                self.submit(keys[-1], prompt, seed, params=params.at(i))
        return keys

    def _request(self, sample: StreamSample) -> None:
        """Send `sample`'s next segment: its prompt and what it has generated, for what is left of its tokens."""
        from vllm.sampling_params import RequestOutputKind  # lazily, as every vLLM import (vllm.py)

        done = len(sample.tokens)
        left = sample.max_new_tokens - done
        if left <= 0:  # cut at its length in the step its request was aborted in
            self.ended.append((sample.key, self.samples.pop(sample.key).generation()))
            return
        seed = sample.seed if sample.segment == 0 or sample.seed is None else segment_seed(sample.seed, sample.segment)
        still = replace(sample.params, min_new_tokens=max(0, sample.params.min_new_tokens - done))
        params = vllm_sampling(still, seed, n=1, max_tokens=left)  # (min_tokens: at most `left`)
        params.output_kind = RequestOutputKind.DELTA if self.partial else RequestOutputKind.FINAL_ONLY
        number = request_number(self.engine.add_request(f"s{next(_REQUEST_IDS)}", {"prompt_token_ids": sample.prompt_ids
                                                                                    + sample.tokens}, params))
        self.requests[number] = sample.key
        if sample.versions and sample.versions[-1][0] == done:  # paused before it sent a token: no span of its own
            sample.versions[-1] = (done, self.version)
        elif not sample.versions or sample.versions[-1][1] != self.version:  # (a pause for a checkpoint: same span)
            sample.versions.append((done, self.version))
        self.reprefilled += done

    def step(self) -> list[tuple[str, Generation]]:
        """One engine step: every running sample's new tokens kept (`partial`; else those of the samples that
        ended, whole); the samples that ended, with their keys (given once: the stream forgets them)."""
        ended, self.ended = self.ended, []
        if not self.requests:
            return ended
        for out in self.engine.step():
            key = self.requests.get(out.request_id)
            if key is None:  # a request aborted by `pause`: its last tokens are sampled again
                continue
            sample, (completion,) = self.samples[key], out.outputs
            tokens = list(completion.token_ids)
            sample.tokens += tokens
            positions = completion.logprobs or []
            if len(positions) != len(tokens):  # vllm_sampling asks for logprobs=0: one position per token
                raise RuntimeError(f"VLLMStream: request {out.request_id} sent {len(tokens)} token(s) with "
                                   f"{len(positions)} log-prob position(s); every token needs its behaviour log-prob")
            sample.logprobs += [float(pos[tok].logprob) for pos, tok in zip(positions, tokens)]
            if out.finished:
                del self.requests[out.request_id]
                sample.finished = completion.finish_reason == "stop"
                ended.append((key, self.samples.pop(key).generation()))
        return ended

    def running(self) -> int:
        """Samples under way in the engine, and those ended for the next `step` (paused ones not counted)."""
        return len(self.requests) + len(self.ended)

    def pause(self) -> int:
        """Abort every running request, keeping what each sample has generated; `resume` continues them.
        Returns how many were paused."""
        if self.requests and not self.partial:
            raise RuntimeError("VLLMStream: samples of a stream without `partial` cannot be paused (their tokens "
                               "come back only when they end)")
        if self.requests:
            self.engine.abort_request(list(self.requests))
        for key in self.requests.values():
            self.samples[key].segment += 1
            self.paused.append(key)
        self.requests.clear()
        return len(self.paused)

    def resume(self) -> None:
        """Continue the paused samples under the version the engine holds now."""
        paused, self.paused = self.paused, []
        for key in paused:
            self._request(self.samples[key])

    def publish(self, version: int, receive: Callable[[], T]) -> T:
        """Take new weights with samples under way: pause them, `receive()` (the weights go into the engine),
        hold `version`, continue them. Returns what `receive` returned."""
        self.pause()
        result = receive()
        self.version = version
        self.resume()
        return result

    def abort(self, keys: Sequence[str]) -> None:
        """Drop these samples (running or paused) for good."""
        drop = set(keys)
        numbers = [n for n, k in self.requests.items() if k in drop]
        if numbers:
            self.engine.abort_request(numbers)
        for n in numbers:
            del self.requests[n]
        self.paused = [k for k in self.paused if k not in drop]
        for key in drop:
            self.samples.pop(key, None)


def sample_seeds(params: SamplingParams, index: int) -> list[int | None]:
    """The seed of each of the `params.n` samples of prompt `index` of a batch: those `VLLMRollout.generate`'s
    request for it gives its children (vLLM seeds child j with the request's seed + j)."""
    if params.greedy or params.seed is None:
        return [None] * params.n
    first = _prompt_seed(params.seed, params.first_index + index)
    return [first + j for j in range(params.n)]
