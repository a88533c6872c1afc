"""Jobs inside hpcrlhf's Apptainer image (apptainer/hpcrlhf-cpu.def, built by apptainer/build.sh)
on the local Slurm cluster, started by scripts `hpcrlhf sbatch --container` renders; and images that
cannot work, refused before anything is written or started. (Ray PPO inside the image:
tests/cluster/test_ppo.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrlhf.cli import main
from hpcrlhf.run.metrics import read_metrics
from tests.hpc.slurm_jobs import SFT, attempts, losses, render, run_rendered, slurm_log
from tests.images import busybox_image
from tests.launch_helpers import run_cli

MPI_SFT = ["--kind", "sft", "--launcher", "mpi", "--nodes", "2", "--gpus-per-node", "1"]


def test_a_built_image_passes_its_smoke_test(cpu_image):
    proc = run_cli(["image", "check", cpu_image], timeout=300)
    assert "a readable SIF image with hpcrlhf" in proc.stdout
    assert "selftest: torch 2.13.0" in proc.stdout and "selftest: vllm" in proc.stdout
    assert "selftest: passed (hpcrlhf console script: /opt/venv/bin/hpcrlhf" in proc.stdout


@pytest.fixture(scope="module")
def no_hpcrlhf(tmp_path_factory, cpu_image) -> Path:
    return busybox_image(tmp_path_factory.mktemp("busybox"))


@pytest.mark.parametrize("case", ["missing", "folder", "not-sif", "relative", "no-hpcrlhf"])
def test_an_image_that_cannot_work_is_refused_before_anything_is_written(case, tmp_path, request, capsys):
    no_hpcrlhf = request.getfixturevalue("no_hpcrlhf") if case == "no-hpcrlhf" else None
    junk = tmp_path / "junk.sif"
    junk.write_bytes(b"\0" * 4096)  # e.g. a copy cut short
    image, reason = {"missing": (str(tmp_path / "none.sif"), "no such file"),
                     "folder": (str(tmp_path), "it is not a file"),
                     "not-sif": (str(junk), "it is not a SIF image"),
                     "relative": ("images/hpcrlhf.sif", "it is a relative path"),
                     "no-hpcrlhf": (str(no_hpcrlhf), "cannot import hpcrlhf")}[case]
    run = tmp_path / "run"
    status = main(["sbatch", *MPI_SFT, "-o", str(run), "--container", image])
    err = capsys.readouterr().err
    assert status == 2 and not run.exists(), err
    assert f"--container: {image!r} cannot be used: " in err and reason in err
    assert "apptainer/build.sh" in err or case in ("folder", "relative")


def test_a_job_whose_image_is_gone_from_the_node_fails_before_any_step(slurm_cluster, cpu_image, tmp_path):
    link = tmp_path / "hpcrlhf.sif"
    link.symlink_to(cpu_image)
    run = tmp_path / "run"
    script = render(run, *MPI_SFT, "--container", str(link), *SFT)
    link.unlink()  # e.g. cleaned from shared storage while the job waited in the queue
    job = slurm_cluster.sbatch(script)
    state = slurm_cluster.wait(job, 180)
    log = slurm_log(run, job)
    assert state == "FAILED", log
    assert f"hpcrlhf: container image {link} is missing or unreadable on n1" in log
    assert "fits the allocation" not in log and not (run / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def sft_in_image(slurm_cluster, in_image, tmp_path_factory):
    return run_rendered(slurm_cluster, tmp_path_factory.mktemp("sft-in-image") / "run", *MPI_SFT, *in_image, *SFT)


@pytest.mark.distributed
def test_mpi_sft_inside_the_image_learns_exactly_like_the_host_run(sft_in_image, sft_straight, cpu_image):
    (run, state, job), (host, _, _) = sft_in_image, sft_straight
    log = slurm_log(run, job)
    assert state == "COMPLETED", log[-4000:]
    assert "the job fits the allocation (2 node(s) x 1 GPU(s))" in log and "2 rank(s) x 16 rows" in log
    (inside,) = attempts(run)
    assert inside["container"] == cpu_image and inside["python"] == "/opt/venv/bin/python", inside
    assert attempts(host)[0]["container"] is None
    loss = losses(run)
    assert loss[60] < 0.5 * loss[5], loss
    assert loss == pytest.approx(losses(host), rel=1e-5)  # same code, same torch: the same numbers
    final = {k: v for k, v in read_metrics(run)[-1].items() if k.startswith("eval/")}
    assert final and final == pytest.approx({k: read_metrics(host)[-1][k] for k in final}, rel=1e-5)


@pytest.fixture(scope="module")
def sft_submitted_in_image(slurm_cluster, in_image, tmp_path_factory):
    """The same SFT job through `hpcrlhf submit --container` (submitit's tasks inside the image, one
    rank each with torchrun's variables from submitit's job environment)."""
    run = tmp_path_factory.mktemp("sft-submitted-in-image") / "run"
    proc = run_cli(["submit", *MPI_SFT, *in_image, "-o", str(run), "--time", "30", "--poll-s", "2",
                    *SFT], env={"SLURM_CONF": str(slurm_cluster.conf)}, timeout=900, check=False)
    return run, proc


@pytest.mark.distributed
def test_submitted_sft_inside_the_image_learns_exactly_like_the_host_run(sft_submitted_in_image, sft_straight,
                                                                         cpu_image):
    (run, proc), (host, _, _) = sft_submitted_in_image, sft_straight
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job = int(proc.stdout.split("submitted job ")[1].split()[0])
    assert f"job {job}: COMPLETED" in proc.stdout
    (inside,) = attempts(run)
    assert inside["container"] == cpu_image and inside["world_size"] == 2, inside
    assert losses(run) == pytest.approx(losses(host), rel=1e-5)
    final = {k: v for k, v in read_metrics(run)[-1].items() if k.startswith("eval/")}
    assert final and final == pytest.approx({k: read_metrics(host)[-1][k] for k in final}, rel=1e-5)


def test_an_image_the_user_cannot_read_is_refused(tmp_path, monkeypatch, capsys):
    """(Root reads every file, so the permission is denied through os.access.)"""
    image = tmp_path / "hpcrlhf.sif"
    image.write_bytes(b"\0" * 32 + b"SIF_MAGIC" + b"\0" * 64)
    monkeypatch.setattr("hpcrlhf.hpc.image.os.access", lambda path, mode: False)
    assert main(["sbatch", *MPI_SFT, "-o", str(tmp_path / "run"), "--container", str(image)]) == 2
    err = capsys.readouterr().err
    assert f"--container: {str(image)!r} cannot be used: it is not readable by you: `chmod a+r` it" in err
    assert not (tmp_path / "run").exists()
