"""`hpcrlhf eval`: a model folder, or checkpoints of a run, answering benchmark prompts (greedy or
sampled), scored by the task and `eval.metrics` -- mean@n, pass@k and maj@n per dataset."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from pathlib import PurePath

from hpcrlhf.config.schema.checks import PathText, fill_derived, require
from hpcrlhf.config.schema.online import PromptDataConfig, RolloutConfig
from hpcrlhf.config.schema.rules import RulesConfig, require_metrics
from hpcrlhf.config.schema.sections import (EvalConfig, LoRAConfig, ModelConfig, TaskConfig, WatchdogConfig,
                                            resolved_max_length, resolved_new_tokens)

CHECKPOINT_CHOICES = ("latest", "all", "best", "model")
"""What `checkpoints` names besides a comma list of steps (and of `best`, `model`)."""

IN_RUN_ONLY = ("every_steps", "stop_when", "keep_best", "keep_best_mode")
"""`eval` keys training reads and the eval job does not: a changed one is refused, not ignored."""

SAMPLING_KEYS = {"samples_per_prompt": "eval.samples_per_prompt", "temperature": "eval.temperature",
                 "top_p": "eval.top_p", "top_k": None, "max_new_tokens": "eval.max_new_tokens"}
"""The rollout keys that say how answers are drawn, and the `eval` key the eval job takes instead."""


@dataclass(frozen=True)
class EvalDatasetConfig:
    path: PathText | None = None
    """Prompts to answer: a .jsonl/.json/.parquet/.csv file or a folder saved by `datasets`; null: the
    held-out prompts (data.eval_path, else the bundled task's held-out split, the first eval.score_prompts)."""
    name: str | None = None
    """The dataset's name in the results; null: the file's stem (`held_out` for the held-out prompts)."""
    prompt_key: str | None = None
    """Field of each row holding the prompt; null: data.prompt_key."""
    max_samples: int | None = None
    """Answer only the first N rows; null: all of the file's (eval.score_prompts of the held-out prompts)."""
    metrics: tuple[str, ...] | None = None
    """Metrics of this dataset's answers (as eval.metrics); null: eval.metrics. A file of the bundled
    task's questions also gets its task score (task.name)."""

    def __post_init__(self) -> None:
        require(self.max_samples is None or self.max_samples >= 1, "datasets[].max_samples", self.max_samples,
                "use at least 1 row, or null for all of them")
        require(self.name is None or re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.name) is not None,
                "datasets[].name", self.name, "use letters, digits, '_', '.' and '-' (it names files of the results)")

    @property
    def label(self) -> str:
        """The dataset's name in results and file names."""
        if self.name:
            return self.name
        if self.path is None:
            return "held_out"
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", PurePath(self.path.rstrip("/")).name.split(".")[0]) or "dataset"
        return stem


