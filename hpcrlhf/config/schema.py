"""Typed configs: one frozen tree per job kind, defaults only here.

Sections are shared between job kinds (every trainer has `model`, `data`, `optim`, `engine`, ...);
each job kind is one top-level class (`SFTConfig`, `RMConfig`, `DPOConfig`, ...) built on
`TrainJobConfig`.
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
    hard_pair_fraction: float = 0.5
    """Share of the task's preference pairs (rm, dpo) whose rejected answer is a near miss (off by
    one digit) rather than clearly wrong (wrong number of digits)."""

    def __post_init__(self) -> None:
        _require(0 <= self.hard_pair_fraction <= 1, "task.hard_pair_fraction", self.hard_pair_fraction,
                 "use a value in [0, 1]")


@dataclass(frozen=True)
class DataSourceConfig:
    """Where rows come from and how prompts are tokenised (shared by every job kind's `data`)."""

    train_path: Optional[str] = None
    """Training data: a .jsonl/.json/.parquet/.csv file, a folder saved by `datasets`, or a hub
    dataset name (online only). Unset: rows from the bundled task."""
    eval_path: Optional[str] = None
    """Held-out data in the same forms. Unset: the task's eval split (or none with a train file)."""
    split: str = "train"
    """Split to read from hub datasets."""
    prompt_key: str = "prompt"
    """Field of each row holding the prompt."""
    apply_chat_template: bool = False
    """Wrap each prompt as a user turn with the tokenizer's chat template."""
    max_length: int = 64
    """Tokens per sample (prompt + response + EOS); longer samples are truncated (and counted)."""
    max_samples: Optional[int] = None
    """Use only the first N training rows."""

    def __post_init__(self) -> None:
        _require(self.max_length >= 8, "data.max_length", self.max_length, "use at least 8 tokens")


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
        _require(self.rank >= 0, "lora.rank", self.rank, "use 0 (no LoRA) or a positive rank such as 8")
        _require(self.alpha > 0, "lora.alpha", self.alpha, "use a positive scale such as 16")
        _require(0 <= self.dropout < 1, "lora.dropout", self.dropout, "use a value in [0, 1)")
        if self.load_in_4bit and self.rank == 0:
            raise ConfigError("lora.load_in_4bit: true (QLoRA) trains adapters only: also set lora.rank, e.g. 8")


@dataclass(frozen=True)
class ReferenceConfig:
    path: Optional[str] = None
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
    output_dir: str = "runs/train"
    """Run folder: config.yaml, metrics.jsonl, TensorBoard files, checkpoints/, model/."""

    def __post_init__(self) -> None:
        if self.task.name is None and self.data.train_path is None:
            raise ConfigError("data.train_path: null needs a task for data: set data.train_path or task.name")
        if self.lora.load_in_4bit and self.engine.zero_stage == 3:
            raise ConfigError("lora.load_in_4bit: 4-bit base weights cannot be sharded by ZeRO-3: "
                              "use engine.zero_stage 0-2 with QLoRA")


@dataclass(frozen=True)
class SFTConfig(TrainJobConfig):
    """Supervised fine-tuning: next-token loss on the response tokens of (prompt, response) rows."""

    output_dir: str = "runs/sft"
    """Run folder: config.yaml, metrics.jsonl, TensorBoard files, checkpoints/, model/."""


@dataclass(frozen=True)
class RMConfig(TrainJobConfig):
    """Reward model: the backbone plus a scalar value head, trained on preference pairs with the
    Bradley-Terry loss -log sigmoid(r_chosen - r_rejected [- margin])."""

    data: PairDataConfig = field(default_factory=PairDataConfig)
    """Preference pairs for training and evaluation."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(global_batch_size=32, micro_batch_size=32))
    """Batch sizes (in pairs) and length of training."""
    output_dir: str = "runs/rm"
    """Run folder; `model/` holds the reward model with its reward mean/std in config.json."""


@dataclass(frozen=True)
class PolicyJobConfig(TrainJobConfig):
    """Jobs that train a policy against a frozen reference model (DPO, KTO)."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-4))
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(global_batch_size=32, micro_batch_size=32))
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
    output_dir: str = "runs/dpo"
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
    output_dir: str = "runs/kto"
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
        _require("{bucket}" in self.template and "{prompt}" in self.template, "csft.template", self.template,
                 "the template must contain both {bucket} and {prompt}")


@dataclass(frozen=True)
class CSFTConfig(TrainJobConfig):
    """Conditional SFT (decision-transformer style): each response's reward bucket is written into
    its prompt, so generation conditioned on the top bucket asks for the best behaviour."""

    data: CSFTDataConfig = field(default_factory=CSFTDataConfig)
    """(prompt, response, reward) rows for training and evaluation."""
    csft: CSFTSectionConfig = field(default_factory=CSFTSectionConfig)
    """How rewards become conditions."""
    output_dir: str = "runs/csft"
    """Run folder; `model/csft.json` records the template and buckets for generation."""


JOB_CONFIGS: dict[str, type] = {"sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig, "kto": KTOConfig, "csft": CSFTConfig}
"""Job kind -> its config class (the CLI's `train KIND`)."""
