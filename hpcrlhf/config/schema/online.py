"""The jobs that generate their own data from prompts: the prompt, rollout and reward sections,
`OnlineJobConfig` (what ppo and rs share), rejection sampling (`rs`) and batch generation
(`hpcrlhf generate`). The ppo job: `hpcrlhf.config.schema.ppo`."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Literal
from urllib.parse import urlsplit

from hpcrlhf.config.schema.agent import AgentConfig
from hpcrlhf.config.schema.checks import (PathText, fill_derived, require, require_finite,
                                          require_timeout, shown)
from hpcrlhf.config.schema.sections import (DEFAULT_USER_CODE_TIMEOUT_S, MAX_STEPS, DataSourceConfig, ModelConfig,
                                            OptimConfig, ReferenceConfig, TaskConfig, TrainConfig, TrainJobConfig,
                                            resolved_max_length, resolved_new_tokens)
from hpcrlhf.config.schema.rules import BUILTIN_RULES, RulesConfig, is_user_function, require_metrics
from hpcrlhf.errors import ConfigError

@dataclass(frozen=True)
class PromptDataConfig(DataSourceConfig):
    """Prompts for online training (PPO, rejection sampling) and batch generation: only
    `prompt_key` is read; a row's other fields reach rule-based reward functions."""


@dataclass(frozen=True)
class RolloutConfig:
    backend: Literal["hf", "vllm"] = "hf"
    """Generation engine: `hf` (transformers generate on the trained weights; no extra memory) or
    `vllm` (a vLLM engine, much faster, weights synced from the actor after every update)."""
    prompts_per_step: int = 32
    """Prompts per rollout (one PPO step), over all ranks."""
    samples_per_prompt: int = 4
    """Responses generated per prompt (GRPO/RLOO groups; best-of-n for rejection sampling)."""
    temperature: float = 1.0
    """Sampling temperature (log-probs for the PPO ratio are always recomputed at temperature 1)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest token set with this much probability (1.0: off)."""
    top_k: int = 0
    """Sample among the k most likely tokens (0: off)."""
    max_new_tokens: int | None = None
    """Longest response; responses cut here have no EOS (see reward.missing_eos_penalty). null: the
    bundled task's answer length (8) when the task applies, else 256 (`DEFAULT_NEW_TOKENS`)."""
    min_new_tokens: int = 0
    """EOS is suppressed before this many tokens; `= max_new_tokens` gives fixed-length responses
    (what throughput benchmarks use, so every system generates the same tokens)."""
    hf_batch_size: int = 256
    """hf only: sequences per `generate` call on each rank (DeepSpeed-Chat's
    per_device_generation_batch_size)."""
    vllm_kv_cache_gb: float = 1.0
    """vllm only: KV-cache memory of the engine, in GiB."""
    vllm_enforce_eager: bool | None = None
    """vllm only: skip graph capture / compilation. null: eager on CPU (capture gains nothing there
    and costs minutes at start), CUDA graphs on GPU (without them decoding is launch-bound: ~22 ms
    per token step for 64 sequences of a 0.5B model on an H100, no faster than HF generate)."""
    vllm_max_num_seqs: int | None = None
    """vllm only: most sequences the engine runs at once (vLLM's max_num_seqs; null: vLLM's
    default, 256 per TP rank on CPU, 256-1024 on GPU). Lower it when the KV cache is small."""
    vllm_max_num_batched_tokens: int | None = None
    """vllm only: tokens the engine computes per step (vLLM's max_num_batched_tokens; null: vLLM's
    default, 4096 per TP rank on CPU, 8192-16384 on GPU, raised to the longest sequence without
    chunked prefill)."""
    vllm_chunked_prefill: bool | None = None
    """vllm only: split long prompts over engine steps. null: off on CPU (vLLM 0.32 cannot rewind a
    CPU random generator after a split prompt and dies with seeded sampling; true is refused
    there), vLLM's default (on) on GPU."""
    max_staleness: int = 0
    """ppo only: 0 generates each step's rollout with the weights of the step before (synchronous);
    1 overlaps: the engines generate step n+1's rollout -- with the weights step n starts from, one
    update behind -- while the roles score and train on step n (the Ray runtime's engines then stop
    idling during training; engines that generate in the training process gain nothing but keep
    the same samples); k generates step n's rollout with the weights of step n - k (plan order:
    the first step launches steps 1..k, every later one the step k ahead; 1-4 usual, AReaL uses
    2-8). The PPO ratio is taken against the log-probs of the weights being trained (recomputed),
    `rollout/logprob_max_diff` shows how far the generating weights were; 2 or more needs
    ppo.tis_cap. Checkpoints keep the rollouts generated ahead, so a resumed run (after a stop signal
    too) equals an uninterrupted one. Logged, from the policy version each sample records:
    rollout/staleness (the updates the step's samples lag, their mean), rollout/staleness_tokens (the
    same per model token), rollout/staleness_share/<a> (the share a updates old, a = 0..k; `older`: more than
    k -- rollout.stale_groups keep, or a run resumed with a smaller k);
    timing/overlap (seconds generation ran while the step trained)."""
    partial: bool = False
    """ppo only, rollout.backend vllm: partial rollouts.
    With rollout.max_staleness >= 1 the engine generates in a thread of its own while the step trains (on the
    local runtime rank 0's serves every local rank; on Ray each engine actor drives its engine so); at a weight sync
    the samples under way are paused, the weights change, and they go on under
    the new ones (their tokens and log-probs kept, each span's policy version recorded) instead of the sync
    waiting for them; the steps ahead are launched as soon as a step starts, so a straggler runs beside the
    next batch. A sample's age is that of its first token (rollout/staleness <= k still holds); its later
    tokens are newer (rollout/staleness_tokens). Needs ppo.tis_cap (the behaviour log-probs of a paused
    sample come from two policies). With an agent section the model's turns are paused
    alike, and a trajectory records the version of each span of its turns (an environment's answer lies in the
    span before it). A checkpoint does not wait for the samples under way: it keeps each as far as it got (on Ray
    each engine actor its part), and the resumed run continues it (resume with this setting on) -- but for
    trajectories, which it waits for (an environment's state cannot be kept): they end under the weights of the
    checkpoint's step, where the run that saved it continued their tail under the next step's. false: without it, k >= 1
    on the local runtime's engine still generates in its thread, on Ray each engine takes one batch at a time,
    and each sync waits for the samples under way to end (timing/weight_sync, timing/generate_ahead_wait hold that
    tail)."""
    stream_order: Literal["plan", "arrival"] = "plan"
    """ppo only, with rollout.max_staleness >= 1: which samples a step trains. plan: step s trains its planned
    prompts, generated k steps ahead, and waits for the last of their samples (a resumed run equals an
    uninterrupted one). arrival: the prompts are handed to the engine one group (a prompt's samples) at a time,
    in the plan's order and with the plan's seeds, as far as k allows (a group starts only if it can be trained
    within k updates: at most (k + 1) x rollout.prompts_per_step groups started and not yet trained), and each
    step trains the first rollout.prompts_per_step groups that ended -- a long response no longer holds its step,
    a later step trains it. A group whose first token would be more than k updates old when trained is dropped
    (cancelled if still under way) and its prompt handed out again first, so every prompt is still trained once
    (stream/dropped_groups, stream/requeued_prompts; also stream/admitted_groups, stream/late_groups -- groups
    planned for an earlier step --, stream/under_way_groups, stream/ended_groups). A response that takes longer than
    about k steps to generate is so dropped each time it starts again and trained only when the prompts run out
    (a warning names it): raise k for long generations, or set rollout.stale_groups=keep (`hpcrlhf plan
    --schedule` predicts how many are dropped; with rollout.partial a long response runs on across the syncs and
    outlives k sooner). A checkpoint keeps the
    groups
    started and not trained (with rollout.partial those under way as far as they got): a resumed run loses and
    repeats none, but which groups each step takes depends on when they end, so it does not equal an
    uninterrupted run. With ppo.dynamic_sampling each round takes the next rollout.prompts_per_step groups that end
    (as many more start), and the groups a step leaves out are discarded, not handed out again
    (stream/discarded_groups; the prompts go on into the next epochs). arrival needs rollout.backend vllm: on the
    local runtime rank 0's engine loop takes every rank's groups (several ranks: rank 0's share first, then rank
    1's, ..., each sent as it fills; with ppo.dynamic_sampling every rank takes part in each round and rank 0
    records which groups the ranks used), on Ray each group goes to the engine with
    the fewest under way (every engine on an engine loop, with or without rollout.partial). With an agent section
    a group is its prompt's trajectories, their turns on the engine loop (several local ranks: rank 0's, the
    environments in its process, each group sent to its rank with its episodes; on Ray in the engine actor it went
    to, beside its engine); a dropped group's trajectories stop (their environments still close), and a checkpoint
    waits for those under way."""
    stale_groups: Literal["drop", "keep"] = "drop"
    """ppo only, rollout.stream_order arrival: what becomes of a group that would be more than rollout.max_staleness
    updates old when trained. drop: it is dropped (cancelled if under way) and its prompt handed out again --
    nothing trained is older than k, but a response that takes longer than about k steps to generate starts over
    each time (a drop storm: `hpcrlhf plan --schedule`). keep: nothing is dropped for age -- a slow group is
    trained when it ends, however old, as the Tinker cookbook's and Agent Lightning's asynchronous RL do; k then
    bounds how far generation runs ahead (at most (k + 1) x rollout.prompts_per_step groups started and not
    trained), not staleness: watch stream/overage_groups (groups trained older than k) and
    rollout/staleness_share/older, with ppo.tis_cap correcting the per-token ratios."""
    length_key: str | None = None
    """Benchmarks only (hpcrlhf bench's long-tail suites): the prompt-row field holding the length, in tokens,
    of every response to that prompt -- EOS suppressed until then, cut there (vLLM's min_tokens = max_tokens),
    so that every system of a suite generates the same lengths, drawn from a stated distribution. At most
    rollout.max_new_tokens; vllm only; not with an agent section. null: the model decides (up to
    max_new_tokens)."""
    min_engine_step_s: float = 0.0
    """ppo only; benchmarks and tests: each model step of the vLLM engine on an engine loop takes at least this many
    seconds (its worker sleeps the rest, holding no core), as a larger model's step would -- so that on a small
    machine generation takes its real share of a step (the synchronous run's too: with it the engine runs on a loop at
    rollout.max_staleness 0 as well, each batch waited for), and samples are under way at a weight sync whatever
    the host's speed. rollout.backend vllm; on Ray the engine actors run on loops with rollout.partial or
    rollout.stream_order arrival only. 0: off."""

    def __post_init__(self) -> None:
        require_finite(self, "rollout")
        require(self.prompts_per_step >= 1, "rollout.prompts_per_step", self.prompts_per_step, "use at least 1")
        require(self.samples_per_prompt >= 1, "rollout.samples_per_prompt", self.samples_per_prompt, "use at least 1")
        require(self.temperature > 0, "rollout.temperature", self.temperature,
                "use a positive temperature (sampling is what makes on-policy RL explore)")
        require(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "use a value in (0, 1]")
        require(self.top_k >= 0, "rollout.top_k", self.top_k, "use 0 (off) or a positive k")
        require(self.max_new_tokens is None or self.max_new_tokens >= 1, "rollout.max_new_tokens",
                self.max_new_tokens, "use at least 1, or null for the task's default")
        if self.max_new_tokens is not None:  # null is resolved by the job's config (resolved_new_tokens)
            require(0 <= self.min_new_tokens <= self.max_new_tokens, "rollout.min_new_tokens", self.min_new_tokens,
                    f"use a value from 0 to rollout.max_new_tokens ({shown(self.max_new_tokens)})")
        require(self.hf_batch_size >= 1, "rollout.hf_batch_size", self.hf_batch_size, "use at least 1")
        require(self.max_staleness >= 0, "rollout.max_staleness", self.max_staleness,
                "use 0 (synchronous) or the number of updates a sample may lag (1-4 usual; AReaL uses 2-8)")
        require(not self.partial or self.max_staleness >= 1, "rollout.partial", self.partial,
                "it continues generations across weight syncs, but rollout.max_staleness is 0 (nothing is under way "
                "at a sync): set rollout.max_staleness=1 or more, or rollout.partial=false")
        require(not self.partial or self.backend == "vllm", "rollout.partial", self.partial,
                f"it pauses generations inside a vLLM engine; rollout.backend {self.backend} generates each batch in "
                "one call of the training process, which cannot be paused: set rollout.backend=vllm, or "
                "rollout.partial=false")
        require(self.stream_order in ("plan", "arrival"), "rollout.stream_order", self.stream_order,
                "use plan or arrival")
        require(self.stream_order == "plan" or self.max_staleness >= 1, "rollout.stream_order", self.stream_order,
                "it takes each step's groups as the engine ends them, but rollout.max_staleness is 0 (each step "
                "generates its own batch): set rollout.max_staleness=1 or more, or rollout.stream_order=plan")
        require(self.stale_groups in ("drop", "keep"), "rollout.stale_groups", self.stale_groups, "use drop or keep")
        require(self.stale_groups == "drop" or self.stream_order == "arrival", "rollout.stale_groups",
                self.stale_groups, "plan order trains each step's planned prompts and drops none: it applies to "
                "rollout.stream_order=arrival; set that, or rollout.stale_groups=drop")
        require(self.stream_order == "plan" or self.backend == "vllm", "rollout.stream_order", self.stream_order,
                f"rollout.backend {self.backend} generates each batch in one call of the training process, in plan "
                "order: set rollout.backend=vllm, or rollout.stream_order=plan")
        require(self.length_key is None or self.backend == "vllm", "rollout.length_key", self.length_key,
                "fixed per-prompt lengths are set per request in a vLLM engine: set rollout.backend=vllm, or "
                "rollout.length_key=null")
        require(self.min_engine_step_s >= 0, "rollout.min_engine_step_s", self.min_engine_step_s,
                "use 0 (off) or a floor in seconds, e.g. 0.02")
        require(not self.min_engine_step_s or self.backend == "vllm", "rollout.min_engine_step_s",
                self.min_engine_step_s, f"it slows the steps of the vLLM engine loop; rollout.backend {self.backend} "
                "has none: set rollout.backend=vllm, or rollout.min_engine_step_s=0")
        require(self.vllm_kv_cache_gb > 0, "rollout.vllm_kv_cache_gb", self.vllm_kv_cache_gb, "use a positive size")
        for name in ("vllm_max_num_seqs", "vllm_max_num_batched_tokens"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"rollout.{name}", value, "use null (vLLM's default) or at least 1")
        if self.vllm_max_num_seqs is not None and self.vllm_max_num_batched_tokens is not None:
            require(self.vllm_max_num_batched_tokens >= self.vllm_max_num_seqs, "rollout.vllm_max_num_batched_tokens",
                    self.vllm_max_num_batched_tokens,
                    f"use at least rollout.vllm_max_num_seqs ({shown(self.vllm_max_num_seqs)}): each running sequence "
                    "needs one token per step")


