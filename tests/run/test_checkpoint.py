"""Checkpoint folders: atomic commit (write aside, rename), manifests verified on resume, fallback
to the previous intact checkpoint with a warning, interrupted saves never loaded, retention."""

from __future__ import annotations

import json
import logging

import pytest

from hpcrlhf.run.checkpoint import MANIFEST, CheckpointDir, verify_checkpoint


def save(ckpts: CheckpointDir, step: int, payload: bytes = b"weights") -> None:
    """What Run.save_checkpoint does: ranks write into the staging folder, the main rank commits."""
    staging = ckpts.staging_for(step)
    (staging / "global").mkdir(parents=True)
    (staging / "global" / "mp_rank_00_model_states.pt").write_bytes(payload * step)
    (staging / "rng_rank0.pt").write_bytes(b"rng")
    ckpts.commit(staging, step)


def test_commit_writes_a_manifest_renames_and_keeps_the_last_ones(tmp_path):
    ckpts = CheckpointDir(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        save(ckpts, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000020", "step_000030"]
    assert ckpts.latest() == ckpts.latest_intact() == tmp_path / "step_000030"
    manifest = json.loads((tmp_path / "step_000030" / MANIFEST).read_text())
    assert manifest["files"] == {"global/mp_rank_00_model_states.pt": {"bytes": 7 * 30}, "rng_rank0.pt": {"bytes": 3}}


def test_damaged_latest_falls_back_to_the_previous_with_a_warning(tmp_path, caplog):
    ckpts = CheckpointDir(tmp_path, keep_last=3)
    for step in (10, 20, 30):
        save(ckpts, step)
    shard = tmp_path / "step_000030" / "global" / "mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:50])  # truncated (e.g. the node died while copying)
    (tmp_path / "step_000020" / "rng_rank0.pt").unlink()  # and the one before lost a file
    with caplog.at_level(logging.WARNING, logger="hpcrlhf"):
        assert ckpts.latest_intact() == tmp_path / "step_000010"
    text = caplog.text
    assert "step_000030 is damaged (global/mp_rank_00_model_states.pt has 50 bytes, the manifest says 210)" in text
    assert "step_000020 is damaged (rng_rank0.pt is missing)" in text
    assert "resuming from the previous intact checkpoint" in text and "step_000010" in text


def test_sha256_catches_a_same_size_change_that_sizes_cannot(tmp_path):
    for sha, caught in ((False, False), (True, True)):
        ckpts = CheckpointDir(tmp_path / str(sha), sha256=sha)
        save(ckpts, 10)
        shard = ckpts.path_for(10) / "global" / "mp_rank_00_model_states.pt"
        data = bytearray(shard.read_bytes())
        data[3] ^= 0x01  # one flipped bit
        shard.write_bytes(bytes(data))
        problems = verify_checkpoint(ckpts.path_for(10))
        assert bool(problems) == caught, problems
        if caught:
            assert problems == ["global/mp_rank_00_model_states.pt does not match its SHA-256"]


def test_an_interrupted_save_is_never_loaded_and_is_cleaned_up(tmp_path):
    ckpts = CheckpointDir(tmp_path, keep_last=2)
    save(ckpts, 10)
    staging = ckpts.staging_for(20)  # ranks were writing step 20 when the job died
    staging.mkdir()
    (staging / "rng_rank0.pt").write_bytes(b"half")
    assert ckpts.latest_intact() == tmp_path / "step_000010"
    save(ckpts, 30)  # the resumed run's next save removes the leftover
    assert not staging.exists()


def test_no_latest_marker_still_finds_the_checkpoints(tmp_path, caplog):
    ckpts = CheckpointDir(tmp_path)
    save(ckpts, 10)
    save(ckpts, 20)
    (tmp_path / "latest").unlink()
    with caplog.at_level(logging.WARNING, logger="hpcrlhf"):
        assert ckpts.latest_intact() == tmp_path / "step_000020"
    assert "latest is missing" in caplog.text
    assert CheckpointDir(tmp_path / "none").latest_intact() is None


def test_unreadable_manifest_is_damage(tmp_path):
    ckpts = CheckpointDir(tmp_path)
    save(ckpts, 10)
    (ckpts.path_for(10) / MANIFEST).write_text("{not json")
    assert verify_checkpoint(ckpts.path_for(10))[0].startswith("manifest.json is unreadable")


@pytest.mark.parametrize("field, value", [("keep_last", 0), ("every_steps", -1)])
def test_bad_checkpoint_settings_are_refused(field, value):
    from hpcrlhf.config.schema import CheckpointConfig
    from hpcrlhf.errors import ConfigError

    with pytest.raises(ConfigError, match=f"checkpoint.{field}: {value} is invalid"):
        CheckpointConfig(**{field: value})


def save_torch(ckpts: CheckpointDir, step: int) -> None:
    """A checkpoint of real torch.save archives, as DeepSpeed and the RNG save write them."""
    import torch

    staging = ckpts.staging_for(step)
    staging.mkdir(parents=True)
    torch.save({"step": step, "weights": torch.arange(4096.0)}, staging / "mp_rank_00_model_states.pt")
    torch.save({"torch": torch.get_rng_state()}, staging / "rng_rank0.pt")
    ckpts.commit(staging, step)


@pytest.mark.parametrize("damage, problem", [
    (lambda f: f.write_bytes(f.read_bytes()[:5000]), "mp_rank_00_model_states.pt is cut short or damaged: 5,000 bytes "
                                                     "without the archive's closing directory"),
    (lambda f: f.write_bytes(b""), "mp_rank_00_model_states.pt is empty"),
    (lambda f: f.write_bytes(f.read_bytes()[:-200] + bytes(200)), "mp_rank_00_model_states.pt is cut short or damaged"),
])
def test_a_checkpoint_without_manifest_is_checked_by_its_files(tmp_path, caplog, damage, problem):
    """Saved before manifests existed (or its manifest lost): a shard cut short, emptied or with a zeroed
    tail (a node that died while writing) is found from the archive itself, and resume falls back."""
    ckpts = CheckpointDir(tmp_path, keep_last=3)
    for step in (10, 20):
        save_torch(ckpts, step)
        (ckpts.path_for(step) / MANIFEST).unlink()
    assert verify_checkpoint(ckpts.path_for(20)) == []
    damage(ckpts.path_for(20) / "mp_rank_00_model_states.pt")
    assert verify_checkpoint(ckpts.path_for(20))[0].startswith(problem)
    with caplog.at_level(logging.WARNING, logger="hpcrlhf"):
        assert ckpts.latest_intact() == ckpts.path_for(10)
    assert f"step_000020 is damaged ({problem}" in caplog.text


@pytest.mark.parametrize("marker, said", [
    (bytes(range(256)), "latest is unreadable (not text)"),
    (b"../../elsewhere\n", "latest holds '../../elsewhere', not the name of a checkpoint folder (step_NNNNNN)"),
    (b"step_000030\n", "latest names step_000030, which is missing"),
])
def test_a_latest_marker_naming_no_checkpoint_is_read_as_missing(tmp_path, caplog, marker, said):
    ckpts = CheckpointDir(tmp_path)
    save(ckpts, 10)
    save(ckpts, 20)
    (tmp_path / "latest").write_bytes(marker)
    assert ckpts.latest() is None
    with caplog.at_level(logging.WARNING, logger="hpcrlhf"):
        assert ckpts.latest_intact() == ckpts.path_for(20)
    assert said in caplog.text and "looking at the checkpoint folders themselves" in caplog.text


def test_cli_resume_past_garbage_latest_and_a_truncated_shard_without_manifest(tmp_path):
    """`checkpoints/latest` overwritten with binary garbage and the newest checkpoint's shard cut short
    with no manifest to tell: the rerun warns about both, resumes from the previous checkpoint and
    finishes (it ended in a UnicodeDecodeError, then in torch's `failed finding central directory`)."""
    from tests.launch_helpers import run_cli

    out = tmp_path / "run"
    args = ["train", "sft", "-o", str(out), "--set", "train.global_batch_size=16", "--set", "train.micro_batch_size=16",
            "--set", "checkpoint.every_steps=2", "--set", "checkpoint.keep_last=3", "--set", "eval.every_steps=0",
            "--set", "log.backends=[]"]
    run_cli([*args, "--set", "train.max_steps=4"], timeout=300)
    newest = out / "checkpoints" / "step_000004"
    (newest / MANIFEST).unlink()
    shard = newest / "mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (out / "checkpoints" / "latest").write_bytes(bytes(range(128, 256)))
    proc = run_cli([*args, "--set", "train.max_steps=6"], timeout=300, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in log, log[-3000:]
    assert "checkpoints/latest is unreadable (not text); looking at the checkpoint folders themselves" in log, log[-3000:]
    assert "step_000004 is damaged (mp_rank_00_model_states.pt is cut short or damaged" in log, log[-3000:]
    assert "resumed from" in log and "step_000002 at step 2" in log, log[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000006"


def test_a_checkpoint_marked_damaged_is_skipped_until_its_step_is_saved_again(tmp_path, caplog):
    ckpts = CheckpointDir(tmp_path, keep_last=3)
    for step in (10, 20):
        save(ckpts, step)
    ckpts.mark_damaged(ckpts.path_for(20), "step 21: non-finite gradients")
    assert verify_checkpoint(ckpts.path_for(20)) == ["marked damaged: step 21: non-finite gradients"]
    with caplog.at_level(logging.WARNING, logger="hpcrlhf"):
        assert ckpts.latest_intact() == ckpts.path_for(10)
    assert "step_000020 is damaged (marked damaged: step 21: non-finite gradients): not loading it" in caplog.text
    save(ckpts, 20)  # the resumed run saves that step again
    assert ckpts.latest_intact() == ckpts.path_for(20)


def nan_in_place(shard, record: str = "data/0") -> None:
    """Overwrite one tensor of a torch.save file with NaN, in place: the file keeps its size and stays
    loadable (torch does not check the zip's CRCs), as after a disk or copy error."""
    import struct
    import zipfile

    with zipfile.ZipFile(shard) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(f"/{record}"))
    with open(shard, "r+b") as f:
        f.seek(info.header_offset)
        name, extra = struct.unpack("<HH", f.read(30)[26:30])
        f.seek(info.header_offset + 30 + name + extra)
        f.write(b"\x00\x00\xc0\x7f" * (info.file_size // 4))


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_a_checkpoint_whose_first_step_is_nonfinite_is_damaged_and_the_previous_one_resumes(tmp_path, policy):
    """Same-size garbage in the newest checkpoint's weights passes `checkpoint.verify: size`; every
    rerun loaded it, skipped its NaN steps and stopped with "the run is diverging; lower optim.lr"
    (a change a rerun may not make). Now its first step's NaN marks it damaged, the previous one
    resumes with a message, and the run finishes; the damaged one is never loaded again."""
    from hpcrlhf.run.metrics import read_metrics
    from tests.launch_helpers import run_cli

    out = tmp_path / "run"
    args = ["train", "sft", "-o", str(out), "--set", "train.global_batch_size=16", "--set", "train.micro_batch_size=16",
            "--set", "checkpoint.every_steps=1", "--set", "checkpoint.keep_last=3", "--set", "eval.every_steps=0",
            "--set", "log.every_steps=1", "--set", "log.backends=[]", "--set", "task.eval_size=16",
            "--set", "eval.score_prompts=8", "--set", "checkpoint.save_model=false",
            "--set", f"train.on_nonfinite={policy}"]
    run_cli([*args, "--set", "train.max_steps=2"], timeout=300)
    damaged = out / "checkpoints" / "step_000002"
    nan_in_place(damaged / "mp_rank_00_model_states.pt")
    assert not verify_checkpoint(damaged)  # sizes cannot tell
    proc = run_cli([*args, "--set", "train.max_steps=3"], timeout=300, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in log, log[-3000:]
    assert "step 3: non-finite gradients" in log, log[-3000:]
    assert (f"checkpoint {damaged} gave a non-finite first step after loading it (step 3: non-finite gradients"
            in log), log[-3000:]
    assert "step_000002 is damaged (marked damaged: " in log and "resumed from" in log, log[-3000:]
    assert "step_000001 at step 1" in log, log[-3000:]
    rows = [m for m in read_metrics(out) if "train/loss" in m]
    assert [m["step"] for m in rows] == [1, 2, 3] and all(m["train/loss"] == m["train/loss"] for m in rows)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert json.loads((out / "summary.json").read_text())["status"] == "done"
