"""The fit loop every job shares (SFT, RM, DPO, KTO, CSFT, rejection sampling, PPO).

A trainer calls `setup(cfg)`, builds its models and plan (`self.plan`: total steps, steps per
epoch), and supplies what differs between jobs: `train_step(step)` (one step; returns `train/*`
metrics for that step, `train/tokens` included), `evaluate()`, and what its models are
(`checkpointable`, `trained_weights`, `optimizer_stats`, `skipped_updates`, `save_outputs`: one
trained engine in `single_model.SingleModelTrainer`, PPO's roles in `ppo.driver.PPOTrainer`). The
loop owns the rest: the run folder, resume, progress, windowed metrics, periodic evaluation and
checkpoints, the NaN/Inf guard, stop requests, early stopping, the exported model and the summary.
`eval_means` is the shared shape of an evaluation: means over items sharded over ranks.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any, NoReturn, Protocol
from collections.abc import Callable, Mapping, Sequence

import torch

from hpcrlhf.config.schema import EvalConfig, TrainJobConfig
from hpcrlhf.config.stop_rule import parse_stop_rule
from hpcrlhf.data.loading import held_out_prompt_rows, task_note
from hpcrlhf.data.tasks import build_task
from hpcrlhf.engines.rollout.contract import SamplingParams
from hpcrlhf.errors import ConfigError, HpcrlhfError, Hung
from hpcrlhf.logs import get_logger
from hpcrlhf.models.context import ContextWindow
from hpcrlhf.models.factory import ModelFactory
from hpcrlhf.rewards.rules import EvalMetrics, check_rules
from hpcrlhf.rewards.sampled import sampling_for
from hpcrlhf.run.folder import Run, StepAbandoned
from hpcrlhf.run.guard import SKIPPED_SUFFIX, NonFiniteError, NonFiniteGuard, SkipStep, require_finite_start
from hpcrlhf.run.metrics import read_metrics
from hpcrlhf.run.stats import Stats, add_stats, new_stats, reduce_means
from hpcrlhf.run.watchdog import Expiry, WaitExpired
from hpcrlhf.trainers.batches import BatchPlan, PPOPlan, eval_shards
from hpcrlhf.trainers.best import BEST_FOLDER, BestModel
from hpcrlhf.trainers.seeds import eval_sampling_seed

log = get_logger()


class Checkpointable(Protocol):
    """What a checkpoint saves and restores (`Run.save_checkpoint`, `Run.resume`)."""

    def save_checkpoint(self, folder: Path, client_state: dict[str, Any]) -> None: ...

    def load_checkpoint(self, folder: Path) -> dict[str, Any]: ...


def idle_shares(timings: dict[str, float]) -> dict[str, float]:
    """`util/<role>_idle` = 1 - `timing/busy_<role>` / `timing/step`: the share of a step a role's
    workers waited (verl's idle_ratio), where the runtime measures busy time."""
    step = timings.get("timing/step", 0.0)
    return {f"util/{key.removeprefix('timing/busy_')}_idle": min(max(1.0 - value / step, 0.0), 1.0)
            for key, value in timings.items() if key.startswith("timing/busy_") and step > 0}


CHECKPOINTABLE = frozenset({"generate", "reward", "make_experience", "generate_ahead_wait", "evaluate"})
"""Phases that apply nothing of a step: when one hangs, the steps done before it can still be checkpointed."""


def eval_sampling_params(e: EvalConfig, seed: int, max_new_tokens: int) -> SamplingParams:
    """How evaluation draws its answers to held-out prompts (in-run and `hpcrlhf eval`): greedy, or
    `eval.samples_per_prompt` samples each at `eval.temperature` (1.0 when null) and `eval.top_p`, seeded
    by `eval_sampling_seed(seed)`: the same draws at every evaluation, and for every model compared."""
    if not e.sampled:
        return SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens)
    return SamplingParams(n=e.samples_per_prompt, temperature=e.temperature or 1.0, top_p=e.top_p,
                          max_new_tokens=max_new_tokens, seed=eval_sampling_seed(seed))