@dataclass(frozen=True)
class RewardSourceConfig:
    model: PathText | None = None
    """A reward model folder (from `hpcrlhf train rm`, or any one-label sequence classifier)."""
    rule: str | None = None
    """A rule-based reward instead: a built-in rule (`math`, `code`, `format`: set in the `rules`
    section, see docs/rewards.md), `task` (the bundled task's exact score, 1 or 0), `task_partial`
    (share of digits right), or `package.module:function` taking (prompt, response, row) and
    returning a float."""
    env: bool = False
    """true: the agent's environment is this source: each trajectory's reward (the rewards its `step`
    gave plus what `get_reward()` gave at the end; needs the `agent` section)."""
    url: str | None = None
    """A reward server instead (http:// or https://): the responses are POSTed there in batches and
    it answers one score each (the protocol: docs/rewards.md#reward-servers; `reward.remote` sets
    batch size, concurrency, timeout and retries)."""
    token_file: PathText | None = None
    """url only: a file holding the bearer token sent with each request (only the file's path is
    written anywhere; the token is read when the job starts)."""
    token_env: str | None = None
    """url only: the environment variable holding the bearer token, instead of token_file."""
    weight: float = 1.0
    """This source's weight in the weighted sum of all sources."""
    normalize: bool = True
    """model only: standardise with the reward mean/std stored in the model's config.json."""
    servers: int = 0
    """0: this source is scored inside the job. N > 0 (ppo on Ray only): the job starts N reward
    servers serving this source alone, placed by the node map (a reward model's server takes one GPU,
    a rule's server `placement.reward_server.cpus` CPU cores), health-checked before the first step
    and stopped with the job; the job asks them as it asks a `url` source, and applies `weight`."""

    def __post_init__(self) -> None:
        require(self.servers >= 0, "servers", self.servers, "use 0 (scored in the job) or more servers")
        require(not (self.servers and self.url is not None), "servers", self.servers,
                "a url source is a server already: drop servers, or give the model or rule the server would serve")
        kinds = [key for key in ("model", "rule", "url") if getattr(self, key) is not None] + ["env"] * self.env
        if len(kinds) != 1:
            raise ConfigError(f"reward.sources: each source sets exactly one of `model` (a reward model folder), "
                              f"`rule` ({', '.join(KNOWN_RULES)} or module:function), `url` (a reward server) or "
                              f"`env: true` (the agent's environment); got model={self.model!r}, rule={self.rule!r}, "
                              f"url={self.url!r}, env={self.env!r}")
        require(not (self.env and self.servers), "servers", self.servers,
                "the environment's reward comes with its trajectories: use servers=0 with env: true")
        token_key = "token_file" if self.token_file is not None else "token_env"
        if self.url is None:
            require(self.token_file is None and self.token_env is None, token_key, getattr(self, token_key),
                    "a token is for a reward server: set `url`, or drop the token")
            return
        require_url(self.url, "url")
        require(self.token_file is None or self.token_env is None, "token_env", self.token_env,
                "give the token one way: token_file or token_env")
        require(self.token_env is None or bool(self.token_env), "token_env", self.token_env, "name an environment variable")


