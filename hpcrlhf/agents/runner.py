"""A job's agent: the `agent` section's environment, tools, parser and chat renderer, loaded and
checked once, and a batch of prompt rows run as trajectories on a rollout engine.

`AgentRunner.run` is what an online trainer calls where it would call `engine.generate`: each row
(a dataset row as the environment's `reset` reads it) becomes `params.n` trajectories, and the
result has `generate`'s shape -- one list of `n` Generations per row, in row order -- with each
generation's `action_mask` (the model's tokens) and `episode` (its record) set.

Seeds. Turn t of sample j of row i is sampled with `mixed_seed(params.seed, i * n + j, t)`
(`hpcrlhf.agents.scheduler`), so a batch samples the same tokens whatever order its environments
answer in. The environment's `reset(row, seed)` gets one seed per row (`mixed_seed(env_seed, i)`):
the n samples of a group meet the same instance of the task, as a group-relative advantage compares
the model's choices on one problem. `i` counts from `params.first_index`, the rows' place in the
whole batch: a batch split over several engines (Ray) runs the trajectories one engine would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpcrlhf.agents.environments import load_environment
from hpcrlhf.agents.episode import Episode, EpisodeLimits, Setup
from hpcrlhf.agents.parsers import load_parser
from hpcrlhf.agents.pool import EnvPool
from hpcrlhf.agents.render import ChatRenderer
from hpcrlhf.agents.requests import HFRequests, VLLMRequests
from hpcrlhf.agents.scheduler import BatchStats, mixed_seed, run_episodes
from hpcrlhf.agents.tools import load_tools
from hpcrlhf.config.schema.agent import AgentConfig
from hpcrlhf.engines.rollout.contract import EndCallbacks, Generation, Groups, SamplingParams, all_at_once
from hpcrlhf.engines.rollout.loop import LOOP_PARTY, WAIT_S, StreamingRollout
from hpcrlhf.engines.rollout.vllm import VLLMRollout
from hpcrlhf.models.loading import load_tokenizer
from hpcrlhf.run.signals import watched_wait


def request_engine(engine: Any, params: SamplingParams):
    """The request-level face of a rollout engine: vLLM's continuous batching (on an engine loop: its turns
    beside the loop's other samples), else a batch `generate`."""
    if isinstance(engine, StreamingRollout):
        return VLLMRequests.on_loop(engine.loop, params)
    return VLLMRequests.on_engine(engine, params) if isinstance(engine, VLLMRollout) else HFRequests(engine, params)


class AgentRunner:
    def __init__(self, cfg: AgentConfig, tokenizer: Any, *, chat: bool, prompt_key: str = "prompt",
                 max_prompt_tokens: int | None = None) -> None:
        """Load and check what `cfg` names (a ConfigError names the field): before any model is
        loaded, so a mistake costs seconds. `max_prompt_tokens`: the longest first render of a
        trajectory (`data.max_length`); a longer one fails the batch naming its row."""
        self.cfg = cfg
        environment = load_environment(cfg.environment, cfg.environment_args, prompt_key)
        tools = load_tools(cfg.tools)
        parser = load_parser(cfg.tool_parser)
        renderer = ChatRenderer(tokenizer, [t.schema for t in (*tools, *environment.tools)], chat=chat)
        renderer.check()
        limits = EpisodeLimits(max_turns=cfg.max_turns, max_tokens=cfg.max_tokens,
                               max_tool_calls_per_turn=cfg.max_tool_calls_per_turn,
                               max_observation_chars=cfg.max_observation_chars, step_timeout_s=cfg.step_timeout_s,
                               on_env_error=cfg.on_env_error, max_prompt_tokens=max_prompt_tokens)
        self.pool = EnvPool(cfg.env_workers)
        self.setup = Setup(environment, tools, renderer, parser, tokenizer, limits, self.pool)

    def schedule(self, synchronous: bool) -> str:
        """`agent.schedule`, or its default: each trajectory on its own clock where the engine allows."""
        return self.cfg.schedule or ("turn" if synchronous else "trajectory")

    def run(self, engine: Any, rows: Sequence[Mapping[str, Any]], params: SamplingParams, env_seed: int,
            origins: Sequence[str] | None = None, cancelled: Callable[[], bool] | None = None
            ) -> tuple[list[list[Generation]], BatchStats]:
        """`rows` as `params.n` trajectories each on `engine` (an HF or vLLM rollout, or a request-level
        engine): their generations, row-major, and the batch's figures. `origins`: where each row came
        from (`file:line`), for error messages; `cancelled`: see `run_episodes`."""
        n, first = params.n, params.first_index
        requests = engine if hasattr(engine, "submit") else request_engine(engine, params)
        episodes = [Episode(f"{first + i:06d}-{j:04d}", row, mixed_seed(env_seed, first + i), self.setup,
                            origins[i] if origins else f"prompt {first + i}")
                    for i, row in enumerate(rows) for j in range(n)]
        stats = run_episodes(requests, episodes, self.pool, max_new_tokens=params.max_new_tokens, seed=params.seed,
                             schedule=self.schedule(requests.synchronous), max_failed_share=self.cfg.max_failed_share,
                             first=first * n, cancelled=cancelled)
        generations = [ep.generation() for ep in episodes]
        return [generations[i * n:(i + 1) * n] for i in range(len(rows))], stats

    def launch(self, engine: StreamingRollout, rows: Sequence[Mapping[str, Any]], params: SamplingParams,
               env_seed: int, origins: Sequence[str] | None = None) -> EpisodeBatch:
        """As `run` on an engine loop, under way when this returns: a thread of its own schedules the
        trajectories (their environments on this runner's pool) while the caller trains."""
        return EpisodeBatch(lambda cancelled: self.run(engine, rows, params, env_seed, origins, cancelled))

    def close(self) -> None:
        self.pool.close()


