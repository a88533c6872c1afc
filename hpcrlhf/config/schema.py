"""Typed configs: one frozen tree per job kind, defaults only here.

Sections are shared between job kinds (every trainer has `model`, `data`, `optim`, `engine`, ...);
each job kind is one top-level class (`SFTConfig`, `RMConfig`, `DPOConfig`, ...) built on
`TrainJobConfig`.
Recipes (YAML) and `--set section.key=value` override these defaults; see `hpcrlhf.config.loader`.
The string under each field is its documentation (`hpcrlhf config sft` prints it).
"""

from __future__ import annotations

import math
import string
import dataclasses
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Annotated, ClassVar, Literal, Optional

from hpcrlhf.algos.estimators import ADVANTAGE_ESTIMATORS, ESTIMATORS, Estimator
from hpcrlhf.config.loader import NonEmpty
from hpcrlhf.config.stop_rule import parse_stop_rule
from hpcrlhf.errors import ConfigError

PathText = Annotated[str, NonEmpty()]
"""A setting that names a file or folder: the loader refuses an empty value (an unset shell variable)."""


def _require(ok: bool, key: str, value: object, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {_shown(value)} is invalid: {fix}")


def _shown(value: object) -> str:
    """`repr(value)` for a message, cut to 80 characters. An int from a recipe has no size limit,
    and Python refuses to print one of more than 4300 digits (ValueError)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**60:
        return f"<{'minus ' if value < 0 else ''}an integer of {math.floor(math.log10(abs(value))) + 1} digits>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _require_finite(section: object, key: str) -> None:
    """Every float of config dataclass `section` (dotted name `key`) is finite, also inside its
    lists (`optim.betas[1]`) and the sections of its lists (`reward.sources[0].weight`: a source
    does not know its index). Range checks let Inf through (`inf > 0`), fields without one NaN
    too. Called first in the `__post_init__` of each section with float fields, so NaN and Inf get
    this message; nested sections check their own fields."""
    for f in fields(section):
        _require_finite_value(getattr(section, f.name), f"{key}.{f.name}")


def _require_finite_value(value: object, key: str) -> None:
    if isinstance(value, float):
        _require(math.isfinite(value), key, value, "use a finite number")
    elif isinstance(value, tuple):
        for i, item in enumerate(value):
            if is_dataclass(item):
                _require_finite(item, f"{key}[{i}]")
            else:
                _require_finite_value(item, f"{key}[{i}]")


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
        _require_finite(self, "model")
        _require(self.router_aux_loss_coef >= 0, "model.router_aux_loss_coef", self.router_aux_loss_coef,
                 "use 0 (off) or a positive weight, e.g. 0.02")


DEFAULT_TASK = "arithmetic"
"""The bundled task `task.name: auto` applies when no `data.train_path` is given."""


@dataclass(frozen=True)
class TaskConfig:
    name: Optional[str] = "auto"
    """Bundled synthetic task (rule-based score): it supplies the data when `data.train_path` is
    unset, and the task score (`eval/task_score`, the `task` reward rules). `auto`: the arithmetic
    task when `data.train_path` is unset, none when it is set (your data is not scored as
    arithmetic; the run logs which applies). `arithmetic` applies it to your data too (its prompts
    must then be arithmetic questions); null: no task (then `data.train_path` is required)."""
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

    def __post_init__(self) -> None:
        from hpcrlhf.data.tasks import TASKS  # the registry; imported here, it needs no config

        _require_finite(self, "task")
        _require(self.name is None or self.name == "auto" or self.name in TASKS, "task.name", self.name,
                 f"use auto (the default), a bundled task ({', '.join(sorted(TASKS))}), or null to train on "
                 "data.train_path")
        _require(self.max_operand >= 1, "task.max_operand", self.max_operand, "use at least 1, e.g. 99")
        _require(self.train_size >= 1, "task.train_size", self.train_size, "use at least 1 row")
        _require(self.eval_size >= 0, "task.eval_size", self.eval_size, "use 0 (no held-out rows) or more")
        _require(0 <= self.hard_pair_fraction <= 1, "task.hard_pair_fraction", self.hard_pair_fraction,
                 "use a value in [0, 1]")

    def resolve(self, data: "DataSourceConfig") -> Optional[str]:
        """The task that applies to a job with `data`: `name`, with `auto` decided by
        `data.train_path`."""
        if self.name != "auto":
            return self.name
        return None if data.train_path else DEFAULT_TASK


@dataclass(frozen=True)
class DataSourceConfig:
    """Where rows come from and how prompts are tokenised (shared by every job kind's `data`)."""

    train_path: Optional[PathText] = None
    """Training data: a .jsonl/.json/.parquet/.csv file, a folder saved by `datasets`, or a hub
    dataset name (online only). Unset: rows from the bundled task."""
    eval_path: Optional[PathText] = None
    """Held-out data in the same forms. Unset: the task's eval split (or none with a train file)."""
    split: str = "train"
    """Split to read from hub datasets."""
    prompt_key: str = "prompt"
    """Field of each row holding the prompt."""
    apply_chat_template: bool = False
    """Wrap each prompt as a user turn with the tokenizer's chat template."""
    max_length: Optional[int] = None
    """Tokens per sample (prompt + response + EOS); longer samples are truncated (and counted).
    null: the bundled task's (64) when the task applies, else 1024 (`DEFAULT_MAX_LENGTH`)."""
    max_samples: Optional[int] = None
    """Use only the first N training rows."""

    def __post_init__(self) -> None:
        _require(self.max_length is None or self.max_length >= 8, "data.max_length", self.max_length,
                 "use at least 8 tokens, or null for the task's default")
        _require(self.max_samples is None or self.max_samples >= 1, "data.max_samples", self.max_samples,
                 "use at least 1 row, or null for all of them")


@dataclass(frozen=True)
class DataConfig(DataSourceConfig):
    """(prompt, response) rows for supervised fine-tuning."""

    response_key: str = "response"
    """Field of each row holding the target response."""
    packing: bool = False
    """Pack several samples into each row of `max_length` tokens, with attention and positions
    restarting at every sample boundary."""


@dataclass(frozen=True)
class PairDataConfig(DataSourceConfig):
    """(prompt, chosen, rejected) preference pairs (reward model, DPO)."""

    chosen_key: str = "chosen"
    """Field of each row holding the preferred response."""
    rejected_key: str = "rejected"
    """Field of each row holding the dispreferred response."""
    margin_key: Optional[str] = None
    """Field holding a numeric preference margin (how much better chosen is). Reward model: the
    loss becomes -log sigmoid(r_chosen - r_rejected - margin) (Llama 2). Unset: no margin."""


@dataclass(frozen=True)
class UnpairedDataConfig(DataSourceConfig):
    """(prompt, completion, label) rows with a desirable/undesirable label each (KTO)."""

    completion_key: str = "completion"
    """Field of each row holding the completion."""
    label_key: str = "label"
    """Field holding true (desirable) or false (undesirable)."""


@dataclass(frozen=True)
class CSFTDataConfig(DataConfig):
    """(prompt, response, reward) rows for conditional SFT."""

    reward_key: str = "reward"
    """Field holding each response's numeric reward (score), written into the prompt as a bucket."""


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
        _require_finite(self, "optim")
        _require(0 < self.lr < math.inf, "optim.lr", self.lr, "the learning rate must be a finite number > 0")
        _require(all(0 <= b < 1 for b in self.betas) and len(self.betas) == 2, "optim.betas", list(self.betas),
                 "use two numbers in [0, 1), e.g. [0.9, 0.95]")
        _require(0 <= self.eps < math.inf, "optim.eps", self.eps, "use a small finite number >= 0, e.g. 1e-8")
        _require(0 <= self.weight_decay < math.inf, "optim.weight_decay", self.weight_decay, "use a finite number >= 0")
        _require(0 <= self.warmup_ratio < 1, "optim.warmup_ratio", self.warmup_ratio, "use a value in [0, 1)")
        _require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "use a value in [0, 1]")
        _require(self.max_grad_norm >= 0, "optim.max_grad_norm", self.max_grad_norm, "use >= 0 (0 disables)")


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


def _require_timeout(value: float, key: str) -> None:
    _require_finite_value(value, key)
    _require(value > 0, key, value, "use a positive number of seconds, e.g. 300")


def largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of `n` (>= 1) that is at most `cap`."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


MAX_STEPS = 2**31 - 1
"""The most optimizer steps (or PPO steps, or epochs) a run may ask for: step counters and the learning-rate
schedule (warm-up and decay computed in float64 from step counts) stay exact, and at one step a second it is
68 years. A larger count is a typo, refused rather than run in warm-up forever."""


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 1
    """Passes over the training data (ignored when `max_steps` is set)."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (takes precedence over `epochs`)."""
    global_batch_size: Optional[int] = 64
    """Samples (packed rows with packing) per optimizer step, summed over all data-parallel ranks.
    ppo: sequences per optimizer step (the mini-batch); null (its default) derives it from the
    rollout: the largest divisor of its sequences (rollout.prompts_per_step x samples_per_prompt)
    that is at most 64, so changing the rollout size alone never breaks the batch."""
    micro_batch_size: Optional[int] = None
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
        _require(1 <= self.epochs <= MAX_STEPS, "train.epochs", self.epochs, f"use 1 to {MAX_STEPS:,} (2**31 - 1)")
        _require(self.max_consecutive_skips >= 0, "train.max_consecutive_skips", self.max_consecutive_skips,
                 "use >= 0 (0 stops at the first skipped step)")
        _require(self.max_steps is None or 1 <= self.max_steps <= MAX_STEPS, "train.max_steps", self.max_steps,
                 f"use 1 to {MAX_STEPS:,} (2**31 - 1: the schedule's step counts stay exact), or null")
        _require(self.global_batch_size is None or self.global_batch_size >= 1, "train.global_batch_size",
                 self.global_batch_size, "use at least 1")
        _require(self.micro_batch_size is None or self.micro_batch_size >= 1, "train.micro_batch_size",
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


def _require_metrics(metrics: tuple[str, ...], key: str) -> None:
    """Metrics are `package.module:function`s with distinct function names (each is reported under
    its function's name); importing them is the job's business (hpcrlhf.rewards)."""
    seen: dict[str, str] = {}
    for i, rule in enumerate(metrics):
        module, sep, name = rule.partition(":")
        _require(bool(sep and module and name.isidentifier()), f"{key}[{i}]", rule,
                 "use package.module:function, a function of (prompt, response, row) returning a number")
        if name in seen:
            raise ConfigError(f"{key}[{i}]: {rule!r} and {seen[name]!r} would both be reported as eval/{name}; "
                              "wrap one in a function of another name")
        seen[name] = rule


@dataclass(frozen=True)
class EvalConfig:
    every_steps: int = 50
    """Evaluate (held-out loss and task score) every N optimizer steps, and at the end (0: only at
    the end)."""
    max_new_tokens: Optional[int] = None
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
    """Your own metrics of the greedy answers to the held-out prompts: `package.module:function`s
    taking (prompt, response, row) and returning a real number, like reward rules (the row is the
    prompt's row of `data.eval_path`). Each is reported as `eval/<function name>` (mean over the
    prompts) in metrics.jsonl, summary.json and the log, and can end the run (`stop_when`)."""
    metric_timeout_s: float = DEFAULT_USER_CODE_TIMEOUT_S
    """Longest one call of a metric (or the task score) may take, in seconds; past it the run fails
    naming the metric (a metric that never returns would hang the job)."""

    def __post_init__(self) -> None:
        _require_finite(self, "eval")
        _require_metrics(self.metrics, "eval.metrics")
        _require_timeout(self.metric_timeout_s, "eval.metric_timeout_s")
        _require(self.every_steps >= 0, "eval.every_steps", self.every_steps, "use 0 (only at the end) or a step count")
        if parse_stop_rule(self.stop_when) is not None and self.every_steps == 0:
            raise ConfigError(f"eval.stop_when: {self.stop_when!r} is checked at periodic evaluations, but "
                              "eval.every_steps is 0 (only at the end): set eval.every_steps to a step count, e.g. 50")
        _require(self.max_new_tokens is None or self.max_new_tokens >= 1, "eval.max_new_tokens", self.max_new_tokens,
                 "use at least 1, or null for the task's default")
        _require(self.score_prompts >= 0, "eval.score_prompts", self.score_prompts, "use 0 (no task score) or more")
        _require(self.batch_size >= 1, "eval.batch_size", self.batch_size, "use at least 1")


@dataclass(frozen=True)
class LogConfig:
    every_steps: int = 10
    """Write train metrics every N optimizer steps."""
    tensorboard: bool = True
    """Also write TensorBoard event files into the run folder."""
    progress: bool = True
    """Show a progress bar (rank 0) with rate and ETA."""
    third_party: Literal["file", "console"] = "file"
    """Where the libraries' own output goes (transformers, DeepSpeed, vLLM and its engine processes,
    Ray, torch, Python warnings): `file`: the run folder's `third_party.log`, their errors also on the
    terminal; `console`: the terminal, as they print it. HPCRLHF_VERBOSE=1 shows it on the terminal
    for any command."""

    def __post_init__(self) -> None:
        _require(self.every_steps >= 1, "log.every_steps", self.every_steps, "use at least 1 (every step)")


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
        _require(self.every_steps >= 0, "checkpoint.every_steps", self.every_steps, "use 0 (only at the end) or a positive step count")
        _require(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "keep at least 1 checkpoint (2 to survive a damaged one)")


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
        _require_finite(self, "lora")
        _require(self.rank >= 0, "lora.rank", self.rank, "use 0 (no LoRA) or a positive rank such as 8")
        _require(self.alpha > 0, "lora.alpha", self.alpha, "use a positive scale such as 16")
        _require(0 <= self.dropout < 1, "lora.dropout", self.dropout, "use a value in [0, 1)")
        if self.load_in_4bit and self.rank == 0:
            raise ConfigError("lora.load_in_4bit: true (QLoRA) trains adapters only: also set lora.rank, e.g. 8")


@dataclass(frozen=True)
class ReferenceConfig:
    path: Optional[PathText] = None
    """Frozen reference model. Unset: the model training starts from (`model.path`)."""
    offload: bool = False
    """Keep the reference's weights in CPU memory between uses (ZeRO-3 parameter offload; needs
    engine.zero_stage=3)."""
    precompute: bool = False
    """Compute the reference log-probs of all training data once before training, then free the
    reference model (saves its memory and forward passes during training)."""


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
        _resolve_data_length(self)
        if self.model.router_aux_loss_coef and not self.uses_router_loss:
            raise ConfigError(f"model.router_aux_loss_coef: {self.model.router_aux_loss_coef} is used by sft and the ppo "
                              "actor only; use 0 for this job")
        if self.train.global_batch_size is None and not self.derives_mini_batch:
            raise ConfigError("train.global_batch_size: null is derived only for ppo (from its rollout); give the "
                              "samples per optimizer step, e.g. 64")
        _resolve(self, "eval", max_new_tokens=resolved_new_tokens(self.eval.max_new_tokens, self.task, self.data))
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


@dataclass(frozen=True)
class SFTConfig(TrainJobConfig):
    """Supervised fine-tuning: next-token loss on the response tokens of (prompt, response) rows."""

    uses_router_loss: ClassVar[bool] = True
    output_dir: PathText = "runs/sft"
    """Run folder: config.yaml, metrics.jsonl, TensorBoard files, checkpoints/, model/."""


@dataclass(frozen=True)
class RMConfig(TrainJobConfig):
    """Reward model: the backbone plus a scalar value head, trained on preference pairs with the
    Bradley-Terry loss -log sigmoid(r_chosen - r_rejected [- margin])."""

    data: PairDataConfig = field(default_factory=PairDataConfig)
    """Preference pairs for training and evaluation."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(global_batch_size=32))
    """Batch sizes (in pairs) and length of training."""
    output_dir: PathText = "runs/rm"
    """Run folder; `model/` holds the reward model with its reward mean/std in config.json."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eval.metrics:
            raise ConfigError(f"eval.metrics: {list(self.eval.metrics)} score generated answers, and a reward model "
                              "generates none (it is evaluated on pairs): remove eval.metrics, or report them from the "
                              "policy's jobs (sft, dpo, kto, csft, ppo, rs, generate)")


@dataclass(frozen=True)
class PolicyJobConfig(TrainJobConfig):
    """Jobs that train a policy against a frozen reference model (DPO, KTO)."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-4))
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(global_batch_size=32))
    """Batch sizes (in pairs or samples) and length of training."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """The frozen reference model."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reference.offload and self.engine.zero_stage != 3:
            raise ConfigError("reference.offload: true keeps reference weights in CPU memory through ZeRO-3: "
                              "set engine.zero_stage=3, or reference.precompute=true to drop the reference model "
                              "after one pass")


@dataclass(frozen=True)
class DPOLossConfig:
    loss: Literal["dpo", "ipo", "cdpo"] = "dpo"
    """dpo: -log sigmoid(beta h) (Rafailov et al. 2023); ipo: (h - 1/(2 beta))^2 on
    token-averaged log-probs (Azar et al. 2023); cdpo: DPO with label smoothing (noisy labels)."""
    beta: float = 0.1
    """Strength of the implicit KL constraint to the reference (larger: stay closer)."""
    label_smoothing: float = 0.0
    """cdpo only: assumed probability that a pair's label is flipped, in [0, 0.5)."""
    nll_coef: float = 0.0
    """Add this times the chosen responses' mean token NLL to the loss (0: pure preference loss)."""

    def __post_init__(self) -> None:
        _require_finite(self, "dpo")
        _require(self.beta > 0, "dpo.beta", self.beta, "use a positive value such as 0.1")
        _require(self.nll_coef >= 0, "dpo.nll_coef", self.nll_coef, "use >= 0")
        if self.loss == "cdpo":
            _require(0 <= self.label_smoothing < 0.5, "dpo.label_smoothing", self.label_smoothing, "use a value in [0, 0.5)")
        elif self.label_smoothing:
            raise ConfigError(f"dpo.label_smoothing: {self.label_smoothing} only applies to dpo.loss=cdpo; "
                              "set dpo.loss=cdpo, or label_smoothing=0")


@dataclass(frozen=True)
class DPOConfig(PolicyJobConfig):
    """Direct preference optimisation (DPO, IPO, cDPO) against a frozen reference model."""

    data: PairDataConfig = field(default_factory=PairDataConfig)
    """Preference pairs for training and evaluation."""
    dpo: DPOLossConfig = field(default_factory=DPOLossConfig)
    """The preference loss."""
    output_dir: PathText = "runs/dpo"
    """Run folder: config.yaml, metrics.jsonl, TensorBoard files, checkpoints/, model/."""


@dataclass(frozen=True)
class KTOLossConfig:
    beta: float = 0.1
    """Strength of the implicit KL constraint to the reference."""
    desirable_weight: float = 1.0
    """Weight of desirable samples' losses (lambda_D)."""
    undesirable_weight: float = 1.0
    """Weight of undesirable samples' losses (lambda_U). The KTO paper recommends
    desirable_weight * n_desirable / (undesirable_weight * n_undesirable) in [1, 4/3]."""

    def __post_init__(self) -> None:
        _require_finite(self, "kto")
        _require(self.beta > 0, "kto.beta", self.beta, "use a positive value such as 0.1")
        _require(self.desirable_weight >= 0, "kto.desirable_weight", self.desirable_weight, "use >= 0")
        _require(self.undesirable_weight >= 0, "kto.undesirable_weight", self.undesirable_weight, "use >= 0")


@dataclass(frozen=True)
class KTOConfig(PolicyJobConfig):
    """Kahneman-Tversky optimisation on unpaired desirable/undesirable samples (Ethayarajh et al.
    2024), with the reference point estimated on mismatched (prompt, completion) pairs."""

    data: UnpairedDataConfig = field(default_factory=UnpairedDataConfig)
    """Labelled (prompt, completion) rows for training and evaluation."""
    kto: KTOLossConfig = field(default_factory=KTOLossConfig)
    """The KTO loss."""
    output_dir: PathText = "runs/kto"
    """Run folder: config.yaml, metrics.jsonl, TensorBoard files, checkpoints/, model/."""


@dataclass(frozen=True)
class CSFTSectionConfig:
    num_buckets: int = 2
    """Rewards are cut into this many equal-width buckets over the training rewards' range;
    bucket num_buckets-1 is the best. The bucket is what the model is conditioned on."""
    template: str = "<score {bucket}> {prompt}"
    """How the bucket is written into the prompt ({bucket} and {prompt} are filled in)."""

    def __post_init__(self) -> None:
        _require(self.num_buckets >= 2, "csft.num_buckets", self.num_buckets, "use at least 2")
        problem = _template_problem(self.template, {"bucket": 0, "prompt": "12+34="})
        _require(problem is None, "csft.template", self.template, f"{problem}; the template must contain both {{bucket}} "
                 "and {prompt}, and write a literal brace as {{ or }}")


def _template_problem(template: str, sample: dict[str, object]) -> str | None:
    """Why `template.format(**sample)` would fail or leave out one of `sample`'s names, or None.

    Checked when the config loads: the template is only filled in once the data is, and a stray
    `{x}` or `{` would then escape as a KeyError or ValueError from `str.format`.
    """
    try:
        used = {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    except ValueError as e:  # a lone `{` or `}`
        return str(e)
    unknown = sorted(used - set(sample))
    if unknown:
        return f"unknown placeholder {{{unknown[0]}}}"
    missing = [name for name in sample if name not in used]
    if missing:
        return f"no {{{missing[0]}}} placeholder"
    try:
        template.format(**sample)
    except (ValueError, TypeError) as e:  # a bad format spec, e.g. {bucket:q}
        return str(e)
    return None


@dataclass(frozen=True)
class CSFTConfig(TrainJobConfig):
    """Conditional SFT (decision-transformer style): each response's reward bucket is written into
    its prompt, so generation conditioned on the top bucket asks for the best behaviour."""

    data: CSFTDataConfig = field(default_factory=CSFTDataConfig)
    """(prompt, response, reward) rows for training and evaluation."""
    csft: CSFTSectionConfig = field(default_factory=CSFTSectionConfig)
    """How rewards become conditions."""
    output_dir: PathText = "runs/csft"
    """Run folder; `model/csft.json` records the template and buckets for generation."""


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
    max_new_tokens: Optional[int] = None
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
    vllm_enforce_eager: Optional[bool] = None
    """vllm only: skip graph capture / compilation. null: eager on CPU (capture gains nothing there
    and costs minutes at start), CUDA graphs on GPU (without them decoding is launch-bound: ~22 ms
    per token step for 64 sequences of a 0.5B model on an H100, no faster than HF generate)."""
    vllm_max_num_seqs: Optional[int] = None
    """vllm only: most sequences the engine runs at once (vLLM's max_num_seqs; null: vLLM's
    default, 256 per TP rank on CPU, 256-1024 on GPU). Lower it when the KV cache is small."""
    vllm_max_num_batched_tokens: Optional[int] = None
    """vllm only: tokens the engine computes per step (vLLM's max_num_batched_tokens; null: vLLM's
    default, 4096 per TP rank on CPU, 8192-16384 on GPU, raised to the longest sequence without
    chunked prefill)."""
    vllm_chunked_prefill: Optional[bool] = None
    """vllm only: split long prompts over engine steps. null: off on CPU (vLLM 0.32 cannot rewind a
    CPU random generator after a split prompt and dies with seeded sampling; true is refused
    there), vLLM's default (on) on GPU."""
    max_staleness: int = 0
    """ppo only: 0 generates each step's rollout with the weights of the step before (synchronous);
    1 overlaps: the engines generate step n+1's rollout -- with the weights step n starts from, one
    update behind -- while the roles score and train on step n (the Ray runtime's engines then stop
    idling during training; engines that generate in the training process gain nothing but keep
    the same samples). The PPO ratio is taken against the log-probs of the weights being trained
    (recomputed), `rollout/logprob_max_diff` shows how far the generating weights were; see
    ppo.tis_cap. Checkpoints keep the rollout generated ahead, so a resumed run (after a stop signal
    too) equals an uninterrupted one. Logged: rollout/staleness, timing/overlap (seconds generation
    ran while the step trained)."""

    def __post_init__(self) -> None:
        _require_finite(self, "rollout")
        _require(self.prompts_per_step >= 1, "rollout.prompts_per_step", self.prompts_per_step, "use at least 1")
        _require(self.samples_per_prompt >= 1, "rollout.samples_per_prompt", self.samples_per_prompt, "use at least 1")
        _require(self.temperature > 0, "rollout.temperature", self.temperature,
                 "use a positive temperature (sampling is what makes on-policy RL explore)")
        _require(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "use a value in (0, 1]")
        _require(self.top_k >= 0, "rollout.top_k", self.top_k, "use 0 (off) or a positive k")
        _require(self.max_new_tokens is None or self.max_new_tokens >= 1, "rollout.max_new_tokens",
                 self.max_new_tokens, "use at least 1, or null for the task's default")
        if self.max_new_tokens is not None:  # null is resolved by the job's config (resolved_new_tokens)
            _require(0 <= self.min_new_tokens <= self.max_new_tokens, "rollout.min_new_tokens", self.min_new_tokens,
                     f"use a value from 0 to rollout.max_new_tokens ({_shown(self.max_new_tokens)})")
        _require(self.hf_batch_size >= 1, "rollout.hf_batch_size", self.hf_batch_size, "use at least 1")
        _require(self.max_staleness in (0, 1), "rollout.max_staleness", self.max_staleness,
                 "use 0 (synchronous) or 1 (the next rollout generated during the current step's training); more "
                 "steps ahead are not supported")
        _require(self.vllm_kv_cache_gb > 0, "rollout.vllm_kv_cache_gb", self.vllm_kv_cache_gb, "use a positive size")
        for name in ("vllm_max_num_seqs", "vllm_max_num_batched_tokens"):
            value = getattr(self, name)
            _require(value is None or value >= 1, f"rollout.{name}", value, "use null (vLLM's default) or at least 1")
        if self.vllm_max_num_seqs is not None and self.vllm_max_num_batched_tokens is not None:
            _require(self.vllm_max_num_batched_tokens >= self.vllm_max_num_seqs, "rollout.vllm_max_num_batched_tokens",
                     self.vllm_max_num_batched_tokens,
                     f"use at least rollout.vllm_max_num_seqs ({_shown(self.vllm_max_num_seqs)}): each running sequence "
                     "needs one token per step")


@dataclass(frozen=True)
class RewardSourceConfig:
    model: Optional[PathText] = None
    """A reward model folder (from `hpcrlhf train rm`, or any one-label sequence classifier)."""
    rule: Optional[str] = None
    """A rule-based reward instead: `task` (the bundled task's exact score, 1 or 0),
    `task_partial` (share of digits right), or `package.module:function` taking
    (prompt, response, row) and returning a float."""
    weight: float = 1.0
    """This source's weight in the weighted sum of all sources."""
    normalize: bool = True
    """model only: standardise with the reward mean/std stored in the model's config.json."""

    def __post_init__(self) -> None:
        if (self.model is None) == (self.rule is None):
            raise ConfigError(f"reward.sources: each source sets exactly one of `model` (a reward model folder) "
                              f"or `rule` (task, task_partial or module:function); got model={self.model!r}, "
                              f"rule={self.rule!r}")


TASK_RULES = ("task", "task_partial")
"""Rules that score answers to the bundled task; any other rule is `package.module:function`."""


def _task_default(given: Optional[int], task: TaskConfig, data: "DataSourceConfig", attribute: str,
                  default: int) -> int:
    """`given`, or (null) the bundled task's own value (`attribute` of its class) when the task
    applies to a job with `data`, else `default`."""
    if given is not None:
        return given
    from hpcrlhf.data.tasks import TASKS

    name = task.resolve(data)
    return getattr(TASKS[name], attribute) if name is not None else default


def resolved_new_tokens(given: Optional[int], task: TaskConfig, data: "DataSourceConfig") -> int:
    """`given`, or the bundled task's answer length when it applies, else `DEFAULT_NEW_TOKENS`."""
    return _task_default(given, task, data, "answer_tokens", DEFAULT_NEW_TOKENS)


def _resolve_data_length(cfg) -> None:
    """A null `data.max_length`: the bundled task's sample length when it applies, else
    `DEFAULT_MAX_LENGTH`."""
    _resolve(cfg, "data", max_length=_task_default(cfg.data.max_length, cfg.task, cfg.data, "sample_tokens",
                                                   DEFAULT_MAX_LENGTH))


def _resolve(cfg, section: str, **values) -> None:
    """Fill derived values into a section of a config being built (its `__post_init__`): the section
    is rebuilt (and checked again) with them; values equal to the section's are left alone."""
    current = getattr(cfg, section)
    changed = {k: v for k, v in values.items() if getattr(current, k) != v}
    if changed:
        object.__setattr__(cfg, section, dataclasses.replace(current, **changed))


def _require_task_for_rules(reward: Optional["RewardConfig"], task: TaskConfig, data: DataSourceConfig) -> None:
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
    clip: Optional[float] = None
    """Clip each combined score to [-clip, clip] (null: no clipping)."""
    running_norm: bool = False
    """Standardise scores with their running mean and std over all rollouts so far."""
    missing_eos_penalty: Optional[float] = None
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
    rule_timeout_s: float = DEFAULT_USER_CODE_TIMEOUT_S
    """Longest one call of a rule may take, in seconds; past it the run fails naming the rule (a rule
    that never returns would hang the job)."""

    def __post_init__(self) -> None:
        _require_finite(self, "reward")
        _require_timeout(self.rule_timeout_s, "reward.rule_timeout_s")
        _require(len(self.sources) >= 1, "reward.sources", list(self.sources), "give at least one reward model or rule")
        _require(self.clip is None or self.clip > 0, "reward.clip", self.clip, "use a positive bound, or null")
        _require(self.length_penalty >= 0, "reward.length_penalty", self.length_penalty, "use >= 0")
        _require(self.overlong_buffer >= 0, "reward.overlong_buffer", self.overlong_buffer,
                 "use 0 (off) or a number of tokens below rollout.max_new_tokens")
        _require(self.overlong_penalty >= 0, "reward.overlong_penalty", self.overlong_penalty, "use >= 0")
        _require(self.batch_size >= 1, "reward.batch_size", self.batch_size, "use at least 1")


@dataclass(frozen=True)
class CriticConfig:
    path: Optional[PathText] = None
    """Model the critic starts from. Unset: the first reward model in reward.sources (head kept),
    else the actor's model.path (a new value head)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, scheduler="constant", warmup_ratio=0.0))
    """The critic's optimizer and schedule."""


@dataclass(frozen=True)
class PPOSectionConfig:
    advantage_estimator: Literal[ADVANTAGE_ESTIMATORS] = "gae"
    """gae: a critic and GAE (PPO); grpo: group-normalised scores (Shao et al. 2024); dr_grpo:
    group-centred scores, no std division (Liu et al. 2025; pair it with
    ppo.loss_aggregation=seq-mean-token-sum, the paper's constant normaliser); rloo: leave-one-out
    baseline (Ahmadian et al. 2024); reinforce++: globally whitened returns (Hu 2025);
    reinforce_baseline: score minus its prompt's mean, whitened over the batch (OpenRLHF). All but
    gae need no critic; grpo, dr_grpo, rloo and reinforce_baseline need
    rollout.samples_per_prompt >= 2."""
    epochs: int = 1
    """Passes over each rollout's experience (mini-batches of train.global_batch_size sequences)."""
    clip_eps: float = 0.2
    """Clip the probability ratio to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: Optional[float] = None
    """Upper clip range (null: clip_eps); a larger value lets rare good tokens grow (DAPO)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """token: PPO's per-token probability ratio; sequence: GSPO (Zheng et al. 2025), one ratio per
    response (the geometric mean of its token ratios) clipped as a whole -- use it with a
    sequence-level estimator (grpo, dr_grpo, rloo), clip ranges like the paper's (clip_eps 3e-4,
    clip_eps_high 4e-4) and loss_aggregation seq-mean-token-mean."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (Ye et al. 2020)."""
    value_clip: Optional[float] = 0.2
    """Clip the critic's new values to old +- value_clip in the value loss (null: no clipping)."""
    gamma: float = 1.0
    """Discount factor over response tokens."""
    lam: float = 0.95
    """GAE lambda (bias/variance trade-off of the advantages)."""
    whiten_advantages: bool = True
    """Standardise advantages over the rollout (gae, rloo, reinforce_baseline; reinforce++ always does)."""
    entropy_coef: float = 0.0
    """Bonus on the policy's token entropy (0: none)."""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How token losses become the batch loss: mean over all tokens, mean over sequences of their
    token mean, or sum over each sequence's tokens divided by the number of sequences."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token KL(actor || reference) estimate: k1 log-ratio, k2 half squared log-ratio, k3
    exp(-r) - 1 + r (non-negative, unbiased)."""
    init_kl_coef: float = 0.05
    """Coefficient of the KL penalty subtracted from the per-token rewards (0: none)."""
    kl_target: Optional[float] = None
    """Adaptive KL controller target per sequence (Ziegler et al. 2019); null: fixed coefficient."""
    kl_horizon: int = 10000
    """Adaptive KL controller horizon, in sequences."""
    kl_loss_coef: float = 0.0
    """Coefficient of a KL term added to the policy loss instead (GRPO style, with kl_estimator)."""
    buffer_limit: int = 0
    """Replay buffer size in sequences: 0 keeps only the latest rollout; more also replays older
    experience (its importance ratio uses the log-probs it was generated with)."""
    freeze_actor_steps: int = 0
    """Train only the critic for the first N steps (warms the value estimates up)."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling (Yao et al. 2025): weight each token's policy loss by
    min(pi_old / pi_rollout, tis_cap), pi_rollout the rollout engine's log-prob of the token (it
    differs from the trainer's recomputation by the engine's numerics -- bf16 vLLM on GPU -- and,
    with rollout.max_staleness 1, by the update the generating weights missed). null: off; 2 is
    usual. Logged: rollout/is_weight (mean), rollout/is_truncated (share of tokens at the cap)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025): drop every prompt whose samples all got the same
    score (a group-relative estimator learns nothing from it) and refill the step with the groups of
    further prompts, generated in more rounds, until the step has rollout.prompts_per_step
    informative prompts. Needs rollout.samples_per_prompt >= 2. Logged: rollout/generation_rounds,
    rollout/dropped_groups, rollout/extra_samples, rollout/uninformative_kept."""
    dynamic_sampling_max_rounds: int = 4
    """Generation rounds per step at most (the first included); a step still short of informative
    prompts after them is filled with dropped ones (counted in rollout/uninformative_kept) rather
    than stopping the run."""

    def __post_init__(self) -> None:
        _require_finite(self, "ppo")
        _require(self.dynamic_sampling_max_rounds >= 1, "ppo.dynamic_sampling_max_rounds",
                 self.dynamic_sampling_max_rounds, "use at least 1 (the step's first round)")
        _require(self.tis_cap is None or self.tis_cap >= 1, "ppo.tis_cap", self.tis_cap,
                 "use null (off) or a cap >= 1 such as 2 (a cap below 1 would down-weight every token)")
        _require(self.epochs >= 1, "ppo.epochs", self.epochs, "use at least 1")
        _require(0 < self.clip_eps < 1, "ppo.clip_eps", self.clip_eps, "use a value in (0, 1), typically 0.2")
        _require(self.clip_eps_high is None or self.clip_eps_high > 0, "ppo.clip_eps_high", self.clip_eps_high,
                 "use a positive value, or null")
        _require(self.dual_clip is None or self.dual_clip > 1, "ppo.dual_clip", self.dual_clip, "use c > 1 (e.g. 3), or null")
        _require(self.value_clip is None or self.value_clip > 0, "ppo.value_clip", self.value_clip, "use > 0, or null")
        _require(0 <= self.gamma <= 1, "ppo.gamma", self.gamma, "use a value in [0, 1]")
        _require(0 <= self.lam <= 1, "ppo.lam", self.lam, "use a value in [0, 1]")
        _require(self.init_kl_coef >= 0, "ppo.init_kl_coef", self.init_kl_coef, "use >= 0")
        _require(self.kl_loss_coef >= 0, "ppo.kl_loss_coef", self.kl_loss_coef, "use >= 0")
        _require(self.kl_target is None or self.kl_target > 0, "ppo.kl_target", self.kl_target, "use > 0, or null")
        _require(self.kl_horizon >= 1, "ppo.kl_horizon", self.kl_horizon, "use at least 1")
        _require(self.entropy_coef >= 0, "ppo.entropy_coef", self.entropy_coef, "use >= 0")
        _require(self.buffer_limit >= 0, "ppo.buffer_limit", self.buffer_limit, "use 0 (latest rollout only) or more")
        _require(self.freeze_actor_steps >= 0, "ppo.freeze_actor_steps", self.freeze_actor_steps, "use >= 0")

    @property
    def estimator(self) -> Estimator:
        return ESTIMATORS[self.advantage_estimator]

    @property
    def uses_critic(self) -> bool:
        return self.estimator.needs_critic

    @property
    def uses_reference(self) -> bool:
        """A KL term (reward penalty or loss) needs the reference's log-probs."""
        return self.init_kl_coef > 0 or self.kl_loss_coef > 0


PlacementRole = Literal["actor", "critic", "ref", "reward", "vllm"]
PLACEMENT_ROLES: tuple[str, ...] = ("actor", "critic", "ref", "reward", "vllm")
"""Roles a node map places, in placement order (vLLM engines last)."""


@dataclass(frozen=True)
class RoleConfig:
    """GPUs of one model role in the node map, and its DeepSpeed settings where they differ from
    the job's `engine` section."""

    nodes: int = 1
    """Nodes the role spans; it takes `gpus_per_node` GPUs on each (0: the role gets no GPUs)."""
    gpus_per_node: int = 1
    """GPUs the role takes on each of its nodes; its data-parallel ranks are nodes x gpus_per_node
    (0: the role gets no GPUs)."""
    zero_stage: Optional[Literal[0, 1, 2, 3]] = None
    """This role's ZeRO stage (null: engine.zero_stage)."""
    offload_optimizer: Optional[bool] = None
    """Keep this role's optimizer states in CPU memory (null: engine.offload_optimizer). Trained
    roles (actor, critic) only."""
    offload_params: Optional[bool] = None
    """Keep this role's weights in CPU memory between uses, ZeRO-3 only (null: actor and critic
    engine.offload_params, ref reference.offload, reward false)."""
    sleep: bool = False
    """Trained roles (actor, critic) with vLLM engines: while the engines generate, move this
    role's DeepSpeed states (weights, gradients, optimizer) to CPU memory and back for scoring and
    training (DeepSpeed offload_states), so engines colocated with it can use that memory
    (`hpcrlhf plan` shows the memory of each phase). On GPUs only: on CPU the states are in CPU
    memory already and this is a no-op. Not with offload_params (those weights never are on the GPU)."""

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class VLLMPlacementConfig:
    engines: int = 0
    """vLLM engines generating rollouts (rollout.backend=vllm needs at least one; hf none)."""
    tensor_parallel_size: int = 1
    """GPUs per engine, all on one node (tensor parallelism needs the fast links inside a node)."""
    gpu_memory_utilization: float = 0.9
    """Share of each of its GPUs' memory an engine claims for weights and KV cache. Colocated with
    trained roles it must leave them room (e.g. 0.3-0.5)."""
    max_restarts: int = 0
    """Engines that die mid-run (their node still up) restarted within the job, in all: the new
    engine starts on the same GPUs, takes the actor's current weights and redoes its share of the
    step, so no sample is lost or changed. 0, or once used up: the run ends as a lost worker (exit
    4) and a requeued job resumes from the last checkpoint."""
    weight_sync: Literal["collective", "object_store"] = "collective"
    """How the actor's weights reach the engines after each update (Ray runtime). collective: one
    process group of actor rank 0 and every engine worker (NCCL on GPUs, gloo on CPU), the
    weights streamed in buckets out of the actor's (ZeRO-3: gathered chunk by chunk) and loaded
    layer by layer as they arrive. object_store: the whole state dict gathered on actor rank 0,
    put in Ray's object store and loaded by each engine from there (the fallback)."""
    sync_bucket_mb: int = 256
    """Collective weight sync: the most megabytes broadcast at once (bigger tensors go alone)."""
    sleep: bool = False
    """Between rollouts the engines release their GPU memory (vLLM sleep mode, level 1: weights to
    CPU memory, KV cache dropped) for the roles colocated with them to score and train in; they wake
    for the weight sync (weights first, the KV cache once the trained roles sleep again, see
    placement.<role>.sleep). Needs a platform with vLLM sleep mode (CUDA, ROCm, XPU): on CPU a
    no-op. Not with rollout.max_staleness 1 (the engines then generate while the roles train)."""

    def __post_init__(self) -> None:
        _require_finite(self, "placement.vllm")
        _require(self.sync_bucket_mb >= 1, "placement.vllm.sync_bucket_mb", self.sync_bucket_mb,
                 "use at least 1 (megabytes per broadcast)")
        _require(self.max_restarts >= 0, "placement.vllm.max_restarts", self.max_restarts,
                 "use 0 (a dead engine ends the run) or more restarts")
        _require(self.engines >= 0, "placement.vllm.engines", self.engines, "use 0 (no vLLM) or more engines")
        _require(self.tensor_parallel_size >= 1, "placement.vllm.tensor_parallel_size", self.tensor_parallel_size,
                 "use at least 1 GPU per engine")
        _require(0 < self.gpu_memory_utilization <= 1, "placement.vllm.gpu_memory_utilization",
                 self.gpu_memory_utilization, "use a share in (0, 1], e.g. 0.9 alone on its GPUs")


@dataclass(frozen=True)
class PlacementConfig:
    """Where each role of a PPO job runs on the allocation (nodes x GPUs), for the Ray runtime.
    `hpcrlhf plan RECIPE` prints the resulting node map and rejects layouts that cannot work.
    The defaults fit one GPU: actor, critic and reference share it (reward models and vLLM
    engines join it once given GPUs)."""

    nodes: int = 1
    """Nodes of the allocation the job asks for (`hpcrlhf plan --nodes` overrides)."""
    gpus_per_node: int = 1
    """GPUs per node of the allocation (`hpcrlhf plan --gpus-per-node` overrides)."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GiB, for the memory check."""
    actor: RoleConfig = field(default_factory=RoleConfig)
    """The trained policy."""
    critic: RoleConfig = field(default_factory=RoleConfig)
    """The value model (ppo.advantage_estimator gae; give it no GPUs otherwise)."""
    ref: RoleConfig = field(default_factory=RoleConfig)
    """The frozen reference model (ppo.init_kl_coef or kl_loss_coef > 0; no GPUs otherwise)."""
    reward: RoleConfig = field(default_factory=lambda: RoleConfig(gpus_per_node=0))
    """Every reward model of reward.sources, together (no GPUs when all sources are rules)."""
    vllm: VLLMPlacementConfig = field(default_factory=VLLMPlacementConfig)
    """The vLLM rollout engines."""
    colocate: tuple[tuple[PlacementRole, ...], ...] = (("actor", "critic", "ref", "reward", "vllm"),)
    """Groups of roles that share the same GPUs, e.g. [[actor, ref], [critic, reward]]. Roles in a
    group need the same nodes and gpus_per_node (vLLM: engines x tensor_parallel_size equal to
    the group's GPUs); a role with no GPUs in a group places nothing. Other roles get GPUs of
    their own."""
    allow_idle_gpus: bool = False
    """Accept an allocation with GPUs no role uses (otherwise the plan is rejected)."""
    simulated_gpus: bool = False
    """Let the local Ray cluster (runtime ray without RAY_ADDRESS) declare GPUs this host does not
    have, e.g. 2 nodes x 4 GPUs on a CPU-only machine: every role then runs on CPU, which suits tiny
    models only (the ppo-tiny-ray recipes test layouts so). Off, a map this host's GPUs cannot hold
    fails before anything starts. A Ray cluster at RAY_ADDRESS is checked against its own GPUs."""
    runtime: Literal["local", "ray"] = "local"
    """local: every role inside the training process (or each torchrun rank); the layout above is
    only planned. ray: every role on its own Ray workers, placed as the node map says, on the
    Ray cluster at RAY_ADDRESS, else on a local one of `nodes` x `gpus_per_node` started for the
    job (GPUs declared, nodes on loopback addresses)."""
    local_network: Literal["auto", "private", "host"] = "auto"
    """The network of a local Ray cluster (runtime ray without RAY_ADDRESS), whose servers listen on
    every interface: private -- the job moves into its own network namespace before Ray starts, so
    nothing of it is reachable from other hosts (nor can it reach them: models and data must be
    local or cached); auto -- private where the kernel allows unprivileged user namespaces, else the
    host's network with a warning; host -- the host's network, guarded by the cluster's token only
    (for runs that must download). A Slurm job's cluster is the allocation's, token-guarded."""

    def __post_init__(self) -> None:
        _require_finite(self, "placement")
        _require(self.nodes >= 1, "placement.nodes", self.nodes, "use at least 1 node")
        _require(self.gpus_per_node >= 1, "placement.gpus_per_node", self.gpus_per_node, "use at least 1 GPU")
        _require(self.gpu_memory_gb > 0, "placement.gpu_memory_gb", self.gpu_memory_gb,
                 "give the memory of one GPU in GiB, e.g. 80")
        for name in ("actor", "critic", "ref", "reward"):
            self._check_role(name, getattr(self, name))
        seen: dict[str, int] = {}
        for i, group in enumerate(self.colocate):
            key = f"placement.colocate[{i}]"
            unknown = [r for r in group if r not in PLACEMENT_ROLES]
            _require(not unknown, key, list(group), f"roles are {', '.join(PLACEMENT_ROLES)}")
            _require(len(set(group)) == len(group) >= 2, key, list(group),
                     "a group names two or more different roles, e.g. [actor, ref]")
            for role in group:
                _require(role not in seen, key, list(group),
                         f"{role} is already in placement.colocate[{seen.get(role)}]; a role shares GPUs with "
                         f"one group only: merge the two groups")
                seen[role] = i

    @staticmethod
    def _check_role(name: str, role: RoleConfig) -> None:
        key = f"placement.{name}"
        _require(role.nodes >= 0, f"{key}.nodes", role.nodes, "use 0 (no GPUs) or more nodes")
        _require(role.gpus_per_node >= 0, f"{key}.gpus_per_node", role.gpus_per_node, "use 0 (no GPUs) or more")
        _require(role.zero_stage in (None, 0, 1, 2, 3), f"{key}.zero_stage", role.zero_stage, "use 0-3, or null")
        if name in ("ref", "reward"):
            _require(role.offload_optimizer is None, f"{key}.offload_optimizer", role.offload_optimizer,
                     f"{name} is frozen and has no optimizer: leave it null")
        if role.zero_stage is not None:
            _require(not (role.offload_optimizer and role.zero_stage == 0), f"{key}.offload_optimizer", True,
                     f"optimizer offload needs ZeRO: set {key}.zero_stage to 1, 2 or 3")
            _require(not (role.offload_params and role.zero_stage != 3), f"{key}.offload_params", True,
                     f"parameter offload needs parameter sharding: set {key}.zero_stage=3")


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
        """(config field, path) of each reward model in `reward.sources` (rules load nothing)."""
        return [(f"reward.sources[{i}].model", src.model) for i, src in enumerate(self.reward.sources) if src.model]

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
        _resolve(self, "rollout", max_new_tokens=resolved_new_tokens(self.rollout.max_new_tokens, self.task, self.data))
        _require(self.reward.overlong_buffer < self.rollout.max_new_tokens, "reward.overlong_buffer",
                 self.reward.overlong_buffer,
                 f"use fewer tokens than rollout.max_new_tokens ({_shown(self.rollout.max_new_tokens)}), e.g. a fifth")


@dataclass(frozen=True)
class PPOConfig(OnlineJobConfig):
    """Online RL from rewards: PPO with a critic, or critic-free GRPO / RLOO / REINFORCE++."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-5, scheduler="constant", warmup_ratio=0.0))
    """The actor's optimizer and schedule (RL wants small steps: a fresh Adam moves every weight by
    about lr at first, which at SFT learning rates undoes what SFT taught)."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(max_steps=100, global_batch_size=None))
    """`max_steps`/`epochs` count rollouts (PPO steps) and passes over the prompts;
    `global_batch_size` is the mini-batch (sequences per optimizer step; null: derived from the
    rollout, see TrainConfig)."""
    derives_mini_batch: ClassVar[bool] = True
    uses_router_loss: ClassVar[bool] = True
    ppo: PPOSectionConfig = field(default_factory=PPOSectionConfig)
    """The PPO objective and its tricks."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (advantage_estimator gae)."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Roles on the nodes and GPUs of a cluster allocation (`hpcrlhf plan` checks and prints it)."""
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(every_steps=20))
    """Evaluation during and after training."""
    log: LogConfig = field(default_factory=lambda: LogConfig(every_steps=1))
    """Metrics, TensorBoard and progress output."""
    output_dir: PathText = "runs/ppo"
    """Run folder: config.yaml, metrics.jsonl, TensorBoard files, checkpoints/, model/ (the actor)."""

    def critic_source(self) -> tuple[str, str]:
        """(config field, path) of the model the critic starts from: `critic.path`, else the first
        reward model, else the policy (`model.path`)."""
        if self.critic.path:
            return "critic.path", self.critic.path
        rewards = self.reward_models()
        return rewards[0] if rewards else ("model.path", self.model.path)

    def __post_init__(self) -> None:
        super().__post_init__()
        est, n = self.ppo.advantage_estimator, self.rollout.samples_per_prompt
        if self.ppo.estimator.needs_groups and n < 2:
            raise ConfigError(f"rollout.samples_per_prompt: {n} gives {est} no group to compare within: "
                              f"use at least 2 (e.g. 4), or ppo.advantage_estimator=gae")
        if self.ppo.dynamic_sampling and n < 2:
            raise ConfigError(f"ppo.dynamic_sampling: true drops prompts whose samples all scored the same, but "
                              f"rollout.samples_per_prompt is {n}: use at least 2 samples per prompt (e.g. 4), or "
                              "ppo.dynamic_sampling=false")
        if self.ppo.dynamic_sampling and self.rollout.max_staleness:
            raise ConfigError("rollout.max_staleness: 1 generates the next step's rollout ahead, but ppo.dynamic_sampling "
                              "decides how many rounds a step generates only once the step's first round is scored: "
                              "use rollout.max_staleness=0 with dynamic sampling, or ppo.dynamic_sampling=false")
        sequences = self.rollout.prompts_per_step * n
        if self.train.global_batch_size is None:
            _resolve(self, "train", global_batch_size=largest_divisor(sequences, MICRO_BATCH_CAP))
        if sequences % self.train.global_batch_size:
            raise ConfigError(
                f"train.global_batch_size: {_shown(self.train.global_batch_size)} does not divide the "
                f"{_shown(sequences)} sequences of a rollout (rollout.prompts_per_step "
                f"{_shown(self.rollout.prompts_per_step)} x samples_per_prompt {_shown(n)}); "
                f"use a divisor of {_shown(sequences)}")
        _require_sleep_settings(self)
        if self.placement.runtime == "ray":
            _require(self.rollout.backend == "vllm", "rollout.backend", self.rollout.backend,
                     "the Ray runtime generates with vLLM engines on their own workers: set rollout.backend=vllm "
                     "and placement.vllm.engines, or placement.runtime=local to generate with the actor")
            _require(not self.lora.rank, "lora.rank", self.lora.rank,
                     "the Ray runtime pushes full weights into vLLM after each update: use lora.rank=0, or "
                     "placement.runtime=local")


