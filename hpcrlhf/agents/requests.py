"""Rollout engines one model turn at a time: the request-level protocol the agent scheduler drives
(`hpcrlhf.agents.scheduler.RequestEngine`), on each rollout backend.

- `VLLMRequests`: each turn is a vLLM request (`LLM.enqueue`), and `step` is one iteration of the
  engine (`llm_engine.step()`): continuous batching admits a trajectory's next turn at the next
  iteration, while the others go on generating. Never stepped with nothing under way (vLLM's step
  would then wait forever for output).
- `HFRequests`: Hugging Face `generate` runs a whole batch at once, so `step` generates every turn
  submitted since the last (`synchronous`: the scheduler runs such an engine turn by turn).
"""

from __future__ import annotations

from dataclasses import replace

from hpcrlhf.agents.scheduler import TurnOutput, TurnRequest
from hpcrlhf.engines.rollout.contract import SamplingParams
from hpcrlhf.engines.rollout.vllm import VLLMRollout, request_number, vllm_sampling


class VLLMRequests:
    synchronous = False

    def __init__(self, rollout: VLLMRollout, params: SamplingParams) -> None:
        engine = rollout.llm.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("VLLMRequests: a batch is already under way on this engine (one at a time)")
        self.rollout, self.params, self.engine = rollout, replace(params, n=1), engine
        self.keys: dict[str, str] = {}
        """vLLM's request number -> the turn's key."""
        self.prompts: dict[str, list[int]] = {}

    def submit(self, request: TurnRequest) -> None:
        sampling = vllm_sampling(self.params, request.seed, n=1, max_tokens=request.max_new_tokens)
        (rid,) = self.rollout.llm.enqueue([{"prompt_token_ids": [int(t) for t in request.prompt_ids]}], [sampling],
                                          use_tqdm=False)
        self.keys[request_number(rid)] = request.key
        self.prompts[request.key] = list(request.prompt_ids)

    def step(self) -> list[TurnOutput]:
        if not self.keys:
            return []
        out = []
        for result in self.engine.step():
            if result.finished:
                key = self.keys.pop(result.request_id)
                (g,) = self.rollout._samples(self.prompts.pop(key), result, self.params)
                out.append(TurnOutput(key, g.response_ids, g.logprobs, g.finished))
        return out

    def running(self) -> int:
        return len(self.keys)

    def abort(self, keys: list[str]) -> None:
        numbers = [n for n, k in self.keys.items() if k in set(keys)]
        if numbers:
            self.engine.abort_request(numbers)
        for n in numbers:
            self.prompts.pop(self.keys.pop(n), None)


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