class EpisodeBatch:
    """Trajectories under way on an engine loop (`AgentRunner.launch`; a `Pending`): `result()` waits for them
    (watched: a hang names the loop) and raises what their run raised; `cancel()` stops them (`run_episodes`)."""

    def __init__(self, run: Callable[[Callable[[], bool]], tuple[list[list[Generation]], BatchStats]]) -> None:
        """`run(cancelled)`: the trajectories, run on a thread of their own."""
        self.launched = time.monotonic()
        self._out: tuple[list[list[Generation]], BatchStats] | None = None
        self._error: BaseException | None = None
        self._finished: float | None = None
        self._done, self._cancelled = threading.Event(), threading.Event()
        self._on_end = EndCallbacks()
        threading.Thread(target=self._run, args=(run,), name="hpcrlhf-episodes", daemon=True).start()

    def _run(self, run: Callable[[Callable[[], bool]], tuple[list[list[Generation]], BatchStats]]) -> None:
        try:
            self._out = run(self._cancelled.is_set)
        except BaseException as e:  # given to the caller by `result`
            self._error = e
        finally:
            self._finished = time.monotonic()
            self._done.set()
            self._on_end.fire()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call `fn()` once the batch ended (at once if it did; else on the batch's thread)."""
        self._on_end.add(fn)

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop the trajectories (their result is then of no use: the caller drops the batch)."""
        self._cancelled.set()

    def _wait(self) -> tuple[list[list[Generation]], BatchStats]:
        watched_wait(self._done.wait, lambda: [f"the trajectories of an agent batch on {LOOP_PARTY}"], poll_s=WAIT_S)
        if self._error is not None:
            raise self._error
        assert self._out is not None
        return self._out

    def result(self) -> list[list[Generation]]:
        return self._wait()[0]

    def stats(self) -> BatchStats:
        """The batch's scheduling figures (waits for it)."""
        return self._wait()[1]

    def finished(self) -> float | None:
        return self._finished

    def as_finished(self) -> Iterator[Groups]:
        """Every group at once, when the batch is done."""
        return all_at_once(self)


@dataclass(frozen=True)
class AgentSpec:
    """What builds a job's `AgentRunner` in another process (a Ray engine actor, whose environments
    and tools then run beside its engine): the agent section and how the job renders prompts."""

    agent: AgentConfig
    tokenizer: str
    """The tokenizer's folder or name (`model.path`)."""
    chat: bool
    prompt_key: str = "prompt"
    max_prompt_tokens: int | None = None
    trust_remote_code: bool = False

    def runner(self) -> AgentRunner:
        tokenizer = load_tokenizer(self.tokenizer, trust_remote_code=self.trust_remote_code)
        return AgentRunner(self.agent, tokenizer, chat=self.chat, prompt_key=self.prompt_key,
                           max_prompt_tokens=self.max_prompt_tokens)