@dataclass(frozen=True)
class EvalJobConfig:
    """Evaluation as a job: every target (a model folder, or a run's checkpoints) answers every dataset."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model evaluated (`--model`); with `run`, the model the run started from (its checkpoints load
    into it; read from the run's config.yaml)."""
    run: PathText | None = None
    """A run folder (`--run`): its config.yaml gives model, lora, task, data, eval and rules (each still
    overridable), and `checkpoints` picks which of its models are evaluated."""
    checkpoints: str = "latest"
    """With `run`: `latest` (its latest intact checkpoint), `all` (every complete one), `best`
    (best/ of eval.keep_best), `model` (model/, the final export) or a step, alone or in a comma list,
    e.g. `100,200,model` or `latest,best`."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """The run's LoRA settings (from its config.yaml): a checkpoint's adapters are merged into the model
    (at full precision, QLoRA's too)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The bundled task: the held-out prompts when no dataset names a file, and the task score."""
    data: PromptDataConfig = field(default_factory=PromptDataConfig)
    """The held-out prompts (`eval_path`), how prompts are read and tokenised (`prompt_key`,
    `apply_chat_template`, `max_length`)."""
    datasets: tuple[EvalDatasetConfig, ...] = ()
    """What is answered; empty: the held-out prompts. E.g. `[{path: gsm8k.jsonl, metrics: [math]}, {}]`."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """How answers are drawn and scored, as in training (`samples_per_prompt`, `temperature`, `top_p`,
    `pass_k`, `pass_threshold`, `vote`, `metrics`, `max_new_tokens`, `score_prompts`, `batch_size`);
    every_steps, stop_when and keep_best are training's."""
    rules: RulesConfig = field(default_factory=RulesConfig)
    """Settings of the built-in rules (math, code, format) the metrics name."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The engine: `backend` (hf or vllm) and the `vllm_*` settings; how answers are sampled is `eval`'s."""
    seed: int = 1234
    """Seed of the sampled answers (the same draws for every target: they are compared on equal terms)."""
    output_dir: PathText | None = None
    """Where results.json/.md/.png and the answers (samples/) go; null: RUN/eval with `run`, else runs/eval.
    A rerun with the same settings resumes there (finished batches are kept)."""
    keep_models: bool = False
    """Keep the Hugging Face folders made from checkpoints (OUT/models/), deleted after their evaluation
    otherwise."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Deadlines of each batch's answers and each target's loading: past one, the stacks go to OUT/watchdog/ and
    the job exits 4 (requeued on Slurm; a rerun resumes after the batches written)."""

    def __post_init__(self) -> None:
        require(re.fullmatch(r"[A-Za-z0-9_]+(,[A-Za-z0-9_]+)*", self.checkpoints or "") is not None
                and all(p in CHECKPOINT_CHOICES or p.isdigit() for p in self.checkpoints.split(",")),
                "checkpoints", self.checkpoints,
                f"use {', '.join(CHECKPOINT_CHOICES)} or steps, alone or in a comma list (e.g. 100,200,model)")
        require(self.run is not None or self.checkpoints == "latest", "checkpoints", self.checkpoints,
                "checkpoints are a run's: name the run folder with --run (or evaluate a model folder with --model alone)")
        default_eval = EvalConfig()
        for key in IN_RUN_ONLY:
            require(getattr(self.eval, key) == getattr(default_eval, key), f"eval.{key}", getattr(self.eval, key),
                    "it is read during training only; drop it for hpcrlhf eval")
        default_rollout = RolloutConfig()
        for key, instead in SAMPLING_KEYS.items():
            require(getattr(self.rollout, key) == getattr(default_rollout, key), f"rollout.{key}",
                    getattr(self.rollout, key), "hpcrlhf eval draws its answers as `eval` says: "
                    + (f"set {instead} instead" if instead else "drop it (sampling is eval.temperature and eval.top_p)"))
        names = [d.label for d in self.datasets]
        for i, d in enumerate(self.datasets):
            require(names.count(d.label) == 1, f"datasets[{i}].name", d.label,
                    "two datasets have this name: give each its own (datasets[].name)")
            if d.metrics is not None:
                require_metrics(d.metrics, f"datasets[{i}].metrics")
        # lengths default to the bundled task's when it applies: to its held-out prompts, not to files of one's own
        own_files = bool(self.datasets) and all(d.path for d in self.datasets)
        probe = replace(self.data, train_path=self.datasets[0].path) if own_files else self.data
        fill_derived(self, "data", max_length=resolved_max_length(self.data.max_length, self.task, probe))
        fill_derived(self, "eval", max_new_tokens=resolved_new_tokens(self.eval.max_new_tokens, self.task, probe))

    @property
    def out_dir(self) -> str:
        """Where results and answers go: `output_dir`, else RUN/eval with `run`, else runs/eval."""
        if self.output_dir is not None:
            return self.output_dir
        return str(PurePath(self.run) / "eval") if self.run is not None else "runs/eval"

    @property
    def sets(self) -> tuple[EvalDatasetConfig, ...]:
        """The datasets answered: `datasets`, or the held-out prompts."""
        return self.datasets or (EvalDatasetConfig(),)


RUN_SETTINGS = {"model": None, "lora": None, "task": None, "rules": None, "seed": None,
                "data": tuple(f.name for f in fields(PromptDataConfig) if f.name != "max_samples"),
                "eval": ("max_new_tokens", "score_prompts", "batch_size", "metrics", "metric_timeout_s",
                         "samples_per_prompt", "temperature", "top_p", "pass_k", "pass_threshold", "vote")}
"""What `--run` takes from the run's config.yaml: whole sections (None), or these keys of a section."""
