"""The sections every job kind shares (`model`, `task`, `data`, `optim`, `train`, `engine`, `eval`,
`log`, `checkpoint`, `lora`, `reference`), the defaults derived from the bundled task, and
`TrainJobConfig`, the sections every training job has.
"""

from __future__ import annotations

import math
import statistics
import re
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import ClassVar, Literal

from hpcrlhf.config.schema.checks import (PathText, fill_derived, largest_divisor, require, require_finite,
                                          require_timeout)
from hpcrlhf.config.schema.rules import RulesConfig, require_metrics
from hpcrlhf.config.stop_rule import METRIC, parse_stop_rule
from hpcrlhf.errors import ConfigError

@dataclass(frozen=True)
class ModelConfig:
    path: PathText = "builtin:tiny-llama"
    """Model to start from: a local Hugging Face folder, a hub name (online only), or
    `builtin:tiny-<family>` (llama, mistral, mixtral, qwen2, gpt2) for the bundled tiny models."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """Attention kernel. `auto` picks flash_attention_2 when flash-attn is installed and a GPU is
    used, else sdpa. Asking for flash_attention_2 without flash-attn is an error."""
    trust_remote_code: bool = False
    """Allow model code from the model folder (only for models you trust)."""
    router_aux_loss_coef: float = 0.0
    """Mixture-of-experts models (Mixtral, Qwen2-MoE, ...): weight of the router's load-balancing
    loss (Switch Transformer's, as transformers computes it; hpcrlhf.models.moe) added to the
    trained model's loss in sft and for the ppo actor, reported as train/router_aux_loss. 0: off
    (router logits not computed). Mixtral was trained with 0.02; refused for a model without a router."""

    def __post_init__(self) -> None:
        require_finite(self, "model")
        require(self.router_aux_loss_coef >= 0, "model.router_aux_loss_coef", self.router_aux_loss_coef,
                "use 0 (off) or a positive weight, e.g. 0.02")


DEFAULT_TASK = "arithmetic"
"""The bundled task `task.name: auto` applies when no `data.train_path` is given."""


@dataclass(frozen=True)
class BundledTask:
    """What the config knows of a bundled task: the lengths its null settings default to. The task
    itself (its rows, its scores) is `hpcrlhf.data.tasks.TASKS[name]`, registered under the same
    name (tests/data/test_tasks.py checks that the two name the same tasks)."""

    sample_tokens: int
    """Tokens per sample (`data.max_length` when left null)."""
    answer_tokens: int
    """Generation budget for an answer (`rollout/eval.max_new_tokens` when left null)."""
    jobs: tuple[str, ...] = ()
    """The job kinds it has rows for (empty: every kind)."""


BUNDLED_TASKS: dict[str, BundledTask] = {
    # arithmetic: prompt, answer and EOS in 64 tokens, with room; up to 3 digits plus EOS in 8, with room
    # for a wrong longer answer
    "arithmetic": BundledTask(sample_tokens=64, answer_tokens=8),
    # calculator: a whole conversation with a tool call (~110 tokens) in 160; a call (~50 tokens) in 64
    "calculator": BundledTask(sample_tokens=160, answer_tokens=64, jobs=("sft", "ppo", "rs", "generate")),
}
"""The bundled tasks by name (`task.name`), as the config sees them."""


@dataclass(frozen=True)
class TaskConfig:
    name: str | None = "auto"
    """Bundled synthetic task (rule-based score): it supplies the data when `data.train_path` is
    unset, and the task score (`eval/task_score`, the `task` reward rules). `auto`: the arithmetic
    task when `data.train_path` is unset, none when it is set (your data is not scored as
    arithmetic; the run logs which applies). `arithmetic` applies it to your data too (its prompts
    must then be arithmetic questions); `calculator`: products of two-digit numbers with a `multiply`
    tool, for agents (sft on its conversations, 30 % of them calling the tool, with
    data.apply_chat_template true; ppo, rs and generate on its prompts); null: no task (then
    `data.train_path` is required)."""
    max_operand: int = 99
    """Largest operand of the arithmetic task: the task's difficulty."""
    seed: int = 0
    """Seed of the task's problem generator."""
    train_size: int = 80000
    """Rows drawn from the task for training (when `data.train_path` is unset); one epoch of
    the default batch is 1250 steps, enough for the tiny llama to learn the task (~30 s on CPU)."""
    eval_size: int = 256
    """Held-out rows (loss and task score) drawn from the task's eval split."""
    hard_pair_fraction: float = 0.5
    """Share of the task's preference pairs (rm, dpo) whose rejected answer is a near miss (off by
    one digit) rather than clearly wrong (wrong number of digits)."""
    near_miss: Literal["digit", "offset"] = "digit"
    """Kind of the hard pairs' rejected answer: `digit` (off by 1 or 10, or two digits swapped) or
    `offset` (off by 1 to 3 or by 10: the mistakes a half-trained policy makes, which a reward
    model for PPO on this task must tell apart)."""

    tool_share: float = 0.3
    """calculator: the share of its SFT conversations that answer through the `multiply` tool (the
    rest answer directly)."""

    def __post_init__(self) -> None:
        require_finite(self, "task")
        require(self.name is None or self.name == "auto" or self.name in BUNDLED_TASKS, "task.name", self.name,
                f"use auto (the default), a bundled task ({', '.join(sorted(BUNDLED_TASKS))}), or null to train on "
                "data.train_path")
        require(self.max_operand >= 1, "task.max_operand", self.max_operand, "use at least 1, e.g. 99")
        require(self.train_size >= 1, "task.train_size", self.train_size, "use at least 1 row")
        require(self.eval_size >= 0, "task.eval_size", self.eval_size, "use 0 (no held-out rows) or more")
        require(0 <= self.hard_pair_fraction <= 1, "task.hard_pair_fraction", self.hard_pair_fraction,
                "use a value in [0, 1]")
        require(0 <= self.tool_share <= 1, "task.tool_share", self.tool_share, "use a share in [0, 1], e.g. 0.3")

    def resolve(self, data: DataSourceConfig) -> str | None:
        """The task that applies to a job with `data`: `name`, with `auto` decided by
        `data.train_path`."""
        if self.name != "auto":
            return self.name
        return None if data.train_path else DEFAULT_TASK


def require_task_rows(task: TaskConfig, data: DataSourceConfig, job: str) -> None:
    """The bundled task that applies to a `job` (its kind: "rm", "dpo", ...) has rows for it."""
    name = task.resolve(data)
    bundled = BUNDLED_TASKS.get(name) if name else None
    if bundled is not None and bundled.jobs and job not in bundled.jobs:
        require(False, "task.name", name, f"the {name} task has rows for {', '.join(bundled.jobs)}, not {job}: use "
                "task.name=arithmetic, or your own data (data.train_path)")


@dataclass(frozen=True)
class DataSourceConfig:
    """Where rows come from and how prompts are tokenised (shared by every job kind's `data`)."""

    train_path: PathText | None = None
    """Training data: a .jsonl/.json/.parquet/.csv file, a folder saved by `datasets`, or a hub
    dataset name (online only). Unset: rows from the bundled task."""
    eval_path: PathText | None = None
    """Held-out data in the same forms. Unset: the task's eval split (or none with a train file)."""
    split: str = "train"
    """Split to read from hub datasets."""
    prompt_key: str = "prompt"
    """Field of each row holding the prompt."""
    apply_chat_template: bool = False
    """Wrap each prompt as a user turn with the tokenizer's chat template."""
    max_length: int | None = None
    """Tokens per sample (prompt + response + EOS); longer samples are truncated (and counted).
    null: the bundled task's (64) when the task applies, else 1024 (`DEFAULT_MAX_LENGTH`)."""
    max_samples: int | None = None
    """Use only the first N training rows."""

    def __post_init__(self) -> None:
        require(self.max_length is None or self.max_length >= 8, "data.max_length", self.max_length,
                "use at least 8 tokens, or null for the task's default")
        require(self.max_samples is None or self.max_samples >= 1, "data.max_samples", self.max_samples,
                "use at least 1 row, or null for all of them")


@dataclass(frozen=True)
class DataConfig(DataSourceConfig):
    """(prompt, response) rows for supervised fine-tuning."""

    response_key: str = "response"
    """Field of each row holding the target response."""
    messages_key: str | None = None
    """SFT on conversations instead of (prompt, response) rows: the field of each row holding its chat
    messages (`role` and `content`; an assistant's `tool_calls`; tool results with role `tool`),
    rendered by the tokenizer's chat template (data.apply_chat_template: true). Every assistant turn
    (its text and EOS) is learned, the rest is context -- the tokens a multi-turn rollout of the same
    conversation holds."""
    tools_key: str | None = None
    """With messages_key: the field holding each row's tools (a list of JSON schemas, as transformers'
    get_json_schema writes them), which the chat template shows the model."""
    packing: bool = False
    """Pack several samples into each row of `max_length` tokens, with attention and positions
    restarting at every sample boundary."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.messages_key is not None:
            require(self.apply_chat_template, "data.apply_chat_template", self.apply_chat_template,
                    "conversations (data.messages_key) are rendered by the chat template: set it to true")
        require(self.tools_key is None or self.messages_key is not None, "data.tools_key", self.tools_key,
                "tools belong to conversations: set data.messages_key too, or drop data.tools_key")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 2e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr` (cosine and linear schedules)."""
    scheduler: Literal["constant", "cosine", "linear"] = "cosine"
    """Learning-rate schedule after warm-up."""
    warmup_ratio: float = 0.05
    """Fraction of all optimizer steps spent warming up linearly from 0."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""

    def __post_init__(self) -> None:
        require_finite(self, "optim")
        require(0 < self.lr < math.inf, "optim.lr", self.lr, "the learning rate must be a finite number > 0")
        require(all(0 <= b < 1 for b in self.betas) and len(self.betas) == 2, "optim.betas", list(self.betas),
                "use two numbers in [0, 1), e.g. [0.9, 0.95]")
        require(0 <= self.eps < math.inf, "optim.eps", self.eps, "use a small finite number >= 0, e.g. 1e-8")
        require(0 <= self.weight_decay < math.inf, "optim.weight_decay", self.weight_decay, "use a finite number >= 0")
        require(0 <= self.warmup_ratio < 1, "optim.warmup_ratio", self.warmup_ratio, "use a value in [0, 1)")
        require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "use a value in [0, 1]")
        require(self.max_grad_norm >= 0, "optim.max_grad_norm", self.max_grad_norm, "use >= 0 (0 disables)")


MICRO_BATCH_CAP = 64
"""Largest micro batch (and PPO mini-batch) derived when `train.micro_batch_size` (ppo:
`train.global_batch_size`) is null."""


DEFAULT_MAX_LENGTH = 1024
"""Tokens per sample when `data.max_length` is null and no bundled task sets its own (64)."""


DEFAULT_NEW_TOKENS = 256
"""Longest response generated when `rollout.max_new_tokens`/`eval.max_new_tokens` are null and no
bundled task sets its own answer length (the arithmetic task's answers need 8)."""


DEFAULT_USER_CODE_TIMEOUT_S = 300.0
"""How long one call of a user's rule or metric may take (`reward.rule_timeout_s`,
`eval.metric_timeout_s`): generous, as rules may run tests or call a service."""


MAX_STEPS = 2**31 - 1
"""The most optimizer steps (or PPO steps, or epochs) a run may ask for: step counters and the learning-rate
schedule (warm-up and decay computed in float64 from step counts) stay exact, and at one step a second it is
68 years. A larger count is a typo, refused rather than run in warm-up forever."""


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 1
    """Passes over the training data (ignored when `max_steps` is set)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (takes precedence over `epochs`)."""
    global_batch_size: int | None = 64
    """Samples (packed rows with packing) per optimizer step, summed over all data-parallel ranks.
    ppo: sequences per optimizer step (the mini-batch); null (its default) derives it from the
    rollout: the largest divisor of its sequences (rollout.prompts_per_step x samples_per_prompt)
    that is at most 64, so changing the rollout size alone never breaks the batch."""
    micro_batch_size: int | None = None
    """Samples per forward/backward pass on one rank; null: the largest divisor of each rank's
    share of the global batch that is at most 64 (`MICRO_BATCH_CAP`; lower it, or set it, when a
    micro batch does not fit in memory). Accumulation steps are derived: global_batch_size /
    (micro_batch_size * ranks), which must be a whole number. The start-up log shows both."""
    on_nonfinite: Literal["skip", "stop"] = "skip"
    """A step with NaN/Inf in its rewards, loss or gradients: `skip` leaves weights, optimizer state
    and schedule untouched and goes on (with a warning naming the step and the tensor); `stop` ends
    the run with that message (rerun to resume from the last checkpoint)."""
    max_consecutive_skips: int = 5
    """With `skip`: stop after more than this many skipped steps in a row (the run is diverging)."""

    def __post_init__(self) -> None:
        require(1 <= self.epochs <= MAX_STEPS, "train.epochs", self.epochs, f"use 1 to {MAX_STEPS:,} (2**31 - 1)")
        require(self.max_consecutive_skips >= 0, "train.max_consecutive_skips", self.max_consecutive_skips,
                "use >= 0 (0 stops at the first skipped step)")
        require(self.max_steps is None or 1 <= self.max_steps <= MAX_STEPS, "train.max_steps", self.max_steps,
                f"use 1 to {MAX_STEPS:,} (2**31 - 1: the schedule's step counts stay exact), or null")
        require(self.global_batch_size is None or self.global_batch_size >= 1, "train.global_batch_size",
                self.global_batch_size, "use at least 1")
        require(self.micro_batch_size is None or self.micro_batch_size >= 1, "train.micro_batch_size",
                self.micro_batch_size, "use at least 1, or null to derive it")

    def micro_batch_for(self, ranks: int) -> int:
        """`micro_batch_size`, or (null) the largest divisor of a rank's share of the global batch that
        is at most `MICRO_BATCH_CAP` (the share rounded down when it does not split evenly: the batch
        check then names the problem)."""
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        return largest_divisor(max(1, (self.global_batch_size or 1) // ranks), MICRO_BATCH_CAP)


@dataclass(frozen=True)
class EngineConfig:
    zero_stage: Literal[0, 1, 2, 3] = 0
    """DeepSpeed ZeRO stage: 0 plain data parallel, 1 shards optimizer states, 2 also gradients,
    3 also parameters."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Training precision (bf16 keeps fp32 master weights in the optimizer)."""
    offload_optimizer: bool = False
    """Keep optimizer states on the CPU and step with DeepSpeed's CPU Adam (ZeRO 1-3)."""
    offload_params: bool = False
    """Keep parameters on the CPU between uses (ZeRO-3 only)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""

    def __post_init__(self) -> None:
        if self.offload_optimizer and self.zero_stage == 0:
            raise ConfigError("engine.offload_optimizer: true needs ZeRO: set engine.zero_stage to 1, 2 or 3")
        if self.offload_params and self.zero_stage != 3:
            raise ConfigError("engine.offload_params: true needs parameter sharding: set engine.zero_stage=3")


@dataclass(frozen=True)
class EvalConfig:
    every_steps: int = 50
    """Evaluate (held-out loss and task score) every N optimizer steps, and at the end (0: only at
    the end)."""
    max_new_tokens: int | None = None
    """Tokens generated per eval prompt for the task score and `metrics` (greedy); null: the bundled
    task's answer length (8) when the task applies, else 256 (`DEFAULT_NEW_TOKENS`)."""
    score_prompts: int = 256
    """Held-out prompts answered (greedy) for the task score and `metrics`: the first ones of
    `data.eval_path`, else of the task's eval split."""
    batch_size: int = 128
    """Prompts per generation batch during evaluation."""
    stop_when: str = ""
    """Early stop: end the run at the first periodic evaluation whose metric passes this test,
    `<eval metric> >= <number>` or `<= <number>` (e.g. `eval/task_score>=0.9`, `eval/loss<=0.05`),
    with checkpoint, exported model and summary as at a normal end (`summary.json` says where and
    why it stopped). Needs `every_steps` > 0. Empty: train for `train.max_steps`/`epochs`."""
    metrics: tuple[str, ...] = ()
    """Metrics of the greedy answers to the held-out prompts: built-in rules (`math`, `code`,
    `format`, set in the `rules` section) or your own `package.module:function`s taking (prompt,
    response, row) and returning a real number, like reward rules (the row is the prompt's row of
    `data.eval_path`). Each is reported as `eval/<rule>` or `eval/<function name>` (mean over the
    prompts) in metrics.jsonl, summary.json and the log, and can end the run (`stop_when`)."""
    metric_timeout_s: float = DEFAULT_USER_CODE_TIMEOUT_S
    """Longest one call of a metric (or the task score) may take, in seconds; past it the run fails
    naming the metric (a metric that never returns would hang the job)."""
    samples_per_prompt: int = 1
    """Answers sampled per held-out prompt. 1: the greedy answer (unless `temperature` is set). More:
    `eval/<metric>` is the mean over every sample (mean@n), and each metric also reports
    `eval/<metric>/pass@k` (Chen et al. 2021's unbiased estimate, a sample counting as correct when its
    value reaches `pass_threshold`) for each k of `pass_k`, and `eval/<metric>/maj@n` (the value of the
    majority answer, `vote`). The samples are drawn with the same seed at every evaluation."""
    temperature: float | None = None
    """Sampling temperature of evaluation; null: greedy with one sample per prompt, 1.0 with more."""
    top_p: float = 1.0
    """Nucleus sampling of evaluation's samples (1.0: off)."""
    pass_k: tuple[int, ...] = ()
    """The k of `eval/<metric>/pass@k`, each 1..samples_per_prompt; empty: 1 and samples_per_prompt
    (with more than one sample)."""
    pass_threshold: float = 1.0
    """A sample is correct for pass@k when its metric value is at least this (1.0: an exact 0/1 score)."""
    vote: Literal["auto", "none", "boxed", "last_number"] = "auto"
    """How maj@n reads each sample's answer: boxed (the last \\boxed{...}), last_number (the last number
    in digits), none (no maj@n); auto: as `rules.math.extract` says when `math` is a metric, last_number
    with the bundled task, else none. Answers are compared as text."""

    keep_best: str = ""
    """Keep the model of the best evaluation by this `eval/*` metric (e.g. `eval/task_score/pass@8`): after
    each periodic evaluation and the final one that beats the best so far, the model is exported to `best/`
    of the run folder beside `model/` (which stays the final model), with `best.json` (metric, value, step);
    `summary.json` says which step it was. Needs `every_steps` > 0. Empty: no `best/`."""
    keep_best_mode: Literal["max", "min"] = "max"
    """Whether a larger (max) or a smaller (min: e.g. eval/loss) value of `keep_best` is better."""

    @property
    def sampled(self) -> bool:
        """Whether evaluation samples (several answers per prompt, or a temperature) instead of greedy."""
        return self.samples_per_prompt > 1 or self.temperature is not None

    @property
    def ks(self) -> tuple[int, ...]:
        """The k of pass@k reported (none with one sample per prompt)."""
        n = self.samples_per_prompt
        return () if n == 1 else self.pass_k or tuple(sorted({1, n}))

    def __post_init__(self) -> None:
        require_finite(self, "eval")
        if self.keep_best:
            require(re.fullmatch(METRIC, self.keep_best) is not None, "eval.keep_best", self.keep_best,
                    "name an evaluation metric, e.g. eval/task_score or eval/loss (keep_best_mode=min)")
            require(self.every_steps > 0, "eval.keep_best", self.keep_best,
                    "the best model is chosen among periodic evaluations: set eval.every_steps, e.g. 50")
        require(self.samples_per_prompt >= 1, "eval.samples_per_prompt", self.samples_per_prompt,
                "use 1 (one answer per prompt) or more, e.g. 8 for pass@8")
        require(self.temperature is None or self.temperature > 0, "eval.temperature", self.temperature,
                "use a positive temperature, or null (greedy with one sample per prompt, 1.0 with more)")
        require(0 < self.top_p <= 1, "eval.top_p", self.top_p, "use a value in (0, 1]")
        n = self.samples_per_prompt
        require(not self.pass_k or n > 1, "eval.pass_k", list(self.pass_k),
                "pass@k needs several samples per prompt: set eval.samples_per_prompt (e.g. 8), or drop pass_k")
        for k in self.pass_k:
            require(1 <= k <= n, "eval.pass_k", list(self.pass_k),
                    f"each k must be 1..eval.samples_per_prompt ({n}): sample more, or use smaller k")
        require_metrics(self.metrics, "eval.metrics")
        require_timeout(self.metric_timeout_s, "eval.metric_timeout_s")
        require(self.every_steps >= 0, "eval.every_steps", self.every_steps, "use 0 (only at the end) or a step count")
        if parse_stop_rule(self.stop_when) is not None and self.every_steps == 0:
            raise ConfigError(f"eval.stop_when: {self.stop_when!r} is checked at periodic evaluations, but "
                              "eval.every_steps is 0 (only at the end): set eval.every_steps to a step count, e.g. 50")
        require(self.max_new_tokens is None or self.max_new_tokens >= 1, "eval.max_new_tokens", self.max_new_tokens,
                "use at least 1, or null for the task's default")
        require(self.score_prompts >= 0, "eval.score_prompts", self.score_prompts, "use 0 (no task score) or more")
        require(self.batch_size >= 1, "eval.batch_size", self.batch_size, "use at least 1")


@dataclass(frozen=True)
class WatchdogConfig:
    """Deadlines of the job's waits (hpcrlhf.run.watchdog): a wait past its deadline ends the job with the
    stacks of what hung and exit status 4, which the Slurm script requeues (docs/checkpoints-and-failures.md)."""

    enabled: bool = True
    """Watch every phase of a step (generate, reward, make_experience, train, weight_sync, ...), the
    evaluation and the checkpoint."""
    factor: float = 5.0
    """A phase may take this many times the median of its earlier durations in this attempt ..."""
    floor_s: float = 300.0
    """... plus this many seconds."""
    first_s: float = 1500.0
    """The deadline of a phase with no earlier duration in this attempt (the first step, evaluation, checkpoint):
    below the 30-minute timeouts of collectives, so that the watchdog names the hang first."""
    grace_s: float = 120.0
    """After a deadline passed, seconds left to checkpoint and clean up before the process is ended."""
    history: int = 20
    """How many of a phase's latest durations the median is taken over."""

    def __post_init__(self) -> None:
        require_finite(self, "watchdog")
        require(self.factor >= 1, "watchdog.factor", self.factor, "use at least 1 (a phase may take its median)")
        for key in ("floor_s", "first_s", "grace_s"):
            require(getattr(self, key) > 0, f"watchdog.{key}", getattr(self, key), "use a positive number of seconds")
        require(self.history >= 1, "watchdog.history", self.history, "use at least 1")

    def deadline(self, past: Sequence[float]) -> tuple[float, str]:
        """(seconds a wait may take, how that was worked out) given its phase's earlier durations."""
        if not past:
            return self.first_s, f"first_s {self.first_s:g} s: none finished before in this attempt"
        recent = list(past)[-self.history:]
        median = statistics.median(recent)
        return (self.factor * median + self.floor_s,
                f"{self.factor:g} x median {median:.1f} s of the last {len(recent)} + {self.floor_s:g} s floor")


TRACKERS = ("tensorboard", "wandb", "mlflow")
"""What `log.backends` may name (hpcrlhf.run.trackers)."""


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases (`log.backends: [wandb]`; docs/tracking.md)."""

    project: str = "hpcrlhf"
    """The W&B project."""
    entity: str | None = None
    """The W&B team or user (None: your default entity)."""
    name: str | None = None
    """The run's display name (None: the run folder's name)."""
    group: str | None = None
    """A W&B group to put the run in."""
    tags: tuple[str, ...] = ()
    """W&B tags."""
    mode: Literal["auto", "online", "offline"] = "auto"
    """`offline`: write RUN/wandb/ only, upload later with the `wandb sync` line printed at the end (compute nodes
    without network); `online`: log to the W&B server (fails at the start without credentials or network);
    `auto`: WANDB_MODE when it says online or offline, else online when credentials (WANDB_API_KEY or ~/.netrc)
    exist and the server answers within 3 s, else offline. The mode of a run's first attempt is kept for the
    requeued and resumed ones."""


@dataclass(frozen=True)
class MLflowConfig:
    """MLflow (`log.backends: [mlflow]`; docs/tracking.md)."""

    tracking_uri: str | None = None
    """Where runs go: None = a file store in the run folder (RUN/mlruns), or a URI: `file:/path`, `http(s)://host`
    of a tracking server, `sqlite:///path.db` (needs the full `mlflow` package), `databricks`."""
    experiment: str = "hpcrlhf"
    """The MLflow experiment (created when missing)."""
    run_name: str | None = None
    """The run's name (None: the run folder's name)."""


@dataclass(frozen=True)
class LogConfig:
    every_steps: int = 10
    """Write train metrics every N optimizer steps."""
    backends: tuple[str, ...] = ("tensorboard",)
    """Experiment trackers each metric also goes to, besides metrics.jsonl (always written): any of
    `tensorboard` (RUN/tensorboard/), `wandb`, `mlflow` (`pip install 'hpcrlhf[track]'`); [] for none.
    Only rank 0 logs; a requeued or resumed run continues the same tracked run (RUN/trackers.json) and sends
    no step twice."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    progress: bool = True
    """Show a progress bar (rank 0) with rate and ETA."""
    third_party: Literal["file", "console"] = "file"
    """Where the libraries' own output goes (transformers, DeepSpeed, vLLM and its engine processes,
    Ray, torch, Python warnings): `file`: the run folder's `third_party.log`, their errors also on the
    terminal; `console`: the terminal, as they print it. HPCRLHF_VERBOSE=1 shows it on the terminal
    for any command."""

    def __post_init__(self) -> None:
        require(self.every_steps >= 1, "log.every_steps", self.every_steps, "use at least 1 (every step)")
        for name in self.backends:
            require(name in TRACKERS, "log.backends", list(self.backends),
                    f"name only {', '.join(TRACKERS)} (unknown: {name!r}); [] logs to metrics.jsonl alone")
        require(len(set(self.backends)) == len(self.backends), "log.backends", list(self.backends),
                "name each tracker once")

    MOVED: ClassVar[dict[str, str]] = {
        "tensorboard": "log.backends lists the trackers: log.backends=[] for none, [tensorboard] (the default)"}
    """Keys of earlier hpcrlhf versions -> what replaced them (the loader says so instead of 'unknown key')."""


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 0
    """Save a resumable checkpoint every N optimizer steps (0: only at the end)."""
    resume: PathText = "auto"
    """`auto`: continue from the run folder's latest checkpoint when one exists; `never`: start
    fresh (refuses to overwrite a run folder that has checkpoints); or a checkpoint folder path."""
    keep_last: int = 2
    """Checkpoints kept in `checkpoints/` (older ones are deleted). Keep 2 or more so that a damaged
    newest checkpoint has an intact one to fall back to."""
    verify: Literal["size", "sha256"] = "size"
    """What a checkpoint's manifest records and resume checks: every file's size (free), or also
    its SHA-256 (reads every byte at save and at resume; catches silent corruption)."""
    save_model: bool = True
    """Save the final model in Hugging Face format into `model/` in the run folder."""
    at_end: bool = True
    """Save a resumable checkpoint when the run is done. false: benchmarks and throwaway runs keep
    no optimizer state on disk (a 0.5B actor + critic's is 14 GB); rerunning such a finished run
    starts over from its last periodic checkpoint. A stop request (time limit, preemption) still
    checkpoints."""

    def __post_init__(self) -> None:
        require(self.every_steps >= 0, "checkpoint.every_steps", self.every_steps, "use 0 (only at the end) or a positive step count")
        require(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "keep at least 1 checkpoint (2 to survive a damaged one)")


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = 0
    """LoRA rank (peft). 0 trains every weight; > 0 trains low-rank adapters on `target_modules`
    (plus the value head of reward models) and exports the merged model."""
    alpha: float = 16.0
    """LoRA scaling numerator: adapters are scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: str = "all-linear"
    """Modules that get adapters: `all-linear`, or comma-separated module names (q_proj,v_proj)."""
    load_in_4bit: bool = False
    """QLoRA: load the frozen base weights in 4-bit NF4 (bitsandbytes, CUDA GPUs only)."""

    def __post_init__(self) -> None:
        require_finite(self, "lora")
        require(self.rank >= 0, "lora.rank", self.rank, "use 0 (no LoRA) or a positive rank such as 8")
        require(self.alpha > 0, "lora.alpha", self.alpha, "use a positive scale such as 16")
        require(0 <= self.dropout < 1, "lora.dropout", self.dropout, "use a value in [0, 1)")
        if self.load_in_4bit and self.rank == 0:
            raise ConfigError("lora.load_in_4bit: true (QLoRA) trains adapters only: also set lora.rank, e.g. 8")


@dataclass(frozen=True)
class ReferenceConfig:
    path: PathText | None = None
    """Frozen reference model. Unset: the model training starts from (`model.path`)."""
    offload: bool = False
    """Keep the reference's weights in CPU memory between uses (ZeRO-3 parameter offload; needs
    engine.zero_stage=3)."""
    precompute: bool = False
    """Compute the reference log-probs of all training data once before training, then free the
    reference model (saves its memory and forward passes during training)."""


def _task_default(given: int | None, task: TaskConfig, data: DataSourceConfig, attribute: str,
                  default: int) -> int:
    """`given`, or (null) the bundled task's own value (`attribute` of its `BundledTask`) when the
    task applies to a job with `data`, else `default`."""
    if given is not None:
        return given
    name = task.resolve(data)
    return getattr(BUNDLED_TASKS[name], attribute) if name is not None else default


def resolved_new_tokens(given: int | None, task: TaskConfig, data: DataSourceConfig) -> int:
    """`given`, or the bundled task's answer length when it applies, else `DEFAULT_NEW_TOKENS`."""
    return _task_default(given, task, data, "answer_tokens", DEFAULT_NEW_TOKENS)


def resolved_max_length(given: int | None, task: TaskConfig, data: DataSourceConfig) -> int:
    """`given` (`data.max_length`), or the bundled task's sample length when it applies, else
    `DEFAULT_MAX_LENGTH`."""
    return _task_default(given, task, data, "sample_tokens", DEFAULT_MAX_LENGTH)


@dataclass(frozen=True)
class TrainJobConfig:
    """Sections every training job has; each job kind below adds or narrows its own."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to fine-tune."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The bundled task: default data and the task score."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and evaluation data."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batch sizes and length of training."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Training engine (DeepSpeed) settings."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters (LoRA / QLoRA) instead of full fine-tuning."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation during and after training."""
    log: LogConfig = field(default_factory=LogConfig)
    """Metrics, TensorBoard and progress output."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing and resuming."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Deadlines that turn a hung wait into a requeueable exit (4) with the stacks of what hung."""
    rules: RulesConfig = field(default_factory=RulesConfig)
    """Settings of the built-in rules (math, code, format) that eval.metrics (and reward.sources)
    name."""
    seed: int = 1234
    """Seed for model init, data order and dropout."""
    output_dir: PathText = "runs/train"
    """Run folder: config.yaml, metrics.jsonl, TensorBoard files, checkpoints/, model/."""

    derives_mini_batch: ClassVar[bool] = False
    """Whether a null `train.global_batch_size` is derived (ppo, from its rollout)."""
    uses_router_loss: ClassVar[bool] = False
    """Whether the job adds `model.router_aux_loss_coef` x the router loss (sft, ppo)."""

    def __post_init__(self) -> None:
        if self.task.name is None and self.data.train_path is None:
            raise ConfigError("data.train_path: null needs a task for data: set data.train_path or task.name")
        fill_derived(self, "data", max_length=resolved_max_length(self.data.max_length, self.task, self.data))
        if self.model.router_aux_loss_coef and not self.uses_router_loss:
            raise ConfigError(f"model.router_aux_loss_coef: {self.model.router_aux_loss_coef} is used by sft and the ppo "
                              "actor only; use 0 for this job")
        if self.train.global_batch_size is None and not self.derives_mini_batch:
            raise ConfigError("train.global_batch_size: null is derived only for ppo (from its rollout); give the "
                              "samples per optimizer step, e.g. 64")
        fill_derived(self, "eval", max_new_tokens=resolved_new_tokens(self.eval.max_new_tokens, self.task, self.data))
        if self.eval.metrics and not (self.data.eval_path or self.task.resolve(self.data)):
            raise ConfigError(f"eval.metrics: {list(self.eval.metrics)} score answers to held-out prompts, but with "
                              "data.train_path and no data.eval_path (and no bundled task) there are none: set "
                              "data.eval_path to a file of held-out rows")
        if self.eval.metrics and not self.eval.score_prompts:
            raise ConfigError(f"eval.metrics: {list(self.eval.metrics)} score answers to held-out prompts, but "
                              "eval.score_prompts is 0: answer some, e.g. eval.score_prompts=256")
        if self.lora.load_in_4bit and self.engine.zero_stage == 3:
            raise ConfigError("lora.load_in_4bit: 4-bit base weights cannot be sharded by ZeRO-3: "
                              "use engine.zero_stage 0-2 with QLoRA")
