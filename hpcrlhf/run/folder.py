"""What every trainer does around its own maths: the run folder, metrics, checkpoints, resume,
stop requests, progress and timing.

A trainer builds a `Run` once, asks it where to start (`resume`), calls `log`/`maybe_checkpoint`
as it goes, and `finish` at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import torch
import yaml

from hpcrlhf import __version__
from hpcrlhf.config.loader import flat_settings, to_dict, to_yaml
from hpcrlhf.config.schema import TrainJobConfig
from hpcrlhf.engines.distributed import DistEnv, all_reduce_sum, barrier, on_main_rank
from hpcrlhf.errors import ConfigError, HpcrlhfError, TrainingError
from hpcrlhf.logs import THIRD_PARTY_LOG, Progress, get_logger, third_party_to
from hpcrlhf.run.checkpoint import CheckpointDir
from hpcrlhf.run.diskspace import DiskFull, folder_bytes, out_of_space_is_an_error
from hpcrlhf.run.files import append, make_folders, path_problem, refuse, replace_file
from hpcrlhf.run.lock import RunLock
from hpcrlhf.run.metrics import MetricsWriter, read_metrics
from hpcrlhf.run.trackers import LEDGER, Trackers, require_installed
from hpcrlhf.run.versions import software_versions
from hpcrlhf.run.signals import StopFlag, StopRequested
from hpcrlhf.run.watchdog import Watchdog, watched

log = get_logger()


def environment_record(env: DistEnv) -> dict[str, Any]:
    """Where and with what this attempt of the run started (one line of environment.jsonl)."""
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(), "hpcrlhf": __version__,
            "python": sys.executable, "torch": torch.__version__, "software": software_versions(),
            "world_size": env.world_size,
            "container": os.environ.get("APPTAINER_CONTAINER"), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_nodes": os.environ.get("SLURM_JOB_NODELIST"),
            "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", 0))}


SAFE_CHANGES = ("train.max_steps", "train.on_nonfinite", "train.max_consecutive_skips", "eval.every_steps",
                "eval.stop_when", "eval.batch_size", "log.", "checkpoint.every_steps", "checkpoint.keep_last",
                "checkpoint.verify", "checkpoint.save_model", "checkpoint.at_end", "reward.rule_timeout_s",
                "eval.metric_timeout_s", "eval.keep_best", "eval.keep_best_mode",
                "placement.vllm.max_restarts", "placement.local_network", "watchdog.",
                "rollout.vllm_kv_cache_gb", "rollout.vllm_enforce_eager", "rollout.vllm_max_num_seqs", "rollout.vllm_max_num_batched_tokens")
"""Settings a rerun may change on a run that has checkpoints (a prefix ends with a dot): how long it
trains (a new `train.max_steps` stretches the rest of the learning-rate schedule to the new end),
how often it evaluates, logs and checkpoints, how long the user's rules may take, and engine limits
that change neither what is trained nor what is sampled. Any other change would resume one run with
another's settings."""
RUN_FILES = ("run.lock", "metrics.jsonl", "environment.jsonl", "config.yaml", "summary.json", "placement.json",
             "reference_logps.pt", THIRD_PARTY_LOG, LEDGER)
"""The files hpcrlhf writes at the top of a run folder (reference_logps.pt: hpcrlhf.trainers.offline_policy;
third_party.log: hpcrlhf.logs; trackers.json: hpcrlhf.run.trackers)."""
IN_PLACE_FILES = ("run.lock", "metrics.jsonl", "environment.jsonl", THIRD_PARTY_LOG)
"""Those written in place (appended to, or rewritten through the lock's descriptor), not replaced."""
RUN_FOLDERS = ("checkpoints", "model", "best", "tensorboard", "wandb", "mlruns", "rounds", "watchdog")
"""The folders it writes there (rounds/: hpcrlhf.trainers.rs; best/: eval.keep_best; watchdog/: the stacks
of a hang, hpcrlhf.run.watchdog; tensorboard/, wandb/, mlruns/: log.backends, hpcrlhf.run.trackers)."""
IGNORED_CHANGES = ("output_dir", "checkpoint.resume")
"""Settings of the attempt, not of the run: where the folder is named from, and whether to resume."""


