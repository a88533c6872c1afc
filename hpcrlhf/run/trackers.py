"""Experiment trackers (`log.backends`): each metrics record of a run also goes to TensorBoard,
Weights & Biases and MLflow, from the main rank only, after metrics.jsonl (the truth) has it.

A run keeps one tracked run per tracker across its attempts: `RUN/trackers.json` (the ledger) holds
each tracker's id and the last step (and that step's keys) sent to it. A record goes to a tracker only
when its step is past that mark, or at that step with keys not sent yet (the train window and an
evaluation share a step), so a requeued or resumed attempt never sends a step twice: the steps it
redoes after its checkpoint were sent by the attempt that first made them. The ledger is written
before the send (a crash may lose a point, never repeat one). When a tracker opens, the records of
metrics.jsonl past its mark are sent first: a tracker added to a run with history gets the history,
and one dropped after an error catches up. A tracker whose send fails is named, closed and dropped
for the rest of the attempt; its mark goes back, so the next attempt sends what it missed.

W&B's offline mode (compute nodes without network) writes `RUN/wandb/offline-run-*-<id>/`, one
fragment per attempt, all with the run's id; the `wandb sync --id` line printed at the end uploads
them in order. MLflow's default is a file store in the run folder (`RUN/mlruns`)."""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
import re
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from hpcrlhf.config.loader import flat_settings, to_dict
from hpcrlhf.config.schema import TrainJobConfig
from hpcrlhf.config.schema.sections import MLflowConfig, WandbConfig
from hpcrlhf.errors import ConfigError, HpcrlhfError
from hpcrlhf.logs import get_logger
from hpcrlhf.run.diskspace import RESUME_HINT, out_of_space_is_an_error
from hpcrlhf.run.files import replace_file, require_safe
from hpcrlhf.run.metrics import read_metrics
from hpcrlhf.run.versions import software_versions

log = get_logger()