def source_name(index: int, source: RewardSourceConfig) -> str:
    """Metric name of reward.sources[index] (`reward/<name>`): `rule_<name>`, `model<i>_<folder name>`,
    `server<i>_<host>` or `env`."""
    if source.env:
        return "env"
    if source.rule is not None:
        return "rule_" + source.rule.replace(":", ".").replace("/", ".")
    if source.url is not None:
        return f"server{index}_{urlsplit(source.url).hostname or 'server'}"
    return f"model{index}_{PurePath(source.model).name or 'rm'}"


def require_in_job(reward: RewardConfig | None, job: str, allow_env: bool = False) -> None:
    """Sources only ppo has, refused by other jobs before anything loads: reward servers of its own
    (`reward.sources[i].servers`, on Ray) and, unless `allow_env` (generate: its agent section
    decides), the environment's reward of multi-turn rollouts (`env`)."""
    for i, source in enumerate(reward.sources if reward is not None else ()):
        require(not source.servers, f"reward.sources[{i}].servers", source.servers,
                f"only ppo on the Ray runtime starts reward servers, not {job}: use servers=0 to score in the job, "
                "or start `hpcrlhf serve-reward` yourself and give the source its url")
        require(allow_env or not source.env, f"reward.sources[{i}].env", source.env,
                f"the environment's reward comes with multi-turn rollouts, which ppo and generate (with an agent "
                f"section) run, not {job}: drop this source")