class TrainingLoop:
    """A job's training loop (`fit`); subclasses supply the steps, the evaluation and their models."""

    kind = "train"
    progress_key = "train/loss"
    """The metric shown next to the progress bar."""
    value_head = False
    """True for trainers whose model is a value model (reward model), else a causal LM: a value
    model generates nothing, so evaluation answers no held-out prompts."""
    plan: BatchPlan | PPOPlan
    """The run's length (`total_steps`, `steps_per_epoch`) and batch arithmetic."""

    # -- construction ---------------------------------------------------------------------------
    def setup(self, cfg: TrainJobConfig) -> None:
        self.setup_process(cfg)
        self.run = Run(cfg, self.env)
        self.setup_evaluation()

    def setup_evaluation(self) -> None:
        """The task that applies (logged when `auto` decides it), what evaluation scores each
        generated answer with (`self.metrics`: task score and `eval.metrics`, imported now) and the
        held-out prompts it answers (`self.held_out`: rows and their prompt field; none for a value
        model). A mistake in any of them, or in a reward rule, fails here, before a model loads."""
        cfg = self.cfg
        self.window = ContextWindow.of(cfg.model.path)
        """The generating model's positions: each prompt plus its response must fit."""
        note = task_note(cfg.task, cfg.data)
        if note:
            log.info(note)
        check_rules(cfg)
        self.task = build_task(cfg.task, cfg.data)
        self.metrics = EvalMetrics(cfg.eval.metrics, self.task, timeout_s=cfg.eval.metric_timeout_s, rules=cfg.rules)
        self.eval_sampling = sampling_for(cfg.eval, cfg.rules, self.task)
        """How several sampled answers per held-out prompt are judged (None: one answer each)."""
        # no prompts to answer: a reward model's job, or SFT on conversations (eval/loss is their evaluation)
        self.held_out = (([], cfg.data.prompt_key) if self.value_head or getattr(cfg.data, "messages_key", None)
                         else held_out_prompt_rows(cfg.data, cfg.task, cfg.eval.score_prompts))

    def setup_process(self, cfg: TrainJobConfig) -> None:
        """This process's rank in its group, seed, tokenizer and model factory (hpcrlhf.models.factory)."""
        self.cfg = cfg
        self.models = ModelFactory(cfg)
        self.env, self.tokenizer, self.pad_id = self.models.env, self.models.tokenizer, self.models.pad_id

    @property
    def device(self) -> torch.device:
        return self.models.device

    def evaluated_models(self) -> dict[str, str]:
        """Config field -> path of each model evaluation runs, the trained one first (named when the
        first evaluation is NaN/Inf)."""
        return {"model.path": self.cfg.model.path}

    # -- what each trainer supplies -------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        raise NotImplementedError

    @property
    def checkpointable(self) -> Checkpointable:
        """What a checkpoint saves and restores: the trained engine, or a trainer's composite of several."""
        raise NotImplementedError

    def trained_weights(self):
        """The trained model's (name, tensor) pairs (checked when the first evaluation is NaN/Inf),
        None when this process does not hold them whole."""
        raise NotImplementedError

    def optimizer_stats(self) -> dict[str, float | None]:
        """The trained model's learning rate and last gradient norm, logged with each window."""
        raise NotImplementedError

    def skipped_updates(self) -> int | None:
        """Optimizer steps the trained engine has refused so far (non-finite gradients); None for
        trainers whose updates report it in their metrics (`*skipped_updates`)."""
        raise NotImplementedError

    def save_outputs(self, folder: str = "model", files: dict[str, str] | None = None) -> None:
        """Write the model into `folder` of the run folder (`model/`: the final one; `best/`:
        eval.keep_best's), with `files` (name -> text) beside it."""
        raise NotImplementedError

    # -- the shared shape of an evaluation -------------------------------------------------------
    def eval_params(self, max_new_tokens: int) -> SamplingParams:
        """How evaluation draws its answers to the held-out prompts: greedy, or `eval.samples_per_prompt`
        samples each at `eval.temperature` (1.0 when null) and `eval.top_p`, with the run's evaluation seed."""
        return eval_sampling_params(self.cfg.eval, self.cfg.seed, max_new_tokens)

    def eval_means(self, items: Sequence, batch_stats: Callable[[list], Stats]) -> dict[str, float]:
        """Means of `batch_stats` over `items`, sharded over ranks (ZeRO-3 safe)."""
        sums = new_stats()
        for batch, dummy in eval_shards(items, self.env, self.cfg.eval.batch_size):
            stats = batch_stats(batch)
            add_stats(sums, {k: (0.0, 0.0) for k in stats} if dummy else stats)
        return reduce_means(sums)

    def fit(self) -> dict:
        """Train to the end (or a stop); a wait past its watchdog deadline ends the run with `Hung` (exit 4)."""
        self.steps_done = 0
        try:
            return self._fit()
        except WaitExpired as e:
            self._hung(e.expiry)
        except BaseException:
            self.run.finish("failed")  # the trackers record the attempt as failed (a no-op when it ended already)
            raise

    def _hung(self, expiry: Expiry) -> NoReturn:
        """A wait hung: checkpoint the steps done when nothing of the step was applied yet (the hung phase
        comes before the update: generation, rewards, scoring, evaluation), then end the run (Hung: exit 4)."""
        step, done = self.steps_done, ""
        if step and expiry.kind in CHECKPOINTABLE:
            try:
                self._checkpoint_once(step)
                done = f"; checkpointed at step {step}"
            except (WaitExpired, HpcrlhfError) as e:
                done = f"; the checkpoint at step {step} failed too ({e})"
        elif step:
            done = f"; no checkpoint: {expiry.kind} may have applied part of step {step + 1}"
        self.run.finish("hung")
        latest = self.run.checkpoints.latest()
        resume = f"from its checkpoint {latest.name}" if latest is not None else "from the start (no checkpoint)"
        raise Hung(f"{expiry.message()}{done}; rerun the same command to resume {resume}", expiry.parties)

    def _fit(self) -> dict:
        run, plan = self.run, self.plan
        finished = run.finished
        if finished is not None and (finished["step"] == plan.total_steps or finished.get("stopped_early")):
            log.info(f"{run.dir} is already complete ({finished['step']} steps); use a new --output-dir to train again")
            run.finish()
            return finished
        if finished is not None:
            self._require_steps_left(finished["step"], "finished at")
            if run.resume_from is None:
                run.finish("failed")
                raise ConfigError(f"{self._length()}, but the run in {run.dir} finished at step {finished['step']} "
                                  "and keeps no checkpoint to train on from (checkpoint.at_end=false, or deleted): use "
                                  "a new --output-dir")
        step = self.steps_done = run.resume(self.checkpointable)["step"]
        self._require_steps_left(step, "has a checkpoint at")
        if finished is not None and step < finished["step"]:
            log.info(f"{run.dir} finished at step {finished['step']} with no checkpoint there (checkpoint.at_end=false): "
                     f"steps {step + 1}-{finished['step']} are trained again from its checkpoint at step {step}")
        stop_rule = parse_stop_rule(self.cfg.eval.stop_when)
        self.best = BestModel.of_run(self.cfg.eval, run.dir)
        if step == 0:
            try:
                before = self._evaluate()
            except StepAbandoned:
                return self._stopped(step, " during the evaluation before training")
            require_finite_start(before, self.evaluated_models(), self.trained_weights(), self.cfg.engine.precision)
            if stop_rule is not None:  # a misspelt metric fails here, not after hours of training
                stop_rule.require_metric(before)
            if self.best is not None:
                self.best.require_metric(before)
            run.log(0, before)
            log.info("before training: " + format_metrics(before))
        else:  # resumed: the first evaluation is in the run's metrics
            logged = read_metrics(run.dir)
            before = next((m for m in logged if m["step"] == 0 and len(m) > 1), None)
            if self._evaluates_at(step) and not any(m["step"] == step and _evaluation(m) for m in logged):
                log.info(f"no evaluation is logged at step {step} (a stop cut it short, or eval.every_steps changed); it runs now")
                ended = self._evaluate_at(step, before, stop_rule)
                if ended is not None:
                    return ended
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
            step = self.steps_done = step + 1
            run.step_done(step)
            for key, value in (metrics or {}).items():
                window[key].append(value)
            progress.update(1, **{self.progress_key.split("/")[-1]: metrics[self.progress_key]} if metrics else {})
            if step % self.cfg.log.every_steps == 0 or step == plan.total_steps:
                self._log_window(step, window, time.perf_counter() - window_start)
                window, window_start = defaultdict(list), time.perf_counter()
            if self._evaluates_at(step):
                ended = self._evaluate_at(step, before, stop_rule)
                if ended is not None:
                    return ended
                window_start = time.perf_counter()  # keep eval time out of the throughput window
            run.maybe_checkpoint(self.checkpointable, step)
            if run.stop_requested():
                return self._stopped(step)
        try:
            after = self._evaluate()
        except StepAbandoned:
            return self._stopped(step, " during the final evaluation")
        run.log(step, after)
        self._keep_if_best(step, after)
        return self._finish(step, before, after)

    def _evaluate(self) -> dict[str, float]:
        """`evaluate`, watched (each evaluation against the deadline of the ones before)."""
        with self.run.watched("evaluate", per_step=False):
            return self.evaluate()

    def _evaluates_at(self, step: int) -> bool:
        """Whether a periodic evaluation follows step `step` (eval.every_steps; the last step's is the final one)."""
        every = self.cfg.eval.every_steps
        return bool(every) and step % every == 0 and 0 < step < self.plan.total_steps

    def _evaluate_at(self, step: int, before: dict | None, stop_rule) -> dict | None:
        """The periodic evaluation after step `step`: logged, kept when it is the best (eval.keep_best),
        and checked against eval.stop_when. Returns the run's summary when the run ends there (stopped
        during it -- a resumed run evaluates at that step first -- or stopped early), else None."""
        try:
            evaluation = self._evaluate()
        except StepAbandoned:
            return self._stopped(step, f" during the evaluation at step {step}, which runs again on resume")
        self.run.log(step, evaluation)
        self._keep_if_best(step, evaluation)
        if stop_rule is not None and stop_rule.met(evaluation):
            log.info(f"early stop at step {step} of {self.plan.total_steps}: {stop_rule.metric}="
                     f"{evaluation[stop_rule.metric]:.4g} meets eval.stop_when {stop_rule}")
            return self._finish(step, before, evaluation, stopped_early={"rule": str(stop_rule), "step": step})
        return None

    def _keep_if_best(self, step: int, evaluation: Mapping[str, float]) -> None:
        """eval.keep_best: export the model to `best/` when `evaluation` beats the best so far."""
        if self.best is not None and self.best.improved(evaluation):
            self.save_outputs(folder=BEST_FOLDER, files=self.best.files(evaluation, step))
            log.info(f"best {self.best.metric} so far ({evaluation[self.best.metric]:.4g} at step {step}): model "
                     f"exported to {self.run.dir / BEST_FOLDER}")

    def _stopped(self, step: int, during: str = "") -> dict:
        """A stop request: checkpoint the `step` steps done (none: nothing to save) and end the run,
        which the same command resumes (the CLI exits EXIT_REQUEUE)."""
        if step:
            self._checkpoint_once(step)
            log.info(f"stop requested{during}: checkpointed at step {step}; rerun the same command to resume")
        else:
            log.info(f"stop requested{during}: no step done, nothing to checkpoint; rerun the same command to start")
        self.run.finish("stopped")
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
            self.run.finish("failed")
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
        if self.best is not None and self.best.step is not None:
            summary["best"] = self.best.summary()
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


def _evaluation(metrics: Mapping[str, Any]) -> bool:
    """Whether a metrics.jsonl row holds an evaluation (eval/* keys)."""
    return any(k.startswith("eval/") for k in metrics)
