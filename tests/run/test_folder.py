"""A run folder belongs to one job, never strands a run, and a rerun resumes what the folder holds.

Real `hpcrlhf train sft` processes on the tiny model (a few steps each): two jobs on one folder,
a SIGKILLed owner, an owner on another node (its record written as that node would), a torn
metrics line, a full disk (a real tmpfs), deleted checkpoints, and reruns with changed settings.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterator

import pytest

from hpcrlhf.run.metrics import read_metrics
from hpcrlhf.run.folder import config_changes, is_safe_change
from hpcrlhf.run.lock import LOCK_NAME, STALE_S, Owner, read_owner, takeover_reason
from tests.launch_helpers import ROOT, cli_command, cli_env, run_cli

QUICK = ["--set", "eval.every_steps=0", "--set", "log.backends=[]", "--set", "eval.score_prompts=8",
         "--set", "checkpoint.every_steps=2"]


def sft(out: Path, *extra: str, steps: int = 6, check: bool = True, env: dict[str, str] | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess:
    return run_cli(["train", "sft", "-o", str(out), *QUICK, "--set", f"train.max_steps={steps}", *extra], check=check,
                   env=env, timeout=timeout)


def steps_logged(out: Path) -> list[int]:
    return [m["step"] for m in read_metrics(out) if "train/loss" in m]


# --- the ownership policy and the config comparison (pure) ----------------------------------


def test_takeover_policy():
    me = Owner("n1", 100, "77", 0.0, 1000.0)
    assert "ended" in takeover_reason(Owner("n1", 99, None, 0.0, 999.0), me, 1000.0)
    assert "earlier attempt" in takeover_reason(Owner("n2", 5, "77", 0.0, 999.0), me, 1000.0)
    assert takeover_reason(Owner("n2", 5, "76", 0.0, 1000.0 - STALE_S + 1), me, 1000.0) is None
    assert "heartbeat" in takeover_reason(Owner("n2", 5, None, 0.0, 1000.0 - STALE_S - 1), me, 1000.0)


def test_config_changes_and_which_are_safe():
    before = {"optim": {"lr": 1e-4}, "train": {"max_steps": 6}, "log": {"every_steps": 10}, "output_dir": "a"}
    after = {"optim": {"lr": 2e-4}, "train": {"max_steps": 8}, "log": {"every_steps": 5}, "output_dir": "/x/a"}
    changes = config_changes(before, after)
    assert changes == {"optim.lr": (1e-4, 2e-4), "train.max_steps": (6, 8), "log.every_steps": (10, 5)}
    assert [k for k in changes if not is_safe_change(k)] == ["optim.lr"]
    assert not is_safe_change("logits.x") and is_safe_change("log.progress")


def test_a_setting_added_after_the_run_started_is_no_change_at_its_default():
    """A folder written by an older hpcrlhf lacks the newer settings: at their defaults they are what
    the run used all along; set to something else (or a setting the folder has, changed) they count."""
    before = {"optim": {"lr": 1e-4}}
    defaults = {"optim": {"lr": 3e-5, "warmup": 0}, "placement": {"local_network": "auto"}}
    same = {"optim": {"lr": 1e-4, "warmup": 0}, "placement": {"local_network": "auto"}}
    assert config_changes(before, same, defaults) == {}
    assert config_changes(before, same) == {"optim.warmup": (None, 0), "placement.local_network": (None, "auto")}
    other = {"optim": {"lr": 3e-5, "warmup": 5}, "placement": {"local_network": "auto"}}
    assert config_changes(before, other, defaults) == {"optim.lr": (1e-4, 3e-5), "optim.warmup": (None, 5)}


# --- one job per folder -----------------------------------------------------------------------


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_a_second_job_on_a_run_folder_is_refused_and_a_killed_owner_never_blocks(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(cli_command(["train", "sft", "-o", str(out), *QUICK, "--set", "train.max_steps=100000"]),
                             cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        wait_for(lambda: len(steps_logged(out)) >= 1, 120, "the first job's first logged steps")
        second = sft(out, check=False)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"is in use by another job (pid {first.pid} on {socket.gethostname()}" in second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None  # the refused job touched nothing of the running one
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert read_owner(out / LOCK_NAME).pid == first.pid  # a killed owner leaves its record ...
    latest = out / "checkpoints" / "latest"  # how far the killed job got depends on the machine's speed
    done = int(latest.read_text().split("_")[1]) if latest.exists() else 0
    rerun = sft(out, "--set", "checkpoint.keep_last=1", steps=done + 2)  # ... and the rerun takes over at once
    assert f"its process {first.pid} on this host ended" in rerun.stderr
    assert read_owner(out / LOCK_NAME) is None  # released at the end


def test_an_owner_on_another_node_blocks_until_its_heartbeat_is_stale(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    alive = Owner("node-b", 4242, "9001", time.time() - 60, time.time() - 20)
    (out / LOCK_NAME).write_text(json.dumps(alive.__dict__))
    refused = sft(out, check=False)
    assert refused.returncode == 2 and "may be in use by another job (pid 4242 on node-b, Slurm job 9001" in refused.stderr
    assert not (out / "config.yaml").exists()  # nothing written before the folder is ours
    dead = Owner("node-b", 4242, "9001", time.time() - 3600, time.time() - STALE_S - 60)
    (out / LOCK_NAME).write_text(json.dumps(dead.__dict__))
    taken = sft(out, steps=2)
    assert "taking the run folder over from pid 4242 on node-b" in taken.stderr and "heartbeat is" in taken.stderr
    requeued = Owner("node-c", 7, "9002", time.time(), time.time())  # an earlier attempt of the same Slurm job
    (out / LOCK_NAME).write_text(json.dumps(requeued.__dict__))
    again = sft(out, steps=4, env={"SLURM_JOB_ID": "9002"})
    assert "earlier attempt of this Slurm job (9002)" in again.stderr


# --- reruns: what the folder holds decides ---------------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 6-step run with checkpoints at steps 4 and 6."""
    out = tmp_path_factory.mktemp("finished") / "run"
    with umask(0o022):  # the usual umask (test_checkpoints_and_the_exported_model_get_the_modes_the_umask_gives)
        sft(out)
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    import shutil

    dest = tmp_path / "run"
    shutil.copytree(run, dest)
    return dest


