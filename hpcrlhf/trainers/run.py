"""What every trainer does around its own maths: the run folder, metrics, checkpoints, resume,
stop requests, progress and timing.

A trainer builds a `Run` once, asks it where to start (`resume`), calls `log`/`maybe_checkpoint`
as it goes, and `finish` at the end.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from hpcrlhf.checkpoint import CheckpointDir
from hpcrlhf.config.loader import to_yaml
from hpcrlhf.engines.distributed import DistEnv, all_reduce_sum, barrier
from hpcrlhf.errors import ConfigError
from hpcrlhf.logs import Progress, get_logger
from hpcrlhf.metrics import MetricsWriter, read_metrics
from hpcrlhf.signals import StopFlag

log = get_logger()


def environment_record(env: DistEnv) -> dict[str, Any]:
    """Where and with what this attempt of the run started (one line of environment.jsonl)."""
    import torch

    from hpcrlhf import __version__

    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(), "hpcrlhf": __version__,
            "python": sys.executable, "torch": torch.__version__, "world_size": env.world_size,
            "container": os.environ.get("APPTAINER_CONTAINER"), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_nodes": os.environ.get("SLURM_JOB_NODELIST"),
            "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", 0))}


class Run:
    def __init__(self, cfg, env: DistEnv):
        self.cfg, self.env = cfg, env
        self.dir = Path(cfg.output_dir)
        self.checkpoints = CheckpointDir(self.dir / "checkpoints", keep_last=cfg.checkpoint.keep_last,
                                         sha256=cfg.checkpoint.verify == "sha256")
        if env.is_main:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "config.yaml").write_text(to_yaml(cfg))
            with open(self.dir / "environment.jsonl", "a") as f:  # one line per start: requeues add lines
                f.write(json.dumps(environment_record(env)) + "\n")
        barrier()
        self.resume_from = self._checkpoint_to_resume()
        self.metrics = MetricsWriter(self.dir, enabled=env.is_main, tensorboard=cfg.log.tensorboard)
        self.stop = StopFlag().install()
        self.timings: dict[str, float] = {}
        self.progress: Progress | None = None

    def _checkpoint_to_resume(self) -> Path | None:
        policy = self.cfg.checkpoint.resume
        latest = self.checkpoints.latest_intact() if policy == "auto" else self.checkpoints.latest()
        if policy == "never":
            if latest is not None:
                raise ConfigError(
                    f"checkpoint.resume: 'never' but {self.dir} already holds checkpoints ({latest.name}); "
                    "use a new --output-dir, or checkpoint.resume=auto to continue that run"
                )
            return None
        if policy == "auto":
            return latest
        path = Path(policy)
        if not (path.is_dir() and any(path.glob("*model_states.pt"))):
            raise ConfigError(f"checkpoint.resume: '{policy}' is not a checkpoint folder (e.g. {self.dir}/checkpoints/step_000100)")
        return path

    def resume(self, engine) -> dict[str, Any]:
        """Load the checkpoint to resume from (if any) into `engine`; returns its client state."""
        if self.resume_from is None:
            return {"step": 0}
        state = engine.load_checkpoint(self.resume_from)
        self.checkpoints.load_rng(self.resume_from, self.env.rank)
        log.info(f"resumed from {self.resume_from} at step {state['step']}")
        if self.env.is_main:
            self._drop_metrics_after(state["step"])
        return state

    def _drop_metrics_after(self, step: int) -> None:
        """Steps logged after the checkpoint are redone: drop them so no step appears twice."""
        kept = [m for m in read_metrics(self.dir) if m["step"] <= step]
        self.metrics.path.write_text("".join(json.dumps(m) + "\n" for m in kept))

    def start_progress(self, total: int, initial: int, desc: str) -> Progress:
        self.progress = Progress(total, initial=initial, desc=desc, enabled=self.env.is_main and self.cfg.log.progress)
        return self.progress

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Accumulate wall time under `timing/<name>` until the next `pop_timings`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add_timing(name, time.perf_counter() - t0)

    def add_timing(self, name: str, seconds: float) -> None:
        key = f"timing/{name}"
        self.timings[key] = self.timings.get(key, 0.0) + seconds

    def pop_timings(self) -> dict[str, float]:
        out, self.timings = self.timings, {}
        return out

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.metrics.log(step, metrics)

    def stop_requested(self) -> bool:
        """Whether any rank received a stop signal (all ranks must call this together)."""
        return all_reduce_sum([1.0 if self.stop.requested else 0.0])[0] > 0

    def save_checkpoint(self, engine, step: int, extra: dict[str, Any] | None = None) -> Path:
        """Every rank writes into the step's staging folder; the main rank commits it (manifest,
        rename, `latest`) once all have finished (hpcrlhf.checkpoint)."""
        staging = self.checkpoints.staging_for(step)
        engine.save_checkpoint(staging, {"step": step, **(extra or {})})
        self.checkpoints.save_rng(staging, self.env.rank)
        barrier()
        if self.env.is_main:
            self.checkpoints.commit(staging, step)
        barrier()
        return self.checkpoints.path_for(step)

    def maybe_checkpoint(self, engine, step: int) -> None:
        every = self.cfg.checkpoint.every_steps
        if every and step % every == 0:
            self.save_checkpoint(engine, step)

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.env.is_main:
            (self.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    def finish(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self.metrics.close()
