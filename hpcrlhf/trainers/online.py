"""What PPO and rejection sampling share: prompts, a rollout engine, rewards, and evaluation by
greedy generation.

`OnlineTrainer.rollout_step(prompts, params)` is the generate-and-score half of an online step:
`params.n` responses to each of this rank's prompts from the rollout engine, and their scores
from the reward set (with the length, missing-EOS and overlong adjustments). `sync_rollout` puts
the trained policy's weights into the rollout engine before it generates again. With the vLLM
backend on several training ranks, rank 0 runs the engine for everyone
(`engines.rollout.shared.Rank0Rollout`); on Ray the engines are actors of their own
(`trainers.ppo.ray`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import torch

from hpcrlhf.agents.metrics import batch_stats, episode_stats
from hpcrlhf.agents.runner import AgentRunner, AgentSpec
from hpcrlhf.agents.scheduler import BatchStats
from hpcrlhf.config.schema import OnlineJobConfig
from hpcrlhf.config.schema.agent import AgentConfig
from hpcrlhf.data.prompts import Prompt, encode_prompt_rows, episode_rows, load_train_prompts, response_lengths
from hpcrlhf.engines.distributed import all_reduce_sum
from hpcrlhf.engines.rollout import Done, Generation, Pending, SamplingParams, launch
from hpcrlhf.engines.rollout.contract import all_at_once, stamp_version
from hpcrlhf.engines.rollout.hf import HFRollout
from hpcrlhf.engines.rollout.settings import sampling_params, vllm_engine_args
from hpcrlhf.engines.rollout.loop import StreamingRollout
from hpcrlhf.engines.rollout.shared import Rank0Rollout
from hpcrlhf.engines.rollout.vllm import VLLMRollout
from hpcrlhf.errors import ConfigError
from hpcrlhf.logs import get_logger
from hpcrlhf.models.export import checkpoint_stream
from hpcrlhf.models.factory import ModelFactory
from hpcrlhf.rewards.response import Response
from hpcrlhf.rewards.sources import RewardSet, adjust_scores
from hpcrlhf.run.signals import StopRequested
from hpcrlhf.run.stats import Stats
from hpcrlhf.trainers.loop import TrainingLoop, merge_evaluation
from hpcrlhf.trainers.seeds import sampling_seed

log = get_logger()


def flatten_generations(prompts: Sequence[Prompt], generations: list[list[Generation]], tokenizer
                        ) -> tuple[list[Prompt], list[Generation], list[Response]]:
    """Prompt-major flat lists (a prompt's samples consecutive) of prompts, generations and the
    decoded responses the reward sources score (a multi-turn trajectory's: its whole transcript after
    the prompt, with its record)."""
    flat_prompts = [p for p, gens in zip(prompts, generations) for _ in gens]
    flat = [g for gens in generations for g in gens]
    texts = tokenizer.batch_decode([g.response_ids for g in flat], skip_special_tokens=True)
    # a multi-turn trajectory's prompt is the first render of its environment's reset (not a row's tokens)
    responses = [Response(p.text, t, tuple(p.ids or g.prompt_ids) + tuple(g.response_ids), p.row, p.origin, g.episode)
                 for p, g, t in zip(flat_prompts, flat, texts)]
    return flat_prompts, flat, responses


EVAL_AGENT_STATS = ("agent/success", "agent/turns", "agent/tool_calls", "agent/episode_reward", "agent/truncated")
"""What evaluation reports of greedy trajectories (as eval/success, eval/turns, ...)."""


def answer(response: Response) -> str:
    """What a task or metric judges: a multi-turn trajectory's last model turn, else the response."""
    return response.episode.final_text if response.episode is not None else response.text


def judged(responses: Sequence[Response]) -> list[Response]:
    """`responses` as tasks and metrics judge them: a multi-turn trajectory's as its last model turn."""
    return [r if r.episode is None else replace(r, text=answer(r)) for r in responses]


def agent_stats(generations: Sequence[Generation]) -> Stats:
    """The agent/* figures of multi-turn generations (`agents.metrics.episode_stats`)."""
    model = [sum(g.action_mask) for g in generations]
    return episode_stats([g.episode for g in generations], model, [len(g.response_ids) - m for g, m in zip(generations, model)])


def reward_set(cfg: OnlineJobConfig, models: ModelFactory, task,
               served: Mapping[int, tuple[Sequence[str], str]] | None = None) -> RewardSet:
    """The job's reward sources: reward models built by `models`, rules, the task, and the sources its
    own reward servers serve (`served`: source index -> (their URLs, the token))."""
    return RewardSet(cfg.reward, lambda path, field: models.build_frozen_model(path, value_head=True, key=field),
                     models.tokenizer, task, models.device, cfg.model.trust_remote_code, cfg.rules, served)


def stream_weights(engine, rollout, bucket_bytes: int, version: int | None = None) -> dict[str, float] | None:
    """The trained `engine`'s weights -- policy `version` (updates done), where known -- into a vLLM
    `rollout` engine in this process (or rank 0's), streamed in buckets of `bucket_bytes` (every rank
    takes part: ZeRO-3 gathers): what was sent (`weight_sync/*`), where this rank sends."""
    sent = rollout.load_weights(checkpoint_stream(engine, bucket_bytes), version)
    return None if sent is None else {"weight_sync/bytes": float(sent.bytes), "weight_sync/buckets": float(sent.buckets)}


def rollout_engines(engine, models: ModelFactory, cfg: OnlineJobConfig):
    """(the rollout engine, the trained module of `engine` as a generator): the same object
    with rollout.backend hf; with vllm, an engine on rank 0 serving every rank -- an engine loop
    (`StreamingRollout`) with rollout.max_staleness >= 1 or rollout.min_engine_step_s (an agent section's
    trajectories run on it too)."""
    env = models.env
    synced = engine.zero_stage == 3 and env.world_size > 1
    hf = HFRollout(engine.module, pad_token_id=models.pad_id, eos_token_id=models.tokenizer.eos_token_id,
                   device=engine.device, synced_gpus=synced, batch_size=cfg.rollout.hf_batch_size)
    if cfg.rollout.backend == "hf":
        return hf, hf
    streaming = bool(cfg.rollout.max_staleness or cfg.rollout.min_engine_step_s)  # (a floor needs the loop)
    if not env.is_main:
        vllm = None
    elif streaming:  # generated in a thread of its own while the step trains (rollout.partial: paused across syncs)
        vllm = StreamingRollout(lambda: VLLMRollout(**vllm_engine_args(cfg)), partial=cfg.rollout.partial,
                                min_step_s=cfg.rollout.min_engine_step_s)
    else:
        vllm = VLLMRollout(**vllm_engine_args(cfg))
    return (vllm if env.world_size == 1 else Rank0Rollout(vllm, env, streaming=streaming)), hf


@dataclass(frozen=True)
class LaunchedRollout:
    """Generations asked for (`OnlineTrainer.launch_rollout`), not yet scored."""

    prompts: list[Prompt]
    params: SamplingParams
    pending: Pending
    figures: Callable[[], Stats] | None = None
    """Multi-turn rollouts: what gives the scheduling figures of the batch (`agents.metrics.batch_stats`)
    once `pending` is done."""
    version: int | None = None
    """The policy version (updates done) the engines held at the launch: each generation's, where its
    engine recorded none (`stamp_version`, when the batch is scored)."""

    def agent_batch(self) -> Stats | None:
        """Multi-turn rollouts: the batch's scheduling figures (waits for its generations); else None."""
        if self.figures is None:
            return None
        self.pending.result()
        return self.figures()


@dataclass
class Rollout:
    """One step's generations on this rank, flattened prompt-major (the n samples of a prompt
    are consecutive), with their scores."""

    prompts: list[Prompt]
    generations: list[Generation]
    responses: list[Response]
    scores: torch.Tensor | None
    """Combined score after penalties (B,)."""
    parts: dict[str, torch.Tensor]
    """Each reward source's values (B,)."""
    sources: torch.Tensor | None = None
    """The weighted sum of the reward sources, before the penalties (B,)."""
    agent_batch: Stats | None = None
    """Multi-turn rollouts: the scheduling figures of the batch (`agents.metrics.batch_stats`)."""

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(g.response_ids) for g in self.generations])

    @property
    def finished(self) -> torch.Tensor:
        return torch.tensor([g.finished for g in self.generations])


