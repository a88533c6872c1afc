"""Experiment trackers (issue 41 part 3, hpcrlhf.run.trackers): the real wandb (offline) and mlflow-skinny
(file store) hold what metrics.jsonl holds, one tracked run per run across a stop and resume or a crash and
rerun, and no step twice; a tracker added on a rerun gets the run's history; a missing package, an unknown
tracker, an old setting and an online W&B run that cannot work here are clear errors before anything runs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from hpcrlhf.errors import ConfigError
from hpcrlhf.run.metrics import read_metrics
from hpcrlhf.run.trackers import (advance, mlflow_key, numbers, require_installed, settings_as_params, unsent,
                                  wandb_mode)
from tests.launch_helpers import ROOT, cli_env, run_cli
from tests.run.wandb_records import history

SFT = ["--set", "train.max_steps=12", "--set", "log.every_steps=2", "--set", "checkpoint.every_steps=4",
       "--set", "eval.every_steps=4", "--set", "eval.score_prompts=8", "--set", "task.eval_size=16",
       "--set", "log.wandb.mode=offline", "--set", "log.progress=false", "--set", "checkpoint.save_model=false"]
ALL = ["--set", "log.backends=[tensorboard,wandb,mlflow]"]
VARYING = ("timing/", "throughput/")
"""Keys whose values differ when a step is redone (wall time); the rest are deterministic."""


# --- the rules (pure) -----------------------------------------------------------------------------

def test_a_record_goes_to_a_tracker_once_by_step_and_key():
    mark: dict = {}
    assert unsent(mark, 0, ["eval/loss"]) == ["eval/loss"]
    mark = advance(mark, 2, ["train/loss", "train/lr"])
    assert mark == {"last_step": 2, "last_keys": ["train/loss", "train/lr"]}
    assert unsent(mark, 1, ["train/loss"]) == []  # before the mark: sent by an earlier attempt
    assert unsent(mark, 2, ["train/loss", "eval/loss"]) == ["eval/loss"]  # the evaluation of the same step
    mark = advance(mark, 2, ["eval/loss"])
    assert mark["last_keys"] == ["eval/loss", "train/loss", "train/lr"] and unsent(mark, 2, ["eval/loss"]) == []
    assert unsent(mark, 3, ["train/loss"]) == ["train/loss"]


def test_values_keys_and_params_as_the_trackers_take_them():
    values = numbers({"step": 4, "train/loss": 0.5, "n": 3, "flag": True, "note": "x", "bad": "nan", "list": [1]})
    assert set(values) == {"train/loss", "n", "bad"} and values["n"] == 3.0 and values["bad"] != values["bad"]
    assert mlflow_key("eval/task_score/pass@4") == "eval/task_score/pass_at_4"
    assert mlflow_key("eval/usermetrics:exact/maj@8") == "eval/usermetrics:exact/maj_at_8"
    assert mlflow_key("train/loss (ema)") == "train/loss _ema_"
    assert settings_as_params({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": "1", "a.c": "[1, 2]", "d": "None"}


def test_a_missing_package_is_a_config_error_naming_the_fix():
    require_installed(("tensorboard", "wandb", "mlflow"))  # this checkout's dev install has them all
    with pytest.raises(ConfigError, match=r"log.backends: 'mlflow' needs the mlflow package, which .* cannot import: "
                                          r"pip install 'hpcrlhf\[track\]'"):
        require_installed(("tensorboard", "mlflow"), find_spec=lambda name: None if name == "mlflow" else object())


def test_wandb_mode_auto_online_and_offline():
    none: dict[str, str] = {"NETRC": "/nonexistent"}
    assert wandb_mode("offline", none)[0] == "offline"
    assert wandb_mode("auto", {**none, "WANDB_MODE": "offline", "WANDB_API_KEY": "k"})[0] == "offline"
    mode, why = wandb_mode("auto", none)
    assert mode == "offline" and "no W&B credentials" in why
    with pytest.raises(ConfigError, match="log.wandb.mode: 'online' .* no W&B credentials .* log.wandb.mode=offline"):
        wandb_mode("online", none)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens there once closed
    refused = {**none, "WANDB_API_KEY": "k", "WANDB_BASE_URL": f"http://127.0.0.1:{port}"}
    with pytest.raises(ConfigError, match=f"http://127.0.0.1:{port} cannot be reached"):
        wandb_mode("online", refused)
    assert wandb_mode("auto", refused)[0] == "offline"
    with socket.socket() as server:  # a server that answers: online
        server.bind(("127.0.0.1", 0))
        server.listen()
        there = {**refused, "WANDB_BASE_URL": f"http://127.0.0.1:{server.getsockname()[1]}"}
        assert wandb_mode("auto", there)[0] == "online"


def test_unknown_trackers_and_the_old_setting_are_refused_before_anything_runs(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(["train", "sft", "-o", str(out), "--set", "log.backends=[tensorboard,neptune]"], check=False)
    assert proc.returncode == 2 and "log.backends: ['tensorboard', 'neptune'] is invalid: name only tensorboard, " \
                                   "wandb, mlflow (unknown: 'neptune')" in proc.stderr, proc.stderr[-2000:]
    proc = run_cli(["train", "sft", "-o", str(out), "--set", "log.tensorboard=false"], check=False)
    assert proc.returncode == 2 and "'tensorboard' in section 'log' is no longer a setting: log.backends lists the " \
                                   "trackers: log.backends=[] for none" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()


# --- real runs -------------------------------------------------------------------------------------

def mlflow_history(out, ledger: dict) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(ledger["mlflow"]["tracking_uri"])
    run = client.get_run(ledger["mlflow"]["run_id"])
    return {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics}


def wandb_rows(out, run_id: str) -> list[list[dict]]:
    """The history rows of each offline fragment of W&B run `run_id`, oldest first."""
    fragments = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))
    return [history(f / f"run-{run_id}.wandb")[1] for f in fragments]


def expected_by_step(out) -> dict[int, dict[str, float]]:
    """metrics.jsonl's numbers, the records of a step merged (a train window and an evaluation share one)."""
    rows: dict[int, dict[str, float]] = {}
    for record in read_metrics(out):
        rows.setdefault(record["step"], {}).update({k: v for k, v in record.items() if k != "step"
                                                    and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return rows


def same(a: dict[str, float], b: dict[str, float], skip=()) -> bool:
    keys = {k for k in a if not k.startswith(skip)}
    return keys == {k for k in b if not k.startswith(skip)} and all(a[k] == pytest.approx(b[k], rel=1e-6) for k in keys)


@pytest.fixture(scope="module")
def tracked(sft_model, tmp_path_factory):
    """An SFT run with all three trackers, stopped as step 6 ends (exit 3; the run signals itself there: an
    outside signal on a loaded host can land steps later, at the end), then resumed to its end."""
    out = tmp_path_factory.mktemp("tracked") / "run"
    args = ["train", "sft", "-o", str(out), "--set", f"model.path={sft_model}", *SFT, *ALL]
    stopped = subprocess.run([sys.executable, "-m", "tests.trainers.faults", "stop-at", "6", "--", *args], cwd=ROOT,
                             env=cli_env(), capture_output=True, text=True, timeout=600)
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    stopped_at = int((out / "checkpoints" / "latest").read_text().strip().split("_")[1])
    ledger_then = json.loads((out / "trackers.json").read_text())
    resumed = run_cli(args)
    return out, stopped_at, ledger_then, resumed


def test_mlflow_holds_metrics_jsonl_in_one_run_with_no_step_twice(tracked):
    out, stopped_at, ledger_then, _ = tracked
    ledger = json.loads((out / "trackers.json").read_text())
    assert ledger["mlflow"]["run_id"] == ledger_then["mlflow"]["run_id"] and stopped_at == 6
    logged = mlflow_history(out, ledger)
    records = read_metrics(out)
    assert records[-1]["step"] == 12 and any(r["step"] <= stopped_at for r in records)
    for key in {k for r in records for k in numbers(r)}:
        want = [(r["step"], r[key]) for r in records if key in r]
        assert logged[mlflow_key(key)] == [(s, pytest.approx(v, rel=1e-6)) for s, v in want], key
    from mlflow.tracking import MlflowClient

    run = MlflowClient(ledger["mlflow"]["tracking_uri"]).get_run(ledger["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["train.max_steps"] == "12"
    assert run.data.tags["hpcrlhf.version.hpcrlhf"] and run.info.run_name == "run"


def test_wandb_offline_fragments_hold_one_run_id_and_every_metric_once(tracked):
    """Two fragments of one W&B run; each (step, metric) once across them. A step may open the second fragment
    with the keys the first did not have: a stop during the evaluation after step 8 (its train window sent)
    makes the resumed attempt evaluate at step 8 again, and only the evaluation's keys are sent then."""
    out, stopped_at, ledger_then, resumed = tracked
    run_id = ledger_then["wandb"]["id"]
    assert json.loads((out / "trackers.json").read_text())["wandb"]["id"] == run_id
    fragments = wandb_rows(out, run_id)
    assert len(fragments) == 2, list((out / "wandb").iterdir())
    for fragment in fragments:
        steps = [row["_step"] for row in fragment]
        assert steps == sorted(set(steps)), steps
    first, second = fragments
    assert first[-1]["_step"] <= stopped_at and first[-1]["_step"] <= second[0]["_step"]
    if first[-1]["_step"] == second[0]["_step"]:
        assert not (set(first[-1]) & set(second[0])) - {"_step"}, (first[-1], second[0])
    merged: dict[int, dict[str, float]] = {}
    for row in first + second:
        merged.setdefault(row["_step"], {}).update({k: v for k, v in row.items() if k != "_step"})
    want = expected_by_step(out)
    assert sorted(merged) == sorted(want)
    for step, values in merged.items():
        assert same(values, want[step]), step
    line = f"wandb sync --id {run_id} -p hpcrlhf {out / 'wandb'}/offline-run-*-{run_id}"
    assert line in resumed.stderr, resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert line in summary["trackers"]["wandb"]["note"] and summary["trackers"]["mlflow"]["run_id"]


def test_tensorboard_holds_each_step_once(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tracked[0]
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    records = read_metrics(out)
    for key in ("train/loss", "eval/task_score"):
        want = [(r["step"], r[key]) for r in records if key in r]
        assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars(key)] == want, key


def test_a_crash_after_the_checkpoint_sends_no_step_twice_and_a_new_tracker_gets_the_history(sft_model, tmp_path):
    """kill -9 once step 10 is logged (checkpoint at 8; step 11 hangs): the rerun redoes 9-10 without sending
    them to MLflow again; W&B, added on the rerun, gets the history first (from metrics.jsonl)."""
    out = tmp_path / "run"
    args = ["train", "sft", "-o", str(out), "--set", f"model.path={sft_model}", *SFT, "--set", "watchdog.enabled=false"]
    proc = subprocess.Popen([sys.executable, "-m", "tests.trainers.faults", "hang", "train_step", "11", "--", *args,
                             "--set", "log.backends=[mlflow]"], cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not any(r["step"] == 10 for r in read_metrics(out) if "train/loss" in r) and time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before step 10"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = {r["step"]: r for r in read_metrics(out)}
    ledger = json.loads((out / "trackers.json").read_text())
    assert ledger["mlflow"]["last_step"] == 10 and (out / "checkpoints" / "latest").read_text().strip() == "step_000008"

    rerun = run_cli(args + ["--set", "log.backends=[mlflow,wandb]"])
    assert "resumed from" in rerun.stderr and "log.backends: ['mlflow'] -> ['mlflow', 'wandb']" in rerun.stderr
    ledger = json.loads((out / "trackers.json").read_text())
    logged = mlflow_history(out, ledger)
    steps = [s for s, _ in logged["train/loss"]]
    assert steps == [2, 4, 6, 8, 10, 12]
    assert dict(logged["train/loss"])[10] == pytest.approx(first[10]["train/loss"], rel=1e-6)  # the first attempt's
    assert [s for s, _ in logged["timing/step"]] == steps
    assert dict(logged["timing/step"])[10] == pytest.approx(first[10]["timing/step"])  # not the redone step's time
    fragments = wandb_rows(out, ledger["wandb"]["id"])
    assert len(fragments) == 1
    want = expected_by_step(out)
    assert [row["_step"] for row in fragments[0]] == sorted(want)
    for row in fragments[0]:  # steps 9-10 were sent from the first attempt's records: equal but for wall times
        assert same({k: v for k, v in row.items() if k != "_step"}, want[row["_step"]], skip=VARYING), row["_step"]
