"""Typed configs: one frozen tree per job kind, defaults only here.

Sections are shared between job kinds (every trainer has `model`, `data`, `optim`, `engine`, ...);
each job kind is one top-level class (`SFTConfig`, later `RMConfig`, `PPOConfig`, ...).
Recipes (YAML) and `--set section.key=value` override these defaults; see `hpcrlhf.config.loader`.
The string under each field is its documentation (`hpcrlhf config sft` prints it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from hpcrlhf.errors import ConfigError


def _require(ok: bool, key: str, value: object, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {value!r} is invalid: {fix}")


@dataclass(frozen=True)
class ModelConfig:
    path: str = "builtin:tiny-llama"
    """Model to start from: a local Hugging Face folder, a hub name (online only), or
    `builtin:tiny-<family>` (llama, mistral, mixtral, qwen2, gpt2) for the bundled tiny models."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """Attention kernel. `auto` picks flash_attention_2 when flash-attn is installed and a GPU is
    used, else sdpa. Asking for flash_attention_2 without flash-attn is an error."""
    trust_remote_code: bool = False
    """Allow model code from the model folder (only for models you trust)."""


@dataclass(frozen=True)
class TaskConfig:
    name: Optional[str] = "arithmetic"
    """Bundled synthetic task (rule-based score). It supplies the data when `data.train_path` is
    unset, and the task score reported by evaluation. Set to null when training on your own data
    (then `data.train_path` is required)."""
    max_operand: int = 99
    """Largest operand of the arithmetic task: the task's difficulty."""
    seed: int = 0
    """Seed of the task's problem generator."""
    train_size: int = 80000
    """Rows drawn from the task for training (when `data.train_path` is unset); one epoch of
    the default batch is 1250 steps, enough for the tiny llama to learn the task (~30 s on CPU)."""
    eval_size: int = 256
    """Held-out rows (loss and task score) drawn from the task's eval split."""


@dataclass(frozen=True)
class DataConfig:
    train_path: Optional[str] = None
    """Training data: a .jsonl/.json/.parquet/.csv file, a folder saved by `datasets`, or a hub
    dataset name (online only). Unset: rows from the bundled task."""
    eval_path: Optional[str] = None
    """Held-out data in the same forms. Unset: the task's eval split (or none with a train file)."""
    split: str = "train"
    """Split to read from hub datasets."""
    prompt_key: str = "prompt"
    """Field of each row holding the prompt."""
    response_key: str = "response"
    """Field of each row holding the target response."""
    apply_chat_template: bool = False
    """Wrap each prompt as a user turn with the tokenizer's chat template."""
    max_length: int = 64
    """Tokens per sample (prompt + response + EOS); longer samples are truncated (and counted)."""
    packing: bool = False
    """Pack several samples into each row of `max_length` tokens, with attention and positions
    restarting at every sample boundary."""
    max_samples: Optional[int] = None
    """Use only the first N training rows."""

    def __post_init__(self) -> None:
        _require(self.max_length >= 8, "data.max_length", self.max_length, "use at least 8 tokens")


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
        _require(self.lr > 0, "optim.lr", self.lr, "the learning rate must be > 0")
        _require(0 <= self.warmup_ratio < 1, "optim.warmup_ratio", self.warmup_ratio, "use a value in [0, 1)")
        _require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "use a value in [0, 1]")
        _require(self.max_grad_norm >= 0, "optim.max_grad_norm", self.max_grad_norm, "use >= 0 (0 disables)")


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 1
    """Passes over the training data (ignored when `max_steps` is set)."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (takes precedence over `epochs`)."""
    global_batch_size: int = 64
    """Samples (packed rows with packing) per optimizer step, summed over all data-parallel ranks."""
    micro_batch_size: int = 64
    """Samples per forward/backward pass on one rank. Accumulation steps are derived:
    global_batch_size / (micro_batch_size * ranks), which must be a whole number."""

    def __post_init__(self) -> None:
        _require(self.epochs >= 1, "train.epochs", self.epochs, "use at least 1")
        _require(self.max_steps is None or self.max_steps >= 1, "train.max_steps", self.max_steps, "use at least 1, or null")
        _require(self.global_batch_size >= 1, "train.global_batch_size", self.global_batch_size, "use at least 1")
        _require(self.micro_batch_size >= 1, "train.micro_batch_size", self.micro_batch_size, "use at least 1")


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
    max_new_tokens: int = 8
    """Tokens generated per eval prompt for the task score (greedy)."""
    score_prompts: int = 256
    """Held-out prompts used for the task score."""
    batch_size: int = 128
    """Prompts per generation batch during evaluation."""


@dataclass(frozen=True)
class LogConfig:
    every_steps: int = 10
    """Write train metrics every N optimizer steps."""
    tensorboard: bool = True
    """Also write TensorBoard event files into the run folder."""
    progress: bool = True
    """Show a progress bar (rank 0) with rate and ETA."""


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 0
    """Save a resumable checkpoint every N optimizer steps (0: only at the end)."""
    resume: str = "auto"
    """`auto`: continue from the run folder's latest checkpoint when one exists; `never`: start
    fresh (refuses to overwrite a run folder that has checkpoints); or a checkpoint folder path."""
    keep_last: int = 2
    """Checkpoints kept in `checkpoints/` (older ones are deleted)."""
    save_model: bool = True
    """Save the final model in Hugging Face format into `model/` in the run folder."""


@dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning: next-token loss on the response tokens of (prompt, response) rows."""

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
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation during and after training."""
    log: LogConfig = field(default_factory=LogConfig)
    """Metrics, TensorBoard and progress output."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing and resuming."""
    seed: int = 1234
    """Seed for model init, data order and dropout."""
    output_dir: str = "runs/sft"
    """Run folder: config.yaml, metrics.jsonl, TensorBoard files, checkpoints/, model/."""

    def __post_init__(self) -> None:
        if self.task.name is None and self.data.train_path is None:
            raise ConfigError("data.train_path: null needs a task for data: set data.train_path or task.name")


JOB_CONFIGS: dict[str, type] = {"sft": SFTConfig}
"""Job kind -> its config class (the CLI's `train KIND`)."""