@pytest.mark.parametrize("change, shown", [
    (["--set", "optim.lr=1e-3"], "optim.lr: 0.002 -> 0.001"),
    (["--set", "model.path=builtin:tiny-qwen2"], "model.path: 'builtin:tiny-llama' -> 'builtin:tiny-qwen2'"),
])
def test_a_rerun_that_changes_what_the_run_trains_is_refused_with_the_diff(finished, tmp_path, change, shown):
    out = copy_of(finished, tmp_path)
    saved = (out / "config.yaml").read_text()
    refused = sft(out, *change, check=False)
    assert refused.returncode == 2 and shown in refused.stderr and "Traceback" not in refused.stderr
    assert (out / "config.yaml").read_text() == saved


def test_a_refused_resume_never_rewrites_the_config(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    saved = (out / "config.yaml").read_text()
    refused = sft(out, "--set", "checkpoint.resume=never", "--set", "optim.lr=1e-3", check=False)
    assert refused.returncode == 2 and "checkpoint.resume: 'never'" in refused.stderr
    assert (out / "config.yaml").read_text() == saved


def test_more_steps_is_a_safe_change_logged_and_recorded(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    longer = sft(out, steps=8)
    assert "changed settings (allowed on a rerun): train.max_steps: 6 -> 8" in longer.stderr
    assert steps_logged(out) == [6, 8] or steps_logged(out)[-1] == 8
    attempts = [json.loads(line) for line in (out / "environment.jsonl").read_text().splitlines()]
    assert attempts[-1]["config_changes"] == {"train.max_steps": [6, 8]} and "config_changes" not in attempts[0]
    assert "max_steps: 8" in (out / "config.yaml").read_text()


def test_a_run_done_without_its_final_checkpoint_keeps_only_the_periodic_ones(tmp_path):
    """checkpoint.at_end=false (what `hpcrlhf bench` sets): a 3-step run checkpointing every 2
    steps ends with step 2's checkpoint alone; by default step 3 is saved as well."""
    names = {}
    for at_end in ("true", "false"):
        out = tmp_path / at_end
        sft(out, "--set", f"checkpoint.at_end={at_end}", steps=3)
        assert json.loads((out / "summary.json").read_text())["status"] == "done"
        names[at_end] = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert names == {"true": ["step_000002", "step_000003"], "false": ["step_000002"]}
    # A rerun of the finished run is done at once: it retrained step 3 from step 2's checkpoint on every rerun.
    metrics = (tmp_path / "false" / "metrics.jsonl").read_text()
    rerun = sft(tmp_path / "false", "--set", "checkpoint.at_end=false", steps=3)
    assert f"{tmp_path / 'false'} is already complete (3 steps)" in rerun.stderr and "resumed from" not in rerun.stderr
    assert (tmp_path / "false" / "metrics.jsonl").read_text() == metrics


def test_fewer_steps_than_the_folder_holds_is_refused_naming_both(finished, tmp_path):
    """train.max_steps lowered below the run's latest checkpoint (step 6) said "done" without a word, and
    exported the step-6 model as the run's result. (A finished run says "finished at step 6" the same way.)"""
    out = copy_of(finished, tmp_path)
    (out / "summary.json").unlink()  # stopped (a time limit) after its step-6 checkpoint, before its end
    model = (out / "model" / "model.safetensors").stat().st_mtime_ns
    refused = sft(out, steps=4, check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert (f"train.max_steps=4, but the run in {out} has a checkpoint at step 6: nothing to train; raise "
            "train.max_steps above 6 to train on, or use a new --output-dir for a run of 4 steps") in refused.stderr
    assert (out / "model" / "model.safetensors").stat().st_mtime_ns == model and not (out / "summary.json").exists()


def test_deleted_checkpoints_start_a_clean_history_and_keep_the_old_one(finished, tmp_path):
    import shutil

    out = copy_of(finished, tmp_path)
    before = steps_logged(out)
    shutil.rmtree(out / "checkpoints")
    (out / "summary.json").unlink()  # a run that never finished (a finished one is done: no retraining)
    rerun = sft(out)
    assert "no checkpoint to resume from: training starts again from step 0" in rerun.stderr
    assert steps_logged(out) == before  # each step once, not twice
    kept = list(out.glob("metrics.before-*.jsonl"))
    assert len(kept) == 1 and [json.loads(x)["step"] for x in kept[0].read_text().splitlines() if "train/loss" in x] == before


def test_a_torn_metrics_line_does_not_block_the_resume(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "train/lo')  # what a crash mid-write leaves
    longer = sft(out, steps=8)
    assert "the last line is incomplete" in longer.stderr
    assert steps_logged(out)[-1] == 8


def a_file(path: Path) -> Path:
    path.write_text("not a folder")
    return path


def a_lock_record(out: Path, **record) -> Path:
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps(record))
    return out


@pytest.mark.parametrize("make, message", [
    (lambda t: a_file(t / "run"), "{out} is a file, not a folder"),
    (lambda t: a_file(t / "afile") / "sub", "--output-dir {out}: cannot create it ({t}/afile is a file, not a folder)"),
    (lambda t: a_lock_record(t / "run", host="node-b", pid="4242", slurm_job_id=None, started=0.0, heartbeat=0.0),
     "{out}/run.lock does not hold a record of hpcrlhf (pid: '4242' is not a whole number)"),
    (lambda t: a_lock_record(t / "run", host="node-b", pid=4242), "{out}/run.lock does not hold a record of hpcrlhf ("),
], ids=["a file", "below a file", "a lock record with a wrong type", "a lock record with fields missing"])
def test_an_output_dir_that_cannot_be_a_run_folder_is_refused(tmp_path, make, message):
    out = make(tmp_path)
    refused = sft(out, check=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert message.format(out=out, t=tmp_path) in refused.stderr and "Traceback" not in refused.stderr


# --- nothing is written through what someone planted in the run folder --------------------------------

PLANTED = {  # entry of the run folder -> what is planted there
    "links to the user's files and folders": {"run.lock": "link", "metrics.jsonl": "link", "config.yaml": "link",
                                              "third_party.log": "link",
                                              "summary.json": "link", "checkpoints/latest": "link",
                                              "model": "folder link"},
    "a linked checkpoints folder, a FIFO, a folder for a file": {"checkpoints": "folder link", "metrics.jsonl": "FIFO",
                                                                 "run.lock": "folder"},
}


def plant(out: Path, victims: Path, entry: str, what: str) -> str:
    """Put `what` at `out/entry` (a link aims at a file or folder of the user's, under `victims`);
    returns what the refusal must say about it."""
    path, victim = out / entry, victims / entry.replace("/", "_")
    path.parent.mkdir(parents=True, exist_ok=True)
    if what == "link":
        victim.write_text(f"the user's own {entry}, which must survive\n")
    elif what == "folder link":
        victim.mkdir()
        (victim / "keep.txt").write_text("the user's own file, which must survive\n")
    if what.endswith("link"):
        path.symlink_to(victim)
        return f"{path} is a symbolic link (to {victim}); hpcrlhf never writes through links: remove it"
    if what == "FIFO":
        os.mkfifo(path)
        return f"{path} is a FIFO, not a file"
    path.mkdir()
    return f"{path} is a folder, not a file"


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_nothing_is_written_through_links_or_special_files_planted_in_the_run_folder(tmp_path, planted):
    """Someone who can write into a shared run folder aims its entries at the user's files (~/.bashrc):
    the run is refused, naming every one, and what they aim at is untouched."""
    out, victims = tmp_path / "run", tmp_path / "victims"
    out.mkdir()
    victims.mkdir()
    said = [plant(out, victims, entry, what) for entry, what in PLANTED[planted].items()]
    before = snapshot(victims)
    refused = sft(out, steps=1, check=False, timeout=240)  # a FIFO read would block: the timeout fails it
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert all(s in refused.stderr for s in said), refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    assert snapshot(victims) == before


# --- real filesystems: read-only, full ---------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path):
    """A real tmpfs of 24 MiB (root only: mounting needs CAP_SYS_ADMIN); unmounted after."""
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"cannot mount a tmpfs under CI: {done.stderr}")
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def remount(mount: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(mount)], check=True)


def test_a_full_disk_ends_the_run_clearly_and_the_rerun_resumes(tmpfs):
    """Checkpoints of ~5 MiB: the 24 MiB filesystem is filled so that the second does not fit."""
    out = tmpfs / "run"
    sft(out, "--set", "checkpoint.keep_last=5", steps=2)  # step 2's checkpoint, and the exported model
    (tmpfs / "filler").write_bytes(b"\0" * (os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize - (3 << 20)))
    full = sft(out, "--set", "checkpoint.keep_last=5", steps=6, check=False)
    assert full.returncode == 2, full.stderr[-3000:]
    assert "no space left on the filesystem of" in full.stderr and "while writing checkpoint step_000004" in full.stderr
    assert "it resumes from step_000002" in full.stderr and "Traceback" not in full.stderr
    assert not list((out / "checkpoints").glob("*.partial"))  # the partial save gave its space back
    logged = steps_logged(out)  # every line whole
    (tmpfs / "filler").unlink()
    rerun = sft(out, "--set", "checkpoint.keep_last=5", steps=6)
    assert "resumed from" in rerun.stderr and "step_000002" in rerun.stderr
    assert steps_logged(out)[-1] == 6 and logged[0] == steps_logged(out)[0]


def test_json_lines_drop_a_torn_last_line_and_name_any_other_bad_one(tmp_path, caplog):
    from hpcrlhf.errors import DataError
    from hpcrlhf.run.metrics import read_json_lines

    path = tmp_path / "x.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "tr')
    assert read_json_lines(path, torn="redone", fix="delete it") == [{"step": 1}, {"step": 2}]
    assert f"{path}:4: the last line is incomplete (a write cut short); redone" in caplog.text
    path.write_text('{"step": 1}\n{"step": 2, "tr\n{"step": 3}\n')  # not the last line: not a crash mid-write
    with pytest.raises(DataError, match=f"{path}:2: not a JSON line .*; delete it"):
        read_json_lines(path, torn="redone", fix="delete it")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"is not a metrics record \(a JSON object with a step\); fix or delete"):
        read_metrics(tmp_path)


def test_a_metrics_write_that_runs_out_of_space_leaves_no_torn_line(tmpfs):
    from hpcrlhf.run.diskspace import DiskFull
    from hpcrlhf.run.metrics import MetricsWriter

    writer = MetricsWriter(tmpfs)
    writer.log(1, {"train/loss": 1.0})
    free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
    (tmpfs / "filler").write_bytes(b"\0" * (free - 100))
    with pytest.raises(DiskFull, match="no space left .* while writing metrics.jsonl"):
        writer.log(2, {"train/loss": 0.5, "note": "x" * 20000})
    assert [m["step"] for m in read_metrics(tmpfs)] == [1]
    assert (tmpfs / "metrics.jsonl").read_text().endswith("\n")


@pytest.mark.parametrize("exists", [True, False], ids=["existing folder", "new folder"])
def test_a_read_only_run_folder_is_refused(tmpfs, exists):
    out = tmpfs / "runs" / "run"
    if exists:
        out.mkdir(parents=True)
    remount(tmpfs, "ro")
    refused = sft(out, check=False)
    assert refused.returncode == 2 and "the filesystem is read-only" in refused.stderr, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr


def fill(mount: Path, leave: int = 0) -> None:
    """Fill the filesystem at `mount` until `leave` bytes are free (0: until a write fails)."""
    with open(mount / "filler", "wb") as f:
        try:
            while (free := os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize) > leave:
                f.write(b"\0" * min(free - leave, 1 << 20))
                f.flush()
        except OSError:
            pass


def test_a_disk_full_from_the_start_is_a_clear_error(tmpfs):
    fill(tmpfs)
    refused = sft(tmpfs / "run", check=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "no space left on the filesystem of" in refused.stderr and "while writing run.lock" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_an_export_that_runs_out_of_space_leaves_no_half_model_folder(tmpfs):
    """A 1-step run without checkpoints on a filesystem with 512 KiB left: the exported weights (1.6 MiB)
    do not fit. The error names the space free and needed; no model/ (or staging folder) stays."""
    out = tmpfs / "run"
    fill(tmpfs, leave=512 << 10)
    full = sft(out, "--set", "checkpoint.at_end=false", steps=1, check=False)
    assert full.returncode == 2, full.stderr[-3000:]
    assert "no space left on the filesystem of" in full.stderr
    assert "while writing the exported model (model/)" in full.stderr
    assert " free; it needs about 1.6 MiB" in full.stderr and "Traceback" not in full.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "environment.jsonl", "metrics.jsonl", "run.lock",
                                                     "third_party.log"]


# --- the permission policy ----------------------------------------------------------------------------


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(out: Path) -> dict[str, int]:
    """Permission bits of what a run writes: its files, the checkpoint's weights and the exported ones."""
    step = sorted((out / "checkpoints").glob("step_*"))[-1]
    paths = {"run folder file": out / "metrics.jsonl", "config": out / "config.yaml", "lock": out / LOCK_NAME,
             "checkpoint folder": step, "checkpoint weights": step / "mp_rank_00_model_states.pt",
             "export folder": out / "model", "exported weights": out / "model" / "model.safetensors"}
    return {name: stat.S_IMODE(p.stat().st_mode) for name, p in paths.items()}


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_checkpoints_and_the_exported_model_get_the_modes_the_umask_gives(finished, tmp_path, mask):
    """The policy: what a run writes gets the umask's modes, the same weights alike in a checkpoint and in
    the export (a project group reads both or neither). The 022 run is the module's finished run."""
    out = finished
    if mask != 0o022:
        out = tmp_path / "run"
        with umask(mask):
            sft(out, steps=1)
    file, folder = 0o666 & ~mask, 0o777 & ~mask
    assert modes(out) == {"run folder file": file, "config": file, "lock": file, "checkpoint folder": folder,
                          "checkpoint weights": file, "export folder": folder, "exported weights": file}
