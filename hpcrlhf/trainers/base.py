"""The training loop every single-model trainer shares (SFT, RM, DPO, KTO, ...).

A subclass builds `cfg`, `run`, `plan`, `engine` and `tokenizer`, and supplies the two things
that differ between algorithms: `train_step(step)` (one optimizer step; returns `train/*`
metrics for that step, `train/tokens` included) and `evaluate()`. The loop owns the rest:
resume, progress, windowed metrics, periodic evaluation and checkpoints, stop requests, the
final model and the summary.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

from hpcrlhf.logs import get_logger
from hpcrlhf.metrics import read_metrics

log = get_logger()


class Trainer:
    kind = "train"

    def train_step(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        raise NotImplementedError

    def save_outputs(self) -> None:
        """Write the final model in Hugging Face format into `model/` of the run folder."""
        from hpcrlhf.engines.deepspeed_engine import save_hf_model

        save_hf_model(self.engine, self.tokenizer, Path(self.cfg.output_dir) / "model")

    def fit(self) -> dict:
        run, plan = self.run, self.plan
        step = run.resume(self.engine)["step"]
        done = run.dir / "summary.json"
        if step >= plan.total_steps and done.exists():
            log.info(f"{run.dir} is already complete ({step} steps); use a new --output-dir to train again")
            run.finish()
            return json.loads(done.read_text())
        if step == 0:
            before = self.evaluate()
            run.log(0, before)
            log.info("before training: " + format_metrics(before))
        else:  # resumed: the first evaluation is in the run's metrics
            before = next((m for m in read_metrics(run.dir) if m["step"] == 0 and len(m) > 1), None)
        progress = run.start_progress(plan.total_steps, step, self.kind)
        window: dict[str, list[float]] = defaultdict(list)
        window_start = time.perf_counter()
        while step < plan.total_steps:
            with run.timed("step"):
                metrics = self.train_step(step)
            step += 1
            for key, value in metrics.items():
                window[key].append(value)
            progress.update(1, loss=metrics["train/loss"])
            if step % self.cfg.log.every_steps == 0 or step == plan.total_steps:
                self._log_window(step, window, time.perf_counter() - window_start)
                window, window_start = defaultdict(list), time.perf_counter()
            every = self.cfg.eval.every_steps
            if every and step % every == 0 and step < plan.total_steps:
                run.log(step, self.evaluate())
                window_start = time.perf_counter()  # keep eval time out of the throughput window
            run.maybe_checkpoint(self.engine, step)
            if run.stop_requested():
                self._checkpoint_once(step)
                log.info(f"stop requested: checkpointed at step {step}; rerun the same command to resume")
                run.finish()
                return {"status": "stopped", "step": step}
        after = self.evaluate()
        run.log(step, after)
        self._checkpoint_once(step)
        if self.cfg.checkpoint.save_model:
            self.save_outputs()
        summary = {"status": "done", "step": step, "before": before, "after": after}
        run.write_summary(summary)
        log.info("after training: " + format_metrics(after))
        run.finish()
        return summary

    def _log_window(self, step: int, window: dict[str, list[float]], elapsed_s: float) -> None:
        """Mean of each train metric since the last log, plus lr, grad norm, epoch and throughput."""
        tokens = sum(window.pop("train/tokens", [0.0]))
        n = len(window["train/loss"])
        self.run.log(step, {**{k: sum(v) / len(v) for k, v in window.items()},
                            "train/lr": self.engine.lr(), "train/grad_norm": self.engine.grad_norm(),
                            "train/epoch": step / self.plan.steps_per_epoch,
                            "throughput/tokens_per_sec": tokens / elapsed_s,
                            **{k: v / n for k, v in self.run.pop_timings().items()}})

    def _checkpoint_once(self, step: int) -> None:
        if self.run.checkpoints.latest() != self.run.checkpoints.path_for(step):
            self.run.save_checkpoint(self.engine, step)


def format_metrics(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