def _require_sleep_settings(cfg: "PPOConfig") -> None:
    """Sleep (placement.vllm.sleep, placement.<role>.sleep) swaps GPU memory between generation and
    training: it needs vLLM engines, trained roles that hold their states on the GPU, and phases
    that take turns."""
    p = cfg.placement
    sleepers = [f"placement.{name}.sleep" for name in ("actor", "critic", "ref", "reward") if getattr(p, name).sleep]
    sleepers += ["placement.vllm.sleep"] if p.vllm.sleep else []
    for key in sleepers:
        role = key.split(".")[1]
        if role in ("ref", "reward"):
            raise ConfigError(f"{key}: true, but only trained roles (actor, critic) sleep; a frozen role keeps its "
                              f"weights in CPU memory with placement.{role}.offload_params=true (ZeRO-3)")
        if cfg.rollout.backend != "vllm":
            raise ConfigError(f"{key}: true swaps GPU memory between vLLM generation and training, but "
                              f"rollout.backend is {cfg.rollout.backend!r} (the actor generates itself): set "
                              f"{key}=false, or rollout.backend=vllm")
        if cfg.rollout.max_staleness:
            raise ConfigError(f"{key}: true swaps GPU memory between generation and training, but "
                              f"rollout.max_staleness {cfg.rollout.max_staleness} runs them at the same time: use "
                              f"rollout.max_staleness=0 with sleep, or {key}=false")
        offload = getattr(p, role).offload_params if role != "vllm" else None
        if offload or (offload is None and role != "vllm" and cfg.engine.offload_params):
            source = f"placement.{role}.offload_params" if offload else "engine.offload_params"
            raise ConfigError(f"{key}: true moves the role's states off the GPU while vLLM generates, but its "
                              f"weights are kept in CPU memory already ({source}): set {source}=false, or {key}=false")


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
    min_score: Optional[float] = None
    """sft: keep a prompt's best response only if its score reaches this (e.g. 1.0 with the exact
    task reward); null: only if it scores higher than the prompt's worst response."""
    beta: float = 0.1
    """dpo: DPO beta."""
    nll_coef: float = 1.0
    """dpo: weight of the chosen responses' NLL (keeps their likelihood up, Pang et al. 2024)."""

    def __post_init__(self) -> None:
        _require_finite(self, "rs")
        _require(self.iterations >= 1, "rs.iterations", self.iterations, "use at least 1")
        _require(self.prompts_per_iteration >= 1, "rs.prompts_per_iteration", self.prompts_per_iteration, "use at least 1")
        _require(self.steps_per_iteration >= 1, "rs.steps_per_iteration", self.steps_per_iteration, "use at least 1")
        _require(self.iterations * self.steps_per_iteration <= MAX_STEPS, "rs.steps_per_iteration",
                 self.steps_per_iteration, f"rs.iterations ({_shown(self.iterations)}) x rs.steps_per_iteration steps "
                 f"must be at most {MAX_STEPS:,} (2**31 - 1, see train.max_steps)")
        _require(self.beta > 0, "rs.beta", self.beta, "use a positive value such as 0.1")
        _require(self.nll_coef >= 0, "rs.nll_coef", self.nll_coef, "use >= 0")


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
        _require(not self.rollout.max_staleness, "rollout.max_staleness", self.rollout.max_staleness,
                 "rejection sampling generates each round with the weights the round before trained: use 0")
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
    reward: Optional[RewardConfig] = None
    """Score each response with these reward models / rules (null: no scores)."""
    metrics: tuple[str, ...] = ()
    """Your own metrics of each response, as `eval.metrics` of training jobs
    (`package.module:function`): written per response under `metrics`, their means printed."""
    metric_timeout_s: float = DEFAULT_USER_CODE_TIMEOUT_S
    """Longest one call of a metric may take, in seconds (`eval.metric_timeout_s`)."""
    batch_size: int = 64
    """Prompts per generation batch."""
    seed: int = 1234
    """Seed for sampling."""
    output: PathText = "generations.jsonl"
    """JSONL file written: one line per response with prompt, response, sample index, finished, scores."""

    def __post_init__(self) -> None:
        _require(self.batch_size >= 1, "batch_size", self.batch_size, "use at least 1")
        _require_timeout(self.metric_timeout_s, "metric_timeout_s")
        _resolve_data_length(self)
        _resolve(self, "rollout", max_new_tokens=resolved_new_tokens(self.rollout.max_new_tokens, self.task, self.data))
        _require_metrics(self.metrics, "metrics")
        _require_task_for_rules(self.reward, self.task, self.data)


JOB_CONFIGS: dict[str, type] = {"sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig, "kto": KTOConfig, "csft": CSFTConfig,
                                "ppo": PPOConfig, "rs": RSConfig}
"""Job kind -> its config class (the CLI's `train KIND`)."""