def require_url(url: str, key: str) -> None:
    """An http(s) URL with a host and no user or password in it (config.yaml and the logs show URLs:
    a token goes in token_file or token_env)."""
    parts = urlsplit(url)
    require(parts.scheme in ("http", "https") and bool(parts.hostname), key, url,
            "use an http:// or https:// URL with a host, e.g. http://10.0.0.5:8000/score")
    require(parts.username is None and parts.password is None, key, url.replace(parts.password or "\0", "***"),
            "put no credentials in the URL (it is written into config.yaml and logs): give the token with token_file "
            "or token_env")


@dataclass(frozen=True)
class RemoteRewardConfig:
    """How the reward servers of `reward.sources` (`url`) are asked."""

    batch_size: int = 64
    """Responses per request."""
    concurrency: int = 4
    """Requests in flight at once, per server."""
    timeout_s: float = 60.0
    """Longest one request may take (connecting, sending, the server's work, the answer), in seconds."""
    retries: int = 3
    """Further tries of a request that failed (no connection, a timeout, status 429 or 5xx, an answer
    that is not the scores asked for); then the run fails naming the server and what came back."""
    backoff_s: float = 1.0
    """Wait before the first retry, in seconds; doubled before each further one."""

    def __post_init__(self) -> None:
        require_finite(self, "reward.remote")
        require(self.batch_size >= 1, "reward.remote.batch_size", self.batch_size, "use at least 1")
        require(self.concurrency >= 1, "reward.remote.concurrency", self.concurrency, "use at least 1")
        require_timeout(self.timeout_s, "reward.remote.timeout_s")
        require(self.retries >= 0, "reward.remote.retries", self.retries, "use 0 (no retry) or more")
        require(self.backoff_s >= 0, "reward.remote.backoff_s", self.backoff_s, "use 0 or more seconds")