class OnlineTrainer(TrainingLoop):
    """Base of trainers that learn from their own generations. A subclass sets up the rollout
    engines (`rollout`; `hf_rollout`, the trained module as a generator where this process holds
    it) and the reward sources (`rewards`), and says how the trained policy's weights reach the
    rollout engine (`send_policy_weights`)."""

    rollout: Any
    """The engine that generates rollouts (`engines.rollout` protocol)."""
    hf_rollout: Any
    """The trained policy module as a generator (always in sync), or None where it runs elsewhere."""
    rewards: Any
    """The reward sources (`RewardSet` protocol: names, score)."""
    rollout_synced: bool
    """Whether the rollout engine holds the trained policy's current weights."""
    sync_metrics: dict[str, float] = {}
    """What the last weight sync moved (`weight_sync/bytes`, ...), where the sync path measures it."""
    agent: AgentRunner | None = None
    """Multi-turn rollouts: the agent section's environment, tools and parser (`setup_online`)."""
    agent_spec: AgentSpec | None = None
    """What builds the same agent in a Ray engine actor (`EngineFleet.launch_episodes`)."""

    def setup_online(self) -> None:
        """Training prompts and the held-out prompts `setup` read, as token ids; call after `setup`."""
        cfg = self.cfg
        self.prompts = load_train_prompts(cfg, self.tokenizer)
        rows, key = self.held_out
        agent = cfg.multi_turn()
        self.eval_prompts = (encode_prompt_rows(rows, cfg.data, self.tokenizer, key) if agent is None
                             else episode_rows(rows, key))
        for prompts, field, tokens in ((self.prompts, "rollout.max_new_tokens", cfg.rollout.max_new_tokens),
                                       (self.eval_prompts, "eval.max_new_tokens", cfg.eval.max_new_tokens)):
            self.window.require_prompts_fit(((len(p.ids), p.origin) for p in prompts), field, tokens)
        if cfg.rollout.length_key:  # every row's, before any step
            response_lengths(self.prompts, cfg.rollout.length_key, cfg.rollout.max_new_tokens)
        if cfg.rollout.backend == "vllm" and cfg.lora.rank:
            raise ConfigError("rollout.backend: vllm with lora.rank > 0 is not supported yet (the engine needs merged "
                              "weights after every update); use rollout.backend=hf with LoRA")
        self.agent = self._agent_runner(agent) if agent is not None else None

    def _agent_runner(self, agent: AgentConfig) -> AgentRunner:
        """The agent section's environment, tools and parser, loaded and checked before any step."""
        cfg = self.cfg
        if self.env.world_size > 1 and cfg.engine.zero_stage == 3 and cfg.rollout.backend == "hf":
            raise ConfigError(f"agent: with rollout.backend hf and engine.zero_stage 3 over {self.env.world_size} "
                              "ranks every rank generates in lockstep (ZeRO-3 gathers each layer from all of them), "
                              "which trajectories of different lengths cannot keep: use rollout.backend=vllm (one "
                              "engine runs every rank's trajectories), engine.zero_stage=2, or one rank")
        self.agent_spec = AgentSpec(agent, cfg.model.path, cfg.data.apply_chat_template, cfg.data.prompt_key,
                                    cfg.data.max_length, cfg.model.trust_remote_code)
        return AgentRunner(agent, self.tokenizer, chat=cfg.data.apply_chat_template, prompt_key=cfg.data.prompt_key,
                           max_prompt_tokens=cfg.data.max_length)

    def evaluated_models(self) -> dict[str, str]:
        return {**super().evaluated_models(), **{f"reward.sources[{i}].model": s.model
                                                 for i, s in enumerate(self.cfg.reward.sources) if s.model}}

    def sync_rollout(self) -> None:
        """Put the trained policy's weights into the rollout engine (nothing to do when it generates
        with the trained module itself)."""
        if self.rollout is not self.hf_rollout:
            self.sync_metrics = self.send_policy_weights() or self.sync_metrics
        self.rollout_synced = True

    def send_policy_weights(self) -> dict[str, float] | None:
        """The trained policy's weights into `rollout`: what was sent (`weight_sync/*`) where measured."""
        raise NotImplementedError

    def sampling(self, step: int, n: int, round: int = 0) -> SamplingParams:
        return sampling_params(self.cfg.rollout, n=n, seed=sampling_seed(self.cfg.seed, step, self.env.rank, round))

    def rollout_step(self, prompts: Sequence[Prompt], params: SamplingParams, version: int) -> Rollout:
        """Generate `params.n` responses per prompt and score them."""
        return self.score_rollout(self.launch_rollout(prompts, params, version))

    def with_lengths(self, prompts: Sequence[Prompt], params: SamplingParams) -> SamplingParams:
        """`params` with each prompt's response length from its row where rollout.length_key names one (a
        benchmark's long-tail lengths); else as they are."""
        key = self.cfg.rollout.length_key
        return replace(params, lengths=response_lengths(prompts, key, params.max_new_tokens)) if key else params

    def launch_rollout(self, prompts: Sequence[Prompt], params: SamplingParams, version: int) -> LaunchedRollout:
        """Start generating `params.n` responses per prompt (under way when this returns on engines
        that run elsewhere, done on the others) with the policy after `version` updates (the engines'
        weights, synced first): `score_rollout` collects and scores them."""
        if not self.rollout_synced:
            self.sync_rollout()
        self.ready_to_generate()
        params = self.with_lengths(prompts, params)
        with self.run.timed("generate"):
            if self.agent is None:
                return LaunchedRollout(list(prompts), params, launch(self.rollout, [list(p.ids) for p in prompts], params),
                                       version=version)
            return LaunchedRollout(list(prompts), params, *self._launch_episodes(self.rollout, prompts, params),
                                   version=version)

    def _launch_episodes(self, engine, prompts: Sequence[Prompt], params: SamplingParams
                         ) -> tuple[Pending, Callable[[], Stats]]:
        """Start `params.n` trajectories of each prompt's row on `engine` (the environments seeded by
        the step's sampling seed and the row's place in the batch): (the batch, under way on engines
        that run elsewhere -- Ray engine actors, each running its part beside its engine -- else run
        to its end here; what gives its scheduling figures once it is done)."""
        rows, origins = [p.row for p in prompts], [p.origin for p in prompts]
        trajectories = len(prompts) * params.n
        batch = None  # under way beside the step: on Ray engine actors, or on this process's engine loop
        if hasattr(engine, "launch_episodes"):
            batch = engine.launch_episodes(rows, params, origins, params.seed, self.agent_spec)
        elif isinstance(engine, StreamingRollout):
            batch = self.agent.launch(engine, rows, params, params.seed, origins)
        if batch is not None:
            return batch, lambda: batch_stats(batch.stats(), trajectories)
        if hasattr(engine, "run_episodes"):  # one engine on rank 0 for every rank: its environments run there
            generations, stats = engine.run_episodes(self.agent, rows, params, params.seed, origins)
            stats = stats or BatchStats()  # the batch's figures are rank 0's
        else:
            generations, stats = self.agent.run(engine, rows, params, env_seed=params.seed, origins=origins)
        figures = batch_stats(stats, trajectories)
        return Done(generations), lambda: figures

    def ready_to_generate(self) -> None:
        """Make the rollout engine ready to generate (PPO: the roles' generate phase)."""

    def score_rollout(self, launched: LaunchedRollout) -> Rollout:
        """The launched generations (waited for) and their scores. A stop request during either
        abandons the step (`Run.stoppable`): what was cut short is never learned from."""
        with self.run.stoppable():
            rollout, total = self._score_parts(launched)
        rollout.sources = total
        rollout.agent_batch = launched.agent_batch()
        rollout.scores = adjust_scores(total, rollout.lengths, rollout.finished, self.cfg.reward,
                                       launched.params.max_new_tokens)
        # before anything learns from them; every rank decides alike
        self.guard.check_inputs({**{f"reward/{name}": v for name, v in rollout.parts.items()}, "rollout/score": rollout.scores},
                                all_ranks=lambda flag: all_reduce_sum([flag])[0])
        return rollout

    def scores_as_finished(self) -> bool:
        """Whether the groups are scored as they finish (reward.overlap): not where every rank must score at
        once -- a reward model's forwards under ZeRO-3 over several ranks gather its layers from all of them, and
        with several ranks the groups come in lots of any size per rank (`Rank0Batch.as_finished`)."""
        collective = self.env.world_size > 1 and self.cfg.engine.zero_stage == 3 and self.rewards.has_models
        return self.cfg.reward.overlap and not collective

    def _score_parts(self, launched: LaunchedRollout) -> tuple[Rollout, torch.Tensor]:
        """(the rollout in prompt order, its summed scores): the prompts' groups scored as they finish
        (`reward.overlap`), else all at once. Waiting for groups counts as `timing/generate`; the
        scoring done before the last group arrived as `timing/reward_overlap`, the rest as
        `timing/reward`."""
        pending, prompts, scored, calls = launched.pending, launched.prompts, [], []
        lots = self.scores_as_finished()
        items = pending.as_finished() if lots else all_at_once(pending)
        while True:
            with self.run.timed("generate"):
                groups = next(items, None)
            if groups is None:
                break
            began = arrived = time.monotonic()
            if launched.version is not None:
                stamp_version((g for _, gens in groups for g in gens), launched.version)
            flat = flatten_generations([prompts[i] for i, _ in groups], [g for _, g in groups], self.tokenizer)
            rows = [i for i, generations in groups for _ in generations]  # each row's prompt
            try:
                with self.run.watched("reward"):  # (its own deadline: timed below, with the overlap told apart)
                    scored.append((rows, flat, *self.rewards.score(flat[2])))
            except StopRequested:  # a user's rule was cut short: the batch hears it (rank 0's lots walked to their end)
                items.throw(StopRequested)
                raise
            calls.append((began, time.monotonic()))
        # generation ended by the time the last group arrived here (a done-callback may note it later)
        generated = min(pending.finished() or arrived, arrived)
        hidden = sum(max(0.0, min(end, generated) - began) for began, end in calls)
        self.run.add_timing("reward", sum(end - began for began, end in calls) - hidden)
        self.run.add_timing("reward_overlap", hidden)
        # prompt-major again (a prompt's samples stay in their order: the sort is stable)
        prompt_of = [i for rows, *_ in scored for i in rows]
        order = sorted(range(len(prompt_of)), key=prompt_of.__getitem__)
        lists = [[x for _, flat, _, _ in scored for x in flat[k]] for k in range(3)]
        index = torch.tensor(order)
        values = {name: torch.cat([v[name] for *_, v in scored])[index] for name in scored[0][3]}
        return (Rollout(*([column[r] for r in order] for column in lists), None, values),
                torch.cat([total for _, _, total, _ in scored])[index])

    def rollout_stats(self, rollout: Rollout) -> Stats:
        n = len(rollout.generations)
        stats: Stats = {"rollout/score": (float(rollout.scores.sum()), n),
                        "rollout/response_length": (float(rollout.lengths.sum()), n),
                        "rollout/finished": (float(rollout.finished.sum()), n)}
        for name, values in rollout.parts.items():
            stats[f"reward/{name}"] = (float(values.sum()), n)
        if self.task is not None:
            stats["rollout/task_score"] = (sum(self.task.score(r.prompt, answer(r)) for r in rollout.responses), n)
        if self.agent is not None:
            stats.update(agent_stats(rollout.generations))
            stats.update(rollout.agent_batch or {})
        return stats

    def greedy_rollout(self):
        """The engine evaluation generates with: the trained module itself (always in sync)."""
        return self.hf_rollout

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy (or sampled: `eval.samples_per_prompt`, `eval.temperature`) responses to the held-out prompts:
        reward, length, task score and `eval.metrics` (with several samples, pass@k and maj@n too)."""
        params = self.eval_params(self.cfg.eval.max_new_tokens)
        engine = self.greedy_rollout()

        if self.agent is not None:  # a model turn is as long as in the rollouts; the environments seeded alike
            params = replace(self.eval_params(self.cfg.rollout.max_new_tokens), seed=params.seed or self.cfg.seed)

        def stats(batch: list[Prompt]) -> Stats:
            with self.run.stoppable():
                gens = (self._launch_episodes(engine, batch, params)[0].result() if self.agent is not None
                        else engine.generate([list(p.ids) for p in batch], params))
                _, flat, responses = flatten_generations(batch, gens, self.tokenizer)
                total, _ = self.rewards.score(responses)
                metrics = self.metrics.stats(judged(responses), sampling=self.eval_sampling)
            n = len(flat)  # means over every sample
            out = {"eval/reward": (float(total.sum()), n),
                   "eval/response_length": (float(sum(len(g.response_ids) for g in flat)), n)}
            if self.agent is not None:
                out.update({"eval/" + k.removeprefix("agent/"): v for k, v in agent_stats(flat).items()
                            if k in EVAL_AGENT_STATS})
            return merge_evaluation(out, metrics)

        return self.eval_means(self.eval_prompts, stats) if self.eval_prompts else {}
