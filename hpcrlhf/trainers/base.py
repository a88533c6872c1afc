"""The training loop every single-model trainer shares (SFT, RM, DPO, KTO, CSFT).

A subclass calls `setup(cfg)`, loads its data, calls `build_engine(num_rows)`, and supplies the
two things that differ between algorithms: `train_step(step)` (one optimizer step; returns
`train/*` metrics for that step, `train/tokens` included) and `evaluate()`. The base owns the
rest: model loading (causal LM or value model, LoRA), the DeepSpeed engine, resume, progress,
windowed metrics, periodic evaluation and checkpoints, stop requests, the exported model and the
summary. `sample_mean_step` and `eval_means` are the shared shapes of a step and an evaluation
whose loss is a mean over samples; `generation_scores` answers the held-out prompts greedily and
reports the task score and the user's `eval.metrics` of the answers.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import torch

from hpcrlhf.config.stop_rule import parse_stop_rule
from hpcrlhf.data.sources import Row
from hpcrlhf.engines.distributed import all_reduce_sum
from hpcrlhf.engines.hf_generate import generate_greedy
from hpcrlhf.errors import ConfigError
from hpcrlhf.logs import get_logger
from hpcrlhf.run.metrics import read_metrics
from hpcrlhf.run.guard import SKIPPED_SUFFIX, NonFiniteError, NonFiniteGuard, SkipStep, require_finite_start
from hpcrlhf.trainers.batches import BatchPlan, eval_shards, key_settings
from hpcrlhf.run.folder import Run, StepAbandoned
from hpcrlhf.run.stats import Stats, add_stats, new_stats, reduce_means

log = get_logger()



def idle_shares(timings: dict[str, float]) -> dict[str, float]:
    """`util/<role>_idle` = 1 - `timing/busy_<role>` / `timing/step`: the share of a step a role's
    workers waited (verl's idle_ratio), where the runtime measures busy time."""
    step = timings.get("timing/step", 0.0)
    return {f"util/{key.removeprefix('timing/busy_')}_idle": min(max(1.0 - value / step, 0.0), 1.0)
            for key, value in timings.items() if key.startswith("timing/busy_") and step > 0}


class Trainer:
    kind = "train"
    progress_key = "train/loss"
    """The metric shown next to the progress bar."""
    value_head = False
    """True for trainers whose model is a value model (reward model), else a causal LM."""

    # -- construction ---------------------------------------------------------------------------
    def setup(self, cfg) -> None:
        self.setup_process(cfg)
        self.run = Run(cfg, self.env)
        self.setup_evaluation()

    def setup_evaluation(self) -> None:
        """The task that applies (logged when `auto` decides it), what evaluation scores each
        generated answer with (`self.metrics`: task score and `eval.metrics`, imported now) and the
        held-out prompts it answers (`self.held_out`: rows and their prompt field; none for a value
        model). A mistake in any of them, or in a reward rule, fails here, before a model loads."""
        from hpcrlhf.data.loading import held_out_prompt_rows, task_note
        from hpcrlhf.data.tasks import build_task
        from hpcrlhf.models.context import ContextWindow
        from hpcrlhf.rewards import EvalMetrics, check_rules

        cfg = self.cfg
        self.window = ContextWindow.of(cfg.model.path)
        """The generating model's positions: each prompt plus its response must fit."""
        note = task_note(cfg.task, cfg.data)
        if note:
            log.info(note)
        check_rules(cfg)
        self.task = build_task(cfg.task, cfg.data)
        self.metrics = EvalMetrics(cfg.eval.metrics, self.task, timeout_s=cfg.eval.metric_timeout_s)
        self.held_out = (([], cfg.data.prompt_key) if self.value_head
                         else held_out_prompt_rows(cfg.data, cfg.task, cfg.eval.score_prompts))

    def setup_process(self, cfg) -> None:
        """This process's rank in its group, seed, tokenizer and model factory (hpcrlhf.models.factory)."""
        from hpcrlhf.models.factory import ModelFactory

        self.cfg = cfg
        self.models = ModelFactory(cfg)
        self.env, self.tokenizer, self.pad_id = self.models.env, self.models.tokenizer, self.models.pad_id

    def build_engine(self, num_rows: int) -> None:
        """The batch plan and the trained model under DeepSpeed (with LoRA when configured)."""
        from hpcrlhf.models.factory import trainable_parameters

        cfg = self.cfg
        self.plan = BatchPlan.build(cfg.train, num_rows=num_rows, data_parallel_size=self.env.world_size)
        self.engine = self.models.build_trained_model(cfg.model.path, value_head=self.value_head, optim=cfg.optim,
                                                      micro_batch_rows=self.plan.micro_batch_rows,
                                                      grad_accum_steps=self.plan.grad_accum_steps,
                                                      total_steps=self.plan.total_steps)
        log.info(f"{self.kind}: {num_rows} training rows, {self.plan.total_steps} steps, {self.env.world_size} rank(s) x "
                 f"{self.plan.micro_batch_rows} rows x {self.plan.grad_accum_steps} accumulation, ZeRO-{cfg.engine.zero_stage}, "
                 f"{cfg.engine.precision} on {self.device}"
                 + (f", LoRA rank {cfg.lora.rank} ({trainable_parameters(self.engine)} trainable parameters)"
                    if cfg.lora.rank else ""))
        log.info(key_settings(cfg, ranks=self.env.world_size, micro_batch_rows=self.plan.micro_batch_rows,
                              grad_accum_steps=self.plan.grad_accum_steps))

    @property
    def device(self) -> torch.device:
        return self.models.device

    def evaluated_models(self) -> dict[str, str]:
        """Config field -> path of each model evaluation runs, the trained one first (named when the
        first evaluation is NaN/Inf)."""
        return {"model.path": self.cfg.model.path}

    def trained_weights(self):
        """The trained model's (name, tensor) pairs, None when this process does not hold them whole
        (ZeRO-3 shards)."""
        return None if self.engine.zero_stage == 3 else self.engine.module.named_parameters()

    @property
    def checkpointable(self):
        """What a checkpoint saves and restores (`save_checkpoint(folder, client_state)`,
        `load_checkpoint(folder)`): the trained engine, or a trainer's composite of several."""
        return self.engine

    # -- what each trainer supplies -------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        raise NotImplementedError

    def exported_config(self) -> dict[str, Any]:
        """Extra entries for the exported model's config.json."""
        return {}

    def exported_files(self) -> dict[str, str]:
        """Extra files (name -> text) exported with the model, in `model/`."""
        return {}

    def save_outputs(self) -> None:
        """Write the final model in Hugging Face format into `model/` of the run folder (LoRA
        adapters merged, the adapter alone in `model/adapter/`)."""
        extra = self.exported_config()  # may need every rank (collectives)
        self.models.export(self.engine, value_head=self.value_head, config_updates=extra, files=self.exported_files())

    # -- shared shapes of a step and of an evaluation ------------------------------------------
    def sample_mean_step(self, step: int, num_rows: int,
                         micro_loss: Callable[[list[int]], tuple[torch.Tensor, int, Stats]],
                         indices: list[int] | None = None) -> dict[str, float]:
        """One optimizer step on a loss that is a mean over the samples of the global batch.

        `micro_loss(indices)` returns the mean loss over those samples, their token count and
        statistics. Each micro-batch's mean is weighted by its share of the global batch (every
        rank gets the same number of rows), so 1 rank and N ranks compute the same update.
        `indices` overrides the plan's choice of this rank's rows.
        """
        if indices is None:
            indices = self.plan.rows_for_step(num_rows, step, self.cfg.seed, self.env.rank)
        global_rows, world = self.plan.global_batch_rows, self.env.world_size
        self.engine.train()
        sums = new_stats()
        tokens = 0
        for start in range(0, len(indices), self.plan.micro_batch_rows):
            part = indices[start : start + self.plan.micro_batch_rows]
            loss, n_tokens, stats = micro_loss(part)
            self.engine.backward(loss * (len(part) * world / global_rows))
            self.engine.step()
            tokens += n_tokens
            add_stats(sums, {"train/loss": (float(loss.detach()) * len(part), len(part)), **stats})
        means = reduce_means(sums)
        means["train/tokens"] = all_reduce_sum([tokens])[0]
        means["train/samples"] = float(global_rows)
        return means

    def eval_means(self, items: Sequence, batch_stats: Callable[[list], Stats]) -> dict[str, float]:
        """Means of `batch_stats` over `items`, sharded over ranks (ZeRO-3 safe)."""
        sums = new_stats()
        for batch, dummy in eval_shards(items, self.env, self.cfg.eval.batch_size):
            stats = batch_stats(batch)
            add_stats(sums, {k: (0.0, 0.0) for k in stats} if dummy else stats)
        return reduce_means(sums)

    def score_prompts(self, template: Callable[[str], str] = str) -> list[tuple[list[int], Row]]:
        """(token ids of template(prompt), row) for the held-out prompts evaluation answers."""
        from hpcrlhf.data.sft import encode_prompts

        rows, key = self.held_out
        ids = encode_prompts(self.tokenizer, [template(r.data[key]) for r in rows], self.cfg.data.apply_chat_template)
        self.window.require_prompts_fit(((len(p), r.origin) for p, r in zip(ids, rows)), "eval.max_new_tokens",
                                        self.cfg.eval.max_new_tokens)
        return list(zip(ids, rows))

    def generation_scores(self, prompts: Sequence[tuple[list[int], Row]], suffix: str = "") -> dict[str, float]:
        """Means of the task score and `eval.metrics` of greedy answers to (prompt ids, row) pairs,
        as `eval/<name><suffix>` (nothing to generate when there are neither)."""
        from hpcrlhf.rewards import Response

        key = self.held_out[1]

        def stats(batch: list) -> Stats:
            with self.run.stoppable():
                texts = generate_greedy(self.engine.module, self.tokenizer, [ids for ids, _ in batch],
                                        max_new_tokens=self.cfg.eval.max_new_tokens, device=self.engine.device,
                                        synced_gpus=self.engine.zero_stage == 3 and self.env.world_size > 1)
                return self.metrics.stats([Response(row.data[key], text, (), row.data, row.origin)
                                           for (_, row), text in zip(batch, texts)], suffix)

        self.engine.eval()
        return self.eval_means(prompts, stats) if prompts and self.metrics.rules else {}

    def fit(self) -> dict:
        run, plan = self.run, self.plan
        finished = run.finished
        if finished is not None and (finished["step"] == plan.total_steps or finished.get("stopped_early")):
            log.info(f"{run.dir} is already complete ({finished['step']} steps); use a new --output-dir to train again")
            run.finish()
            return finished
        if finished is not None:
            self._require_steps_left(finished["step"], "finished at")
            if run.resume_from is None:
                run.finish()
                raise ConfigError(f"{self._length()}, but the run in {run.dir} finished at step {finished['step']} "
                                  "and keeps no checkpoint to train on from (checkpoint.at_end=false, or deleted): use "
                                  "a new --output-dir")
        step = run.resume(self.checkpointable)["step"]
        self._require_steps_left(step, "has a checkpoint at")
        if finished is not None and step < finished["step"]:
            log.info(f"{run.dir} finished at step {finished['step']} with no checkpoint there (checkpoint.at_end=false): "
                     f"steps {step + 1}-{finished['step']} are trained again from its checkpoint at step {step}")
        stop_rule = parse_stop_rule(self.cfg.eval.stop_when)
        if step == 0:
            try:
                before = self.evaluate()
            except StepAbandoned:
                return self._stopped(step, " during the evaluation before training")
            require_finite_start(before, self.evaluated_models(), self.trained_weights(), self.cfg.engine.precision)
            if stop_rule is not None:  # a misspelt metric fails here, not after hours of training
                stop_rule.require_metric(before)
            run.log(0, before)
            log.info("before training: " + format_metrics(before))
        else:  # resumed: the first evaluation is in the run's metrics
            before = next((m for m in read_metrics(run.dir) if m["step"] == 0 and len(m) > 1), None)
        progress = run.start_progress(plan.total_steps, step, self.kind)
        window: dict[str, list[float]] = defaultdict(list)
        window_start = time.perf_counter()
        self.guard = NonFiniteGuard(self.cfg.train.on_nonfinite, self.cfg.train.max_consecutive_skips)
        first_after_loading = run.resume_from is not None
        while step < plan.total_steps:
            try:
                metrics = self.guarded_step(step)
            except StepAbandoned:
                return self._stopped(step, f" during step {step + 1}, which is dropped")
            except NonFiniteError:  # the guard ends the run (train.on_nonfinite=stop, too many skips)
                if not (first_after_loading and self.guard.nonfinite):
                    raise
            if first_after_loading and self.guard.nonfinite:  # from the weights loaded, not from training
                run.fall_back(self.guard.nonfinite)
                step = run.resume(self.checkpointable)["step"]
                self.guard = NonFiniteGuard(self.cfg.train.on_nonfinite, self.cfg.train.max_consecutive_skips)
                progress.close()
                progress = run.start_progress(plan.total_steps, step, self.kind)
                window, window_start = defaultdict(list), time.perf_counter()
                continue
            first_after_loading = False
            step += 1
            for key, value in (metrics or {}).items():
                window[key].append(value)
            progress.update(1, **{self.progress_key.split("/")[-1]: metrics[self.progress_key]} if metrics else {})
            if step % self.cfg.log.every_steps == 0 or step == plan.total_steps:
                self._log_window(step, window, time.perf_counter() - window_start)
                window, window_start = defaultdict(list), time.perf_counter()
            every = self.cfg.eval.every_steps
            if every and step % every == 0 and step < plan.total_steps:
                try:
                    evaluation = self.evaluate()
                except StepAbandoned:
                    return self._stopped(step, f" during the evaluation at step {step}, which is not logged")
                run.log(step, evaluation)
                window_start = time.perf_counter()  # keep eval time out of the throughput window
                if stop_rule is not None and stop_rule.met(evaluation):
                    log.info(f"early stop at step {step} of {plan.total_steps}: {stop_rule.metric}="
                             f"{evaluation[stop_rule.metric]:.4g} meets eval.stop_when {stop_rule}")
                    return self._finish(step, before, evaluation, stopped_early={"rule": str(stop_rule), "step": step})
            run.maybe_checkpoint(self.checkpointable, step)
            if run.stop_requested():
                return self._stopped(step)
        try:
            after = self.evaluate()
        except StepAbandoned:
            return self._stopped(step, " during the final evaluation")
        run.log(step, after)
        return self._finish(step, before, after)

    def _stopped(self, step: int, during: str = "") -> dict:
        """A stop request: checkpoint the `step` steps done (none: nothing to save) and end the run,
        which the same command resumes (the CLI exits EXIT_REQUEUE)."""
        if step:
            self._checkpoint_once(step)
            log.info(f"stop requested{during}: checkpointed at step {step}; rerun the same command to resume")
        else:
            log.info(f"stop requested{during}: no step done, nothing to checkpoint; rerun the same command to start")
        self.run.finish()
        return {"status": "stopped", "step": step}

    def _length(self) -> str:
        """The setting that decides the run's length, as `train.max_steps=5` (or epochs and their steps)."""
        train = self.cfg.train
        return (f"train.max_steps={train.max_steps}" if train.max_steps is not None
                else f"train.epochs={train.epochs} ({self.plan.total_steps} steps)")

    def _require_steps_left(self, step: int, where: str) -> None:
        """A run folder already past this run's length: nothing to train, and finishing would export a model of
        more steps than asked for. A ConfigError names both numbers and the two ways on."""
        if step > self.plan.total_steps:
            self.run.finish()
            raise ConfigError(f"{self._length()}, but the run in {self.run.dir} {where} step {step}: nothing to train; "
                              f"raise train.max_steps above {step} to train on, or use a new --output-dir for a run "
                              f"of {self.plan.total_steps} steps")

    def _finish(self, step: int, before: dict | None, after: dict, **extra: Any) -> dict:
        """Checkpoint, exported model and summary of a run that is done (at its last step or early)."""
        run = self.run
        if self.cfg.checkpoint.at_end:
            self._checkpoint_once(step)
        if self.cfg.checkpoint.save_model:
            self.save_outputs()  # a full disk: hpcrlhf.models.export says so
        summary = {"status": "done", "step": step, "before": before, "after": after, **extra}
        run.write_summary(summary)
        log.info("after training: " + format_metrics(after))
        run.finish()
        return summary

    def guarded_step(self, step: int) -> dict[str, float] | None:
        """`train_step` under the NaN/Inf guard: its metrics, or None for a skipped step (the
        guard raises TrainingError when the run must stop)."""
        self.guard.begin(step + 1)
        before = self.skipped_updates()
        metrics, skipped_inputs = None, None
        with self.run.timed("step"):
            try:
                metrics = self.train_step(step)
            except SkipStep as skip:
                skipped_inputs = skip.what
        if metrics is not None and before is not None:
            metrics[f"train/{SKIPPED_SUFFIX}"] = float(self.skipped_updates() - before)
        if self.guard.after_step(metrics, skipped_inputs):
            return None
        return {k: v for k, v in metrics.items() if not k.endswith(SKIPPED_SUFFIX)}  # train/skipped_steps says it

    def skipped_updates(self) -> int | None:
        """Optimizer steps the trained engine has refused so far (non-finite gradients); None for
        trainers whose updates report it in their metrics (`*skipped_updates`)."""
        return self.engine.skipped_updates

    def _log_window(self, step: int, window: dict[str, list[float]], elapsed_s: float) -> None:
        """Mean of each train metric since the last log, plus lr, grad norm, epoch and throughput
        (skipped steps count in the time, not in the means)."""
        tokens = sum(window.pop("train/tokens", [0.0]))
        samples = sum(window.pop("train/samples", [0.0]))
        n = max(len(window.get("train/loss", ())), 1)
        skipped = {"train/skipped_steps": float(self.guard.skipped)} if self.guard.skipped else {}
        timings = {k: v / n for k, v in self.run.pop_timings().items()}
        self.run.log(step, {**{k: sum(v) / len(v) for k, v in window.items()}, **self.optimizer_stats(), **skipped,
                            "train/epoch": step / self.plan.steps_per_epoch,
                            "throughput/tokens_per_sec": tokens / elapsed_s,
                            "throughput/samples_per_sec": samples / elapsed_s,
                            **timings, **idle_shares(timings)})

    def optimizer_stats(self) -> dict[str, float | None]:
        """The trained model's learning rate and last gradient norm."""
        return self.engine.optimizer_stats()

    def _checkpoint_once(self, step: int) -> None:
        if self.run.checkpoints.latest() != self.run.checkpoints.path_for(step):
            self.run.save_checkpoint(self.checkpointable, step)


def merge_evaluation(*parts: Mapping[str, Any]) -> dict[str, Any]:
    """One evaluation's metrics from its parts. hpcrlhf's own never share a name, so a name in two
    parts is one of `eval.metrics` named like a metric the job reports: one would hide the other."""
    out: dict[str, Any] = {}
    for part in parts:
        clash = sorted(set(out) & set(part))
        if clash:
            raise ConfigError(f"eval.metrics: a metric function named {clash[0].removeprefix('eval/')!r} is reported as "
                              f"{clash[0]}, which this job's evaluation reports already; rename the function")
        out.update(part)
    return out


def format_metrics(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
