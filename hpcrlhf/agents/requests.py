"""Rollout engines one model turn at a time: the request-level protocol the agent scheduler drives
(`hpcrlhf.agents.scheduler.RequestEngine`), on each rollout backend.

- `VLLMRequests`: each turn is a sample of a `VLLMStream` (a vLLM request of its own), and `step` is one
  iteration of the engine (`llm_engine.step()`): continuous batching admits a trajectory's next turn at
  the next iteration, while the others go on generating. Never stepped with nothing under way (vLLM's
  step would then wait forever for output).
- `HFRequests`: Hugging Face `generate` runs a whole batch at once, so `step` generates every turn
  submitted since the last (`synchronous`: the scheduler runs such an engine turn by turn).
"""

from __future__ import annotations

from dataclasses import replace

from hpcrlhf.agents.scheduler import TurnOutput, TurnRequest
from hpcrlhf.engines.rollout.contract import SamplingParams
from hpcrlhf.engines.rollout.streaming import VLLMStream
from hpcrlhf.engines.rollout.vllm import VLLMRollout


class VLLMRequests:
    synchronous = False

    def __init__(self, rollout: VLLMRollout, params: SamplingParams) -> None:
        self.stream = VLLMStream(rollout, replace(params, n=1), partial=False)

    def submit(self, request: TurnRequest) -> None:
        self.stream.submit(request.key, request.prompt_ids, request.seed, max_new_tokens=request.max_new_tokens)

    def step(self) -> list[TurnOutput]:
        return [TurnOutput(key, g.response_ids, g.logprobs, g.finished) for key, g in self.stream.step()]

    def running(self) -> int:
        return self.stream.running()

    def abort(self, keys: list[str]) -> None:
        self.stream.abort(keys)


class HFRequests:
    """Turns generated together by an HFRollout (or any engine with `generate`): one call per step,
    seeded by the first request's seed (the scheduler's seeds are per trajectory and turn, so a
    round's seed is as reproducible as its members')."""

    synchronous = True

    def __init__(self, rollout, params: SamplingParams) -> None:
        self.rollout, self.params = rollout, replace(params, n=1)
        self.waiting: list[TurnRequest] = []

    def submit(self, request: TurnRequest) -> None:
        self.waiting.append(request)

    def step(self) -> list[TurnOutput]:
        # in key order: the environments answer in any order, the batch (and so its samples) must not
        batch, self.waiting = sorted(self.waiting, key=lambda r: r.key), []
        if not batch:
            return []
        out = []
        # one generate per token limit (a turn may have less room left than max_new_tokens)
        for limit in sorted({r.max_new_tokens for r in batch}):
            group = [r for r in batch if r.max_new_tokens == limit]
            params = replace(self.params, max_new_tokens=limit, min_new_tokens=min(self.params.min_new_tokens, limit),
                             seed=group[0].seed)
            for r, (g,) in zip(group, self.rollout.generate([r.prompt_ids for r in group], params)):
                out.append(TurnOutput(r.key, g.response_ids, g.logprobs, g.finished))
        return out

    def running(self) -> int:
        return len(self.waiting)

    def abort(self, keys: list[str]) -> None:
        self.waiting = [r for r in self.waiting if r.key not in set(keys)]