def config_changes(before: dict[str, Any], after: dict[str, Any],
                   defaults: dict[str, Any] | None = None) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (folder's value, new value) for every setting that differs (pure). A key the
    folder's config lacks while the new value is its default (`defaults`) is no change: a setting
    added by a later hpcrlhf, which the run used without its name."""
    old, new, default = flat_settings(before), flat_settings(after), flat_settings(defaults or {})
    added = {k for k in new if k not in old and k in default and new[k] == default[k]}
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k) and not k.startswith(IGNORED_CHANGES) and k not in added}


def is_safe_change(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_CHANGES)


def _show(changes: dict[str, tuple[Any, Any]]) -> str:
    return "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())


class StepAbandoned(Exception):
    """A stop request came during a step or an evaluation, and every rank agreed to drop it
    (`Run.stoppable`); internal: `TrainingLoop.fit` checkpoints the steps done and ends the run."""


class Run:
    """A run folder owned by this job. The main rank checks and prepares it before anything is
    written there (every rank then agrees on the outcome): the folder is a writable folder, no
    other job owns it (`run.lock`), the checkpoint to resume from, a rerun's config against the
    folder's (`SAFE_CHANGES`), a metrics history without checkpoints set aside; only then are
    config.yaml and this attempt's line of environment.jsonl written."""

    def __init__(self, cfg: TrainJobConfig, env: DistEnv):
        self.cfg, self.env = cfg, env
        self.dir = Path(cfg.output_dir)
        self.checkpoints = CheckpointDir(self.dir / "checkpoints", keep_last=cfg.checkpoint.keep_last,
                                         sha256=cfg.checkpoint.verify == "sha256")
        self.lock: RunLock | None = None
        resume_from, finished = on_main_rank(self._prepare, env.is_main)  # every rank fails alike, none waits
        third_party_to(cfg.log.third_party, self.dir / THIRD_PARTY_LOG)
        self.resume_from = Path(resume_from) if resume_from else None
        self.finished: dict[str, Any] | None = finished
        """The summary of a run this folder holds that is done (`summary.json`), else None."""
        self.metrics = MetricsWriter(self.dir, enabled=env.is_main, trackers=self._open_trackers())
        self.stop = StopFlag().install()
        self.timings: dict[str, float] = {}
        self.progress: Progress | None = None
        self.ended: str | None = None
        """How this attempt ended, once `finish` has run."""
        self.watchdog = Watchdog.of_rank(cfg.watchdog, self.dir / "watchdog", env.rank, env.world_size)
        """Deadlines of this process's waits: every `timed` phase (and each `watched` one); on Ray the driver's
        gathers name the workers they still wait for and end at the deadline (hpcrlhf.cluster.worker_group.wait_any)."""

    def _open_trackers(self) -> Trackers | None:
        """The main rank's trackers (log.backends), each continuing the run's tracked run; a tracker that
        cannot start fails every rank alike."""
        def open_them() -> Trackers | None:
            try:
                return Trackers(self.cfg, self.dir) if self.cfg.log.backends else None
            except HpcrlhfError:
                self.lock.release()
                raise

        return on_main_rank(open_them, self.env.is_main, share=False)

    def _prepare(self) -> tuple[str | None, dict[str, Any] | None]:
        """Main rank: everything `Run` checks before writing; returns the checkpoint to resume from and
        the summary of a finished run. An error releases the lock it took."""
        try:
            return self._prepare_folder()
        except HpcrlhfError:
            if self.lock is not None:
                self.lock.release()
            raise

    def _prepare_folder(self) -> tuple[str | None, dict[str, Any] | None]:
        require_installed(self.cfg.log.backends)
        if self.dir.exists() and not self.dir.is_dir():
            raise ConfigError(f"--output-dir {self.dir} is a file, not a folder: name a new or existing run folder")
        make_folders(self.dir, "--output-dir")
        refuse(self.planted())
        self.lock = RunLock(self.dir).acquire()
        resume_from = self._checkpoint_to_resume()
        finished = self._finished()
        changes = self._check_config(resume_from)
        if resume_from is None and finished is None:  # a finished run without checkpoints keeps its history
            self._set_history_aside()
        record = environment_record(self.env)
        if changes:
            record["config_changes"] = {k: list(v) for k, v in changes.items()}
        with out_of_space_is_an_error(self.dir, "config.yaml"):
            replace_file(self.dir / "config.yaml", to_yaml(self.cfg))
            append(self.dir / "environment.jsonl", (json.dumps(record) + "\n").encode())  # one line per start
        return (str(resume_from) if resume_from else None), finished

    def _finished(self) -> dict[str, Any] | None:
        """The summary a run wrote when it was done (`summary.json`), else None: a rerun of a finished run
        returns it without training again, also when no checkpoint holds its last step (checkpoint.at_end=false)."""
        path = self.dir / "summary.json"
        if not path.exists():
            return None
        try:
            summary = json.loads(path.read_text())
            problem = None if isinstance(summary, dict) and summary.get("status") == "done" and \
                isinstance(summary.get("step"), int) else "no status 'done' and step"
        except (OSError, ValueError) as e:
            problem = str(e)
        if problem:
            raise ConfigError(f"{path} is not the summary of a finished run ({problem}): remove it to resume the run "
                              "from its latest checkpoint, or use a new --output-dir")
        return summary

    def planted(self) -> list[str | None]:
        """What sits in the run folder where hpcrlhf writes and is not what it writes there (a link, a
        FIFO, a folder for a file: hpcrlhf.run.files), one problem per entry (None: fine)."""
        d = self.dir
        return ([path_problem(d / name, in_place=name in IN_PLACE_FILES) for name in RUN_FILES]
                + [path_problem(d / name, "folder") for name in RUN_FOLDERS]
                + [path_problem(d / "checkpoints" / "latest")])

    def _check_config(self, resume_from: Path | None) -> dict[str, tuple[Any, Any]]:
        """A rerun on a run with checkpoints (or a finished one) may change only `SAFE_CHANGES`; the
        changes it makes are returned (logged, and recorded in environment.jsonl)."""
        saved = self.dir / "config.yaml"
        if not saved.exists() or (resume_from is None and not (self.dir / "summary.json").exists()):
            return {}
        try:
            before = yaml.safe_load(saved.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{saved} cannot be read ({e}): the run's own config is damaged; restore it, or use a new "
                              "--output-dir") from None
        changes = config_changes(before if isinstance(before, dict) else {}, to_dict(self.cfg), to_dict(type(self.cfg)()))
        unsafe = {k: v for k, v in changes.items() if not is_safe_change(k)}
        if unsafe:
            raise ConfigError(
                f"the config differs from the run in {self.dir} ({saved.name}) in settings that change what it trains: "
                f"{_show(unsafe)}. Resuming would mix two runs: rerun with the folder's values, or use a new "
                f"--output-dir for the new settings. A rerun may change: "
                f"{', '.join(k + '*' if k.endswith('.') else k for k in SAFE_CHANGES)}")
        if changes:
            log.info(f"rerun of {self.dir} with changed settings (allowed on a rerun): {_show(changes)}")
        return changes

    def _set_history_aside(self) -> None:
        """No checkpoint to resume from, but metrics of earlier steps: the run starts again from step
        0, so its old history is moved aside (never mixed with the new one, never deleted)."""
        old = [m["step"] for m in read_metrics(self.dir) if m["step"] > 0]
        if not old:
            return
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = [name for name in ("metrics.jsonl", "tensorboard", "summary.json", LEDGER) if (self.dir / name).exists()]
        for name in aside:
            os.replace(self.dir / name, self.dir / f"{Path(name).stem}.before-{stamp}{Path(name).suffix}")
        log.warning(f"{self.dir} has metrics up to step {max(old)} but no checkpoint to resume from: training starts "
                    f"again from step 0; the earlier history is kept as {', '.join(f'{Path(n).stem}.before-{stamp}' for n in aside)}")

    def _checkpoint_to_resume(self) -> Path | None:
        policy = self.cfg.checkpoint.resume
        if policy == "never":
            existing = self.checkpoints.complete()  # whatever `latest` says
            if existing:
                raise ConfigError(
                    f"checkpoint.resume: 'never' but {self.dir} already holds checkpoints ({existing[-1].name}); "
                    "use a new --output-dir, or checkpoint.resume=auto to continue that run"
                )
            return None
        if policy == "auto":
            return self.checkpoints.latest_intact()
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

    def fall_back(self, why: str) -> None:
        """The checkpoint this run resumed from gave a NaN/Inf first step (`why`): its files are damaged
        in a way their recorded sizes cannot show. It is marked damaged and `resume_from` becomes the
        previous intact checkpoint (every rank agrees); a TrainingError when there is none to fall
        back to, or when `checkpoint.resume` named this one."""
        self.resume_from = Path(on_main_rank(lambda: str(self._previous_intact(why)), self.env.is_main))

    def _previous_intact(self, why: str) -> Path:
        damaged = self.resume_from
        said = (f"checkpoint {damaged} gave a non-finite first step after loading it ({why}): its files are damaged "
                f"though they have the sizes its manifest records (checkpoint.verify=sha256 would have caught it when "
                f"loading)")
        if self.cfg.checkpoint.resume != "auto":
            raise TrainingError(f"{said}; checkpoint.resume names it: resume from another checkpoint")
        self.checkpoints.mark_damaged(damaged, why)
        log.warning(f"{said}; it is marked damaged (never loaded again)")
        previous = self.checkpoints.latest_intact()  # says which one it takes
        if previous is None:
            raise TrainingError(f"{said}; it is marked damaged and there is no earlier intact checkpoint: rerun the "
                                "same command to start again from step 0")
        return previous

    def _drop_metrics_after(self, step: int) -> None:
        """Steps logged after the checkpoint are redone: drop them so no step appears twice (the file
        is replaced whole: a failure leaves the old one)."""
        kept = [m for m in read_metrics(self.dir) if m["step"] <= step]
        with out_of_space_is_an_error(self.dir, self.metrics.path.name):
            replace_file(self.metrics.path, "".join(json.dumps(m) + "\n" for m in kept))

    def start_progress(self, total: int, initial: int, desc: str) -> Progress:
        self.progress = Progress(total, initial=initial, desc=desc, enabled=self.env.is_main and self.cfg.log.progress)
        return self.progress

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Accumulate wall time under `timing/<name>` until the next `pop_timings`; the wait is watched
        (its total in a step against the watchdog's deadline for `name`)."""
        t0 = time.perf_counter()
        try:
            with self.watched(name):
                yield
        finally:
            self.add_timing(name, time.perf_counter() - t0)

    def watched(self, name: str, per_step: bool = True):
        """A wait the watchdog times (`per_step`: by its total in the step; else each one alone)."""
        return watched(self.watchdog, name, per_step)

    def step_done(self, step: int) -> None:
        """Step `step` has ended: its phases' totals become the watchdog's history."""
        if self.watchdog is not None:
            self.watchdog.step_done(step)

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

    @contextmanager
    def stoppable(self) -> Iterator[None]:
        """Work of a step (or an evaluation) that a stop request cuts short -- a generation
        (`hpcrlhf.engines.hf_generate.StopOnRequest`), the user's rules and metrics
        (`hpcrlhf.run.usercode`: StopRequested leaves the block) -- done by every rank alike. At its end
        every rank learns whether any was asked to stop (one all-reduce); if one was, what the work
        made is incomplete and nothing may learn from it: StepAbandoned on every rank, and the run
        checkpoints the steps done before it (a resumed run redoes the step from its start). Inside,
        no collective may follow the user's code (a rank that leaves early would miss it)."""
        try:
            yield
        except StopRequested:
            pass  # this rank's flag is set: the all-reduce says so to every rank
        if self.stop_requested():
            raise StepAbandoned

    def save_checkpoint(self, engine, step: int, extra: dict[str, Any] | None = None) -> Path:
        """Every rank writes into the step's staging folder; the main rank commits it (manifest,
        rename, `latest`) once all have finished (hpcrlhf.run.checkpoint)."""
        staging = self.checkpoints.staging_for(step)
        latest = self.checkpoints.latest()
        space = dict(needs=folder_bytes(latest) if latest else None,
                     resume_hint=f": it resumes from {latest.name}" if latest else "")
        self._on_main(lambda: self.checkpoints.begin(step), self.checkpoints.root, staging.name, space)
        failed: DiskFull | None = None
        try:
            with out_of_space_is_an_error(self.checkpoints.root, f"checkpoint {staging.name}", **space):
                engine.save_checkpoint(staging, {"step": step, **(extra or {})})
                self.checkpoints.save_rng(staging, self.env.rank)
        except DiskFull as e:
            failed = e
        if all_reduce_sum([float(failed is not None)])[0]:  # every rank learns of it: none waits in a barrier
            barrier()
            if self.env.is_main:
                shutil.rmtree(staging, ignore_errors=True)  # give back the space the partial save took
            raise failed or DiskFull(f"another rank ran out of space writing its part of checkpoint {staging.name} "
                                     f"(see its log){space['resume_hint']}")
        barrier()
        self._on_main(lambda: self.checkpoints.commit(staging, step), self.checkpoints.root, staging.name, space)
        return self.checkpoints.path_for(step)

    def _on_main(self, action, folder: Path, name: str, space: dict[str, Any]) -> None:
        """`action()` on the main rank, a full disk in `folder` reported as one writing checkpoint `name`;
        an HpcrlhfError it raises is raised on every rank (none is left waiting in a collective)."""
        def guarded() -> None:
            with out_of_space_is_an_error(folder, f"checkpoint {name}", **space):
                action()

        on_main_rank(guarded, self.env.is_main)

    def maybe_checkpoint(self, engine, step: int) -> None:
        every = self.cfg.checkpoint.every_steps
        if every and step % every == 0:
            self.save_checkpoint(engine, step)

    def write_summary(self, summary: dict[str, Any]) -> None:
        trackers = self.metrics.trackers
        if trackers is not None and trackers.record():
            summary = {**summary, "trackers": trackers.record()}
        if self.env.is_main:
            with out_of_space_is_an_error(self.dir, "summary.json"):
                replace_file(self.dir / "summary.json", json.dumps(summary, indent=2) + "\n")

    def finish(self, ended: str = "done") -> None:
        """The attempt ends (`ended`: done, stopped, hung, failed): the watchdog, the progress bar and the
        trackers close (each says where its record is and how to see or upload it)."""
        if self.ended:
            return
        self.ended = ended
        if self.watchdog is not None:
            self.watchdog.stop(until_exit=True)  # a hung run's teardown stays under the grace exit
        if self.progress is not None:
            self.progress.close()
        trackers = self.metrics.trackers
        notes = trackers.notes() if trackers is not None else []
        self.metrics.close(ended)
        for note in notes:
            log.info(note)
        if self.lock is not None:
            self.lock.release()
