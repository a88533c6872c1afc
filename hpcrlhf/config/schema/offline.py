"""The jobs that train on a fixed dataset: sft, rm, dpo, kto and csft, with the data and loss
sections of their own."""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from hpcrlhf.config.schema.checks import PathText, fill_derived, require, require_finite
from hpcrlhf.config.schema.sections import (DataConfig, DataSourceConfig, OptimConfig, ReferenceConfig, TrainConfig,
                                            TrainJobConfig, require_task_rows)
from hpcrlhf.errors import ConfigError

@dataclass(frozen=True)
class PairDataConfig(DataSourceConfig):
    """(prompt, chosen, rejected) preference pairs (reward model, DPO)."""

    chosen_key: str = "chosen"
    """Field of each row holding the preferred response."""
    rejected_key: str = "rejected"
    """Field of each row holding the dispreferred response."""
    margin_key: str | None = None
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
class SFTConfig(TrainJobConfig):
    """Supervised fine-tuning: next-token loss on the response tokens of (prompt, response) rows."""

    uses_router_loss: ClassVar[bool] = True
    output_dir: PathText = "runs/sft"
    """Run folder: config.yaml, metrics.jsonl, TensorBoard files, checkpoints/, model/."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.task.resolve(self.data) == "calculator" and self.data.train_path is None:
            # its rows are conversations: read them so (derived defaults, never a user's setting)
            require(self.data.apply_chat_template, "data.apply_chat_template", self.data.apply_chat_template,
                    "the calculator task's SFT rows are conversations, rendered by the chat template: set it to true")
            fill_derived(self, "data", messages_key=self.data.messages_key or "messages",
                         tools_key=self.data.tools_key or "tools")
        if self.data.messages_key is not None and self.eval.metrics:
            raise ConfigError(f"eval.metrics: {list(self.eval.metrics)} score greedy answers to held-out prompts, but "
                              "conversation rows (data.messages_key) have no prompt field to answer; drop eval.metrics "
                              "(eval/loss is the held-out conversations' loss on their assistant turns)")


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
        require_task_rows(self.task, self.data, "rm")
        if self.eval.metrics:
            raise ConfigError(f"eval.metrics: {list(self.eval.metrics)} score generated answers, and a reward model "
                              "generates none (it is evaluated on pairs): remove eval.metrics, or report them from the "
                              "policy's jobs (sft, dpo, kto, csft, ppo, rs, generate)")
        require(not self.eval.sampled, "eval.samples_per_prompt", self.eval.samples_per_prompt,
                "a reward model generates no answers to sample (it is evaluated on pairs): leave eval.samples_per_prompt "
                "1 and eval.temperature null")


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
        require_task_rows(self.task, self.data, "dpo or kto")
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
        require_finite(self, "dpo")
        require(self.beta > 0, "dpo.beta", self.beta, "use a positive value such as 0.1")
        require(self.nll_coef >= 0, "dpo.nll_coef", self.nll_coef, "use >= 0")
        if self.loss == "cdpo":
            require(0 <= self.label_smoothing < 0.5, "dpo.label_smoothing", self.label_smoothing, "use a value in [0, 0.5)")
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
        require_finite(self, "kto")
        require(self.beta > 0, "kto.beta", self.beta, "use a positive value such as 0.1")
        require(self.desirable_weight >= 0, "kto.desirable_weight", self.desirable_weight, "use >= 0")
        require(self.undesirable_weight >= 0, "kto.undesirable_weight", self.undesirable_weight, "use >= 0")


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
        require(self.num_buckets >= 2, "csft.num_buckets", self.num_buckets, "use at least 2")
        problem = _template_problem(self.template, {"bucket": 0, "prompt": "12+34="})
        require(problem is None, "csft.template", self.template, f"{problem}; the template must contain both {{bucket}} "
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

    def __post_init__(self) -> None:
        super().__post_init__()
        require_task_rows(self.task, self.data, "csft")
        if self.data.messages_key is not None:
            raise ConfigError("data.messages_key: conditional SFT writes each response's reward bucket into its "
                              "prompt, so it trains on (prompt, response, reward) rows, not conversations; use "
                              "`train sft` for conversations")