TASK_RULES = ("task", "task_partial")
"""Rules that score answers to the bundled task."""
KNOWN_RULES = BUILTIN_RULES + TASK_RULES
"""The rules named by a name alone; any other rule is `package.module:function`."""


def _close(name: str) -> str:
    close = difflib.get_close_matches(name, KNOWN_RULES, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _require_task_for_rules(reward: RewardConfig | None, task: TaskConfig, data: DataSourceConfig) -> None:
    """The `task` rules need the bundled task to apply: refused when the config loads, not after the
    models have loaded and the first prompt fails to parse."""
    if reward is None or task.resolve(data) is not None:
        return
    for i, source in enumerate(reward.sources):
        if source.rule in TASK_RULES:
            why = ("task.name is auto and data.train_path is set, so the bundled arithmetic task does not apply to "
                   "your prompts" if task.name == "auto" else "task.name is null")
            raise ConfigError(f"reward.sources[{i}].rule: '{source.rule}' scores answers to the bundled task, but {why}: "
                              "score them with your own rule (reward.sources=[{rule: 'package.module:function'}]) or a "
                              "reward model, or set task.name=arithmetic if your prompts are arithmetic questions")


@dataclass(frozen=True)
class RewardConfig:
    sources: tuple[RewardSourceConfig, ...] = (RewardSourceConfig(rule="task"),)
    """Reward models and rule-based rewards; a response's score is their weighted sum, e.g.
    `[{model: runs/rm/model, weight: 1.0}, {rule: task, weight: 0.5}]`."""
    clip: float | None = None
    """Clip each combined score to [-clip, clip] (null: no clipping)."""
    running_norm: bool = False
    """Standardise scores with their running mean and std over all rollouts so far."""
    missing_eos_penalty: float | None = None
    """Added to the score of a response cut at rollout.max_new_tokens (e.g. -1.0); null: none."""
    length_penalty: float = 0.0
    """Subtracted from the score per response token (discourages long answers)."""
    overlong_buffer: int = 0
    """DAPO's overlong reward shaping (Yu et al. 2025): a response within the last `overlong_buffer`
    tokens before rollout.max_new_tokens loses a penalty rising linearly from 0 to
    `overlong_penalty` at the limit (0: off). DAPO used 4096 of 20480."""
    overlong_penalty: float = 1.0
    """The overlong penalty at rollout.max_new_tokens (with reward.overlong_buffer > 0)."""
    batch_size: int = 128
    """Sequences per reward-model forward pass."""
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    """How reward servers (`reward.sources[].url`) are asked."""
    rule_timeout_s: float = DEFAULT_USER_CODE_TIMEOUT_S
    """Longest one call of a `package.module:function` rule may take, in seconds; past it the run
    fails naming the rule (a rule that never returns would hang the job). The built-in rules have
    their own (`rules.math.timeout_s`, ...), past which an answer scores 0."""
    overlap: bool = True
    """Score a prompt's responses as soon as the engine has finished them, while the others still
    generate (ppo on the Ray runtime: each vLLM engine streams its finished prompts; the groups that
    finished while a score call ran go together in the next). `timing/reward` is then the scoring the
    step still waits for after the last generation, `timing/reward_overlap` the scoring done while
    generation went on. false: every response is scored once all are generated. The scores are the
    same either way. On the local runtime it applies where the vLLM engine runs in a loop of its own
    (rollout.max_staleness >= 1; with several ranks rank 0's loop sends each rank its finished prompts), except
    with a reward model under engine.zero_stage 3 over several ranks (its forwards need every rank at once:
    the batch is scored whole); elsewhere the local runtime generates in the training process and scores
    afterwards."""

    def __post_init__(self) -> None:
        require_finite(self, "reward")
        require_timeout(self.rule_timeout_s, "reward.rule_timeout_s")
        require(len(self.sources) >= 1, "reward.sources", list(self.sources), "give at least one reward model or rule")
        for i, rule in enumerate(source.rule for source in self.sources):
            require(rule is None or rule in KNOWN_RULES or is_user_function(rule), f"reward.sources[{i}].rule", rule,
                    f"use a known rule ({', '.join(KNOWN_RULES)}) or package.module:function{_close(rule or '')}")
        require(self.clip is None or self.clip > 0, "reward.clip", self.clip, "use a positive bound, or null")
        require(self.length_penalty >= 0, "reward.length_penalty", self.length_penalty, "use >= 0")
        require(self.overlong_buffer >= 0, "reward.overlong_buffer", self.overlong_buffer,
                "use 0 (off) or a number of tokens below rollout.max_new_tokens")
        require(self.overlong_penalty >= 0, "reward.overlong_penalty", self.overlong_penalty, "use >= 0")
        require(self.batch_size >= 1, "reward.batch_size", self.batch_size, "use at least 1")


@dataclass(frozen=True)
class OnlineJobConfig(TrainJobConfig):
    """Jobs that generate their own training data from prompts (PPO, rejection sampling)."""

    data: PromptDataConfig = field(default_factory=PromptDataConfig)
    """Prompts for rollouts and evaluation."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """How responses are generated."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How responses are scored."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """The frozen reference model (KL penalty, iterative DPO)."""

    def reward_models(self) -> list[tuple[str, str]]:
        """(config field, path) of each reward model in `reward.sources` (rules load nothing), served
        or not."""
        return [(f"reward.sources[{i}].model", src.model) for i, src in enumerate(self.reward.sources) if src.model]

    def in_job_reward_models(self) -> list[tuple[str, str]]:
        """(config field, path) of each reward model the job loads itself (not served: `servers` 0)."""
        return [(f"reward.sources[{i}].model", src.model) for i, src in enumerate(self.reward.sources)
                if src.model and not src.servers]

    def served_sources(self) -> list[tuple[int, RewardSourceConfig]]:
        """(index, source) of each source the job's own reward servers score (`servers` > 0)."""
        return [(i, src) for i, src in enumerate(self.reward.sources) if src.servers]

    def multi_turn(self) -> AgentConfig | None:
        """The agent section of a job that runs multi-turn rollouts (ppo's `agent`), else None."""
        return None

    def reference_source(self) -> tuple[str, str]:
        """(config field, path) of the frozen reference: `reference.path`, else `model.path`."""
        return ("reference.path", self.reference.path) if self.reference.path else ("model.path", self.model.path)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reference.offload and self.engine.zero_stage != 3:
            raise ConfigError("reference.offload: true keeps reference weights in CPU memory through ZeRO-3: "
                              "set engine.zero_stage=3")
        if self.reference.precompute:
            raise ConfigError("reference.precompute: true needs the training sequences in advance; online jobs "
                              "generate them as they go: set reference.precompute=false")
        _require_task_for_rules(self.reward, self.task, self.data)
        fill_derived(self, "rollout", max_new_tokens=resolved_new_tokens(self.rollout.max_new_tokens, self.task, self.data))
        require(self.reward.overlong_buffer < self.rollout.max_new_tokens, "reward.overlong_buffer",
                self.reward.overlong_buffer,
                f"use fewer tokens than rollout.max_new_tokens ({shown(self.rollout.max_new_tokens)}), e.g. a fifth")


def require_agent_settings(agent: AgentConfig | None, reward: RewardConfig | None, rollout: RolloutConfig) -> None:
    """The `agent` section against the rest of a ppo or generate config: a model turn fits the
    trajectory's tokens, the hf backend runs turn by turn, the environment's reward needs an environment."""
    for i, source in enumerate(reward.sources if reward is not None else ()):
        require(not source.env or agent is not None, f"reward.sources[{i}].env", source.env,
                "the environment's reward needs the agent section: set agent.environment, or drop this source")
    if agent is None:
        return
    require(rollout.length_key is None, "rollout.length_key", rollout.length_key,
            "it is a benchmark setting that fixes every response's length; an agent's turns end where the model "
            "ends them: set rollout.length_key=null")
    require(agent.max_tokens >= rollout.max_new_tokens, "agent.max_tokens", agent.max_tokens,
            f"a model turn may use rollout.max_new_tokens ({shown(rollout.max_new_tokens)}) tokens: use at "
            "least that many, e.g. a few turns' worth")
    require(not (agent.schedule == "trajectory" and rollout.backend == "hf"), "agent.schedule", agent.schedule,
            "HF generate runs every trajectory turn by turn: leave agent.schedule null or set turn, or use "
            "rollout.backend=vllm")


@dataclass(frozen=True)
class RSSectionConfig:
    mode: Literal["sft", "dpo"] = "sft"
    """sft: rejection sampling (train on each prompt's best response, Touvron et al. 2023); dpo:
    iterative DPO (pair each prompt's best and worst responses and train DPO on the pairs; it
    wants a smaller optim.lr than sft, e.g. 1e-5 for the bundled model)."""
    iterations: int = 3
    """Generate -> score -> train rounds."""
    prompts_per_iteration: int = 512
    """Prompts sampled (best-of-n over rollout.samples_per_prompt) in each round."""
    steps_per_iteration: int = 40
    """Optimizer steps on each round's selected data."""
    min_score: float | None = None
    """sft: keep a prompt's best response only if its score reaches this (e.g. 1.0 with the exact
    task reward); null: only if it scores higher than the prompt's worst response."""
    beta: float = 0.1
    """dpo: DPO beta."""
    nll_coef: float = 1.0
    """dpo: weight of the chosen responses' NLL (keeps their likelihood up, Pang et al. 2024)."""

    def __post_init__(self) -> None:
        require_finite(self, "rs")
        require(self.iterations >= 1, "rs.iterations", self.iterations, "use at least 1")
        require(self.prompts_per_iteration >= 1, "rs.prompts_per_iteration", self.prompts_per_iteration, "use at least 1")
        require(self.steps_per_iteration >= 1, "rs.steps_per_iteration", self.steps_per_iteration, "use at least 1")
        require(self.iterations * self.steps_per_iteration <= MAX_STEPS, "rs.steps_per_iteration",
                self.steps_per_iteration, f"rs.iterations ({shown(self.iterations)}) x rs.steps_per_iteration steps "
                f"must be at most {MAX_STEPS:,} (2**31 - 1, see train.max_steps)")
        require(self.beta > 0, "rs.beta", self.beta, "use a positive value such as 0.1")
        require(self.nll_coef >= 0, "rs.nll_coef", self.nll_coef, "use >= 0")


@dataclass(frozen=True)
class RSConfig(OnlineJobConfig):
    """Rejection sampling / iterative DPO: best-of-n generations scored by the rewards, then
    supervised (or DPO) training on the winners, repeated."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, scheduler="constant", warmup_ratio=0.0))
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(global_batch_size=32))
    """Batch sizes (responses or pairs per optimizer step); the length comes from the rs section."""
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(samples_per_prompt=8))
    """How candidate responses are generated."""
    rs: RSSectionConfig = field(default_factory=RSSectionConfig)
    """The rounds of generation and training."""
    output_dir: PathText = "runs/rs"
    """Run folder: config.yaml, metrics.jsonl, rounds/ (each round's selected data), checkpoints/, model/."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.train.max_steps is not None:
            raise ConfigError("train.max_steps: rejection sampling runs rs.iterations x rs.steps_per_iteration steps; "
                              "leave train.max_steps null and set those instead")
        require(self.rollout.length_key is None, "rollout.length_key", self.rollout.length_key,
                "ppo only (a benchmark setting): set rollout.length_key=null")
        require(self.rollout.stream_order == "plan", "rollout.stream_order", self.rollout.stream_order,
                "ppo only; rejection sampling generates each round whole: leave it plan")
        require(not self.rollout.min_engine_step_s, "rollout.min_engine_step_s", self.rollout.min_engine_step_s,
                "ppo only (a benchmark setting): set rollout.min_engine_step_s=0")
        require(not self.rollout.partial, "rollout.partial", self.rollout.partial,
                "ppo only; rejection sampling generates each round with the weights the round before trained: leave "
                "it false")
        require(not self.rollout.max_staleness, "rollout.max_staleness", self.rollout.max_staleness,
                "rejection sampling generates each round with the weights the round before trained: use 0")
        require_in_job(self.reward, "rs")
        if self.rs.mode == "dpo" and self.rollout.samples_per_prompt < 2:
            raise ConfigError("rollout.samples_per_prompt: iterative DPO pairs a prompt's best and worst responses: "
                              "use at least 2")


@dataclass(frozen=True)
class GenerateConfig:
    """Batch inference: responses (optionally scored) for every prompt of a dataset, as JSONL."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model that generates."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The bundled task: prompts when data.train_path is unset, and a `task_score` per response."""
    data: PromptDataConfig = field(default_factory=PromptDataConfig)
    """Prompts to answer (`train_path`, read with `split` and `max_samples`)."""
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(samples_per_prompt=1))
    """Generation settings (backend, samples per prompt, temperature, length)."""
    greedy: bool = True
    """Greedy decoding (rollout.temperature/top_p/top_k unused); false samples."""
    reward: RewardConfig | None = None
    """Score each response with these reward models / rules (null: no scores)."""
    metrics: tuple[str, ...] = ()
    """Metrics of each response, as `eval.metrics` of training jobs (built-in rules or
    `package.module:function`s): written per response under `metrics`, their means printed."""
    rules: RulesConfig = field(default_factory=RulesConfig)
    """Settings of the built-in rules (math, code, format) that `metrics` and `reward.sources` name."""
    metric_timeout_s: float = DEFAULT_USER_CODE_TIMEOUT_S
    """Longest one call of a metric may take, in seconds (`eval.metric_timeout_s`)."""
    batch_size: int = 64
    """Prompts per generation batch."""
    seed: int = 1234
    """Seed for sampling."""
    output: PathText = "generations.jsonl"
    """JSONL file written: one line per response with prompt, response, sample index, finished, scores."""
    agent: AgentConfig | None = None
    """Multi-turn: each prompt row runs as a trajectory with this environment and tools (ppo's `agent`
    section; docs/agents.md), to evaluate an agent without training it. Each line then holds the
    trajectory's messages, turns, tool calls, status and rewards; `response` is its last model turn."""

    def __post_init__(self) -> None:
        require(self.batch_size >= 1, "batch_size", self.batch_size, "use at least 1")
        require_timeout(self.metric_timeout_s, "metric_timeout_s")
        fill_derived(self, "data", max_length=resolved_max_length(self.data.max_length, self.task, self.data))
        fill_derived(self, "rollout", max_new_tokens=resolved_new_tokens(self.rollout.max_new_tokens, self.task, self.data))
        require_metrics(self.metrics, "metrics")
        require_in_job(self.reward, "generate", allow_env=True)
        for key in ("max_staleness", "partial", "length_key", "min_engine_step_s"):
            require(not getattr(self.rollout, key), f"rollout.{key}", getattr(self.rollout, key),
                    "a ppo setting; generate answers each prompt once with the model as it is: drop it")
        require_agent_settings(self.agent, self.reward, self.rollout)
        if self.agent is not None:
            require(self.agent.reward_placement == "end", "agent.reward_placement", self.agent.reward_placement,
                    "it says where training credits the environment's rewards; generate reports each trajectory's "
                    "whole reward: leave it end (or drop it)")
        _require_task_for_rules(self.reward, self.task, self.data)