LEDGER = "trackers.json"
MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The module each tracker needs."""
EXIT_CODES = {"done": 0, "stopped": 3, "hung": 4, "failed": 1}
"""How an attempt ended -> the exit code W&B records (the CLI's)."""
WANDB_HOST = "https://api.wandb.ai"


def require_installed(backends: tuple[str, ...], find_spec=importlib.util.find_spec) -> None:
    """A ConfigError naming each tracker of `log.backends` whose package this Python cannot import
    (looked up, not imported): before the run folder is touched or a model loads."""
    missing = [name for name in backends if find_spec(MODULES[name]) is None]
    if missing:
        raise ConfigError(f"log.backends: {', '.join(map(repr, missing))} needs the {', '.join(MODULES[n] for n in missing)} "
                          f"package, which {sys.executable} cannot import: pip install 'hpcrlhf[track]' (wandb, "
                          f"mlflow-skinny), or remove it from log.backends")


# --- pure rules ---------------------------------------------------------------------------------

def numbers(record: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a metrics record (not its step), NaN/Inf (kept as text in metrics.jsonl)
    back to floats; text, flags and lists are left out."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif isinstance(value, str) and value in ("nan", "inf", "-inf"):
            out[key] = float(value)
    return out


def unsent(mark: dict[str, Any], step: int, keys: list[str]) -> list[str]:
    """The keys of a record at `step` that a tracker has not had, given its ledger mark
    (`last_step`, `last_keys`): all past the mark, the new ones at it, none before it."""
    last = mark.get("last_step", -1)
    if step > last:
        return list(keys)
    if step == last:
        sent = set(mark.get("last_keys", ()))
        return [k for k in keys if k not in sent]
    return []


def advance(mark: dict[str, Any], step: int, keys: list[str]) -> dict[str, Any]:
    """The mark after sending `keys` at `step` (pure)."""
    if step == mark.get("last_step", -1):
        keys = sorted(set(mark.get("last_keys", ())) | set(keys))
    return {**mark, "last_step": step, "last_keys": sorted(keys)}


_MLFLOW_KEY = re.compile(r"[^0-9A-Za-z_\-. :/]")


def mlflow_key(key: str) -> str:
    """An hpcrlhf metric name as MLflow accepts it: `@` -> `_at_`, any other character MLflow refuses -> `_`
    (`eval/task_score/pass@4` -> `eval/task_score/pass_at_4`)."""
    return _MLFLOW_KEY.sub("_", key.replace("@", "_at_"))


def settings_as_params(tree: Any) -> dict[str, str]:
    """Dotted setting -> its value as text (MLflow's params)."""
    return {k: json.dumps(v) if isinstance(v, (list, tuple)) else str(v) for k, v in flat_settings(tree).items()}


# --- the ledger -------------------------------------------------------------------------------------

class Ledger:
    """`RUN/trackers.json`: tracker -> its tracked run's identity and mark (main rank only)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LEDGER
        self.entries: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            try:
                entries = json.loads(self.path.read_text())
                if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
                    raise ValueError("not an object of objects")
            except (OSError, ValueError) as e:
                raise ConfigError(f"{self.path} cannot be read ({e}): it names the run's W&B/MLflow runs; restore it, "
                                  "or remove it to log this run's history into new tracked runs") from None
            self.entries = entries

    def save(self) -> None:
        with out_of_space_is_an_error(self.path.parent, LEDGER, resume_hint=RESUME_HINT):
            replace_file(self.path, json.dumps(self.entries, indent=2, sort_keys=True) + "\n")


# --- the trackers -----------------------------------------------------------------------------------

class Tracker:
    """One backend: `identity` (what makes its tracked run: the ledger keeps it with the mark), `send`,
    `close`, and a `note` printed at the end (how to see or upload what it logged)."""

    name = ""
    identity: dict[str, Any] = {}

    def send(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self, ended: str) -> None:
        raise NotImplementedError

    def note(self) -> str | None:
        return None


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        require_safe(run_dir / "tensorboard", "folder")  # its writer follows links
        self.dir = run_dir / "tensorboard"
        self.identity = {"dir": "tensorboard"}
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def send(self, step: int, values: dict[str, float]) -> None:
        with out_of_space_is_an_error(self.dir.parent, "tensorboard/", resume_hint=RESUME_HINT):
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def close(self, ended: str) -> None:
        self.writer.close()


def wandb_credentials(host: str, env: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether W&B has an API key for `host`: WANDB_API_KEY, or an entry in ~/.netrc (`wandb login`)."""
    if env.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc(env.get("NETRC")).authenticators(urlparse(host).hostname or host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(asked: str, env: dict[str, str] | os._Environ = os.environ, timeout_s: float = 3.0) -> tuple[str, str]:
    """(online|offline, why) for log.wandb.mode `asked` (docs/tracking.md); an online run that cannot work
    here (no credentials, no answer from the server) is a ConfigError."""
    host = env.get("WANDB_BASE_URL", WANDB_HOST)
    if asked == "auto" and env.get("WANDB_MODE") in ("online", "offline"):
        asked_by, asked = f"WANDB_MODE={env['WANDB_MODE']}", env["WANDB_MODE"]
    else:
        asked_by = f"log.wandb.mode={asked}"
    if asked == "offline":
        return "offline", asked_by
    if not wandb_credentials(host, env):
        if asked == "online":
            raise ConfigError(f"log.wandb.mode: 'online' ({asked_by}) but this node has no W&B credentials "
                              "(WANDB_API_KEY, or `wandb login` in ~/.netrc): set them, or use log.wandb.mode=offline "
                              "and upload later with `wandb sync`")
        return "offline", "log.wandb.mode=auto: no W&B credentials here (WANDB_API_KEY or ~/.netrc)"
    url = urlparse(host)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()
    except OSError as e:
        if asked == "online":
            raise ConfigError(f"log.wandb.mode: 'online' ({asked_by}) but {host} cannot be reached from this node ({e}): "
                              "use log.wandb.mode=offline (or auto) and upload later with `wandb sync`") from None
        return "offline", f"log.wandb.mode=auto: {host} cannot be reached from this node ({e})"
    return "online", f"{asked_by}: credentials and {host} answer"


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, cfg: WandbConfig, run_dir: Path, entry: dict[str, Any], settings: dict[str, Any]):
        import wandb

        if (entry.get("project"), entry.get("entity")) != (cfg.project, cfg.entity):
            entry = {}  # a new project: a new W&B run
        if entry.get("mode"):
            mode, why = entry["mode"], "the mode of the run's first attempt (its fragments upload in order)"
        else:
            mode, why = wandb_mode(cfg.mode)
        self.identity = {"project": cfg.project, "entity": cfg.entity, "mode": mode,
                         "id": entry.get("id") or secrets.token_hex(6)}
        self.dir = run_dir / "wandb"
        require_safe(self.dir, "folder")
        log.info(f"W&B run {self.identity['id']} ({mode}: {why})")
        init = dict(project=cfg.project, entity=cfg.entity, name=cfg.name or run_dir.resolve().name,
                    group=cfg.group, tags=list(cfg.tags) or None, id=self.identity["id"], mode=mode,
                    dir=str(run_dir), config=settings,
                    settings=wandb.Settings(console="off", silent=True, disable_git=True, x_disable_stats=True,
                                            x_save_requirements=False, reinit="create_new", finish_timeout=60))
        if mode == "online":
            init["resume"] = "allow"  # offline: W&B ignores it; each attempt is a fragment of the same id
        self.run = wandb.init(**init)

    def send(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, ended: str) -> None:
        self.run.finish(exit_code=EXIT_CODES[ended])

    def note(self) -> str | None:
        if self.identity["mode"] != "offline":
            return None
        i = self.identity
        entity = f" -e {i['entity']}" if i["entity"] else ""
        return (f"W&B run {i['id']} was logged offline in {self.dir}: upload it from a node with network with: "
                f"wandb sync --id {i['id']} -p {i['project']}{entity} {self.dir}/offline-run-*-{i['id']}")


class MLflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, cfg: MLflowConfig, run_dir: Path, entry: dict[str, Any], settings: dict[str, Any],
                 config_file: Path):
        uri = cfg.tracking_uri or (run_dir / "mlruns").resolve().as_uri()
        self.file_store = urlparse(uri).scheme in ("", "file")
        if self.file_store:
            if cfg.tracking_uri is None:
                require_safe(run_dir / "mlruns", "folder")
            if "MLFLOW_ALLOW_FILE_STORE" not in os.environ:  # MLflow >= 3.13 refuses its file store without it
                os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        self.Metric, self.uri = Metric, uri
        self.client = client = MlflowClient(uri)
        same_place = (entry.get("tracking_uri"), entry.get("experiment")) == (uri, cfg.experiment)
        run_id = entry.get("run_id") if same_place else None
        versions = {f"hpcrlhf.version.{k}": v for k, v in settings["software"].items()}
        attempt_tags = {"hpcrlhf.slurm_job_id": os.environ.get("SLURM_JOB_ID", ""), "hpcrlhf.host": socket.gethostname()}
        if run_id:
            client.update_run(run_id, "RUNNING")
            client.log_batch(run_id, tags=[RunTag(k, v) for k, v in attempt_tags.items()])
        else:
            experiment = client.get_experiment_by_name(cfg.experiment)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(cfg.experiment)
            run_id = client.create_run(experiment_id, run_name=cfg.run_name or run_dir.resolve().name,
                                       tags={**versions, **attempt_tags, "hpcrlhf.run_dir": str(run_dir.resolve())}).info.run_id
            params = [Param(k, v[:MAX_PARAM_VAL_LENGTH]) for k, v in settings_as_params(settings["config"]).items()]
            for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
                client.log_batch(run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])
            client.log_artifact(run_id, str(config_file))
        self.identity = {"tracking_uri": uri, "experiment": cfg.experiment, "run_id": run_id}
        log.info(f"MLflow run {run_id} in {uri}")

    def send(self, step: int, values: dict[str, float]) -> None:
        ms = int(time.time() * 1000)
        metrics = [self.Metric(mlflow_key(k), v, ms, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's limit of metrics per batch
            self.client.log_batch(self.identity["run_id"], metrics=metrics[i:i + 1000])

    def close(self, ended: str) -> None:
        status = {"done": "FINISHED", "stopped": "KILLED"}.get(ended, "FAILED")
        self.client.set_terminated(self.identity["run_id"], status)

    def note(self) -> str | None:
        if not self.file_store:
            return None
        return (f"MLflow run {self.identity['run_id']} is in the file store {self.uri}: view it with "
                f"MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {self.uri} (the full mlflow package), "
                "or move it to a database with `mlflow migrate-filestore`")


class Trackers:
    """The trackers of a run's main rank, with the ledger that keeps their tracked runs and marks."""

    def __init__(self, cfg: TrainJobConfig, run_dir: Path):
        self.ledger = Ledger(run_dir)
        self.open: list[Tracker] = []
        history = read_metrics(run_dir)
        settings = {"config": to_dict(cfg), "software": software_versions()}
        try:
            for name in cfg.log.backends:
                entry = self.ledger.entries.get(name, {})
                had_events = name == "tensorboard" and (run_dir / "tensorboard").exists()
                tracker = self._open(name, cfg, run_dir, entry, settings)
                if {k: entry.get(k) for k in tracker.identity} != tracker.identity:
                    if entry:
                        log.info(f"{name}: a new tracked run ({_show_identity(tracker.identity)}; this run logged to "
                                 f"{_show_identity({k: entry.get(k) for k in tracker.identity})} before): it gets the "
                                 f"run's history from metrics.jsonl")
                    # event files of a run from before the ledger hold its history already
                    entry = _everything_logged(history) if had_events and not entry else {}
                self.ledger.entries[name] = {**entry, **tracker.identity}
                self.open.append(tracker)
            self.ledger.save()
            for record in history:  # what a tracker new to the run, or dropped before, has not had
                self.log(record["step"], record)
        except BaseException:
            self.close("failed")
            raise

    @staticmethod
    def _open(name: str, cfg: TrainJobConfig, run_dir: Path, entry: dict[str, Any], settings: dict[str, Any]) -> Tracker:
        try:
            if name == "tensorboard":
                return TensorBoardTracker(run_dir)
            if name == "wandb":
                return WandbTracker(cfg.log.wandb, run_dir, entry, settings)
            return MLflowTracker(cfg.log.mlflow, run_dir, entry, settings, run_dir / "config.yaml")
        except HpcrlhfError:
            raise
        except Exception as e:  # noqa: BLE001 -- the library's own error, named with the setting
            raise ConfigError(f"log.backends: {name} could not start ({type(e).__name__}: {e}); fix its settings "
                              f"(log.{name}.*, docs/tracking.md) or remove it from log.backends") from e

    def log(self, step: int, record: dict[str, Any]) -> None:
        values = numbers(record)
        sends = []
        for tracker in self.open:
            mark = self.ledger.entries[tracker.name]
            keys = unsent(mark, step, list(values))
            if keys:
                sends.append((tracker, mark, keys))
                self.ledger.entries[tracker.name] = advance(mark, step, keys)
        if not sends:
            return
        self.ledger.save()  # before the send: a crash may lose a point, never repeat one
        for tracker, mark, keys in sends:
            try:
                tracker.send(step, {k: values[k] for k in keys})
            except Exception as e:  # noqa: BLE001 -- a tracker's failure must not end the training
                self._drop(tracker, mark, e)

    def _drop(self, tracker: Tracker, mark: dict[str, Any], error: Exception) -> None:
        log.warning(f"{tracker.name} failed to log ({type(error).__name__}: {error}); it is left out for the rest of "
                    "this attempt (metrics.jsonl has every metric; the next attempt sends it what it missed)")
        self.ledger.entries[tracker.name] = mark
        self.ledger.save()
        self.open.remove(tracker)
        try:
            tracker.close("failed")
        except Exception:  # noqa: BLE001 -- already failing
            pass

    def notes(self) -> list[str]:
        return [note for note in (t.note() for t in self.open) if note]

    def record(self) -> dict[str, dict[str, Any]]:
        """Each open W&B/MLflow tracker's identity and note (for summary.json)."""
        return {t.name: {**t.identity, **({"note": t.note()} if t.note() else {})}
                for t in self.open if t.name != "tensorboard"}

    def close(self, ended: str) -> None:
        """End every tracker's attempt (`ended`: done, stopped, hung, failed); errors are warnings."""
        for tracker in self.open:
            try:
                tracker.close(ended)
            except Exception as e:  # noqa: BLE001 -- the run's own outcome stands
                log.warning(f"{tracker.name} failed to close ({type(e).__name__}: {e})")
        self.open = []


def _everything_logged(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The mark of a tracker that has had every record of `history`."""
    if not history:
        return {}
    last = max(r["step"] for r in history)
    return {"last_step": last, "last_keys": sorted({k for r in history if r["step"] == last for k in numbers(r)})}


def _show_identity(identity: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in identity.items() if v is not None)

