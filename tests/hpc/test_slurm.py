"""Jobs on the real local Slurm cluster (tests/slurm_cluster.py): the cluster itself, and hpcrlhf's
MPI launcher across its two nodes."""

from __future__ import annotations

import sys

import pytest

from hpcrlhf.metrics import read_metrics
from tests.launch_helpers import ROOT
from tests.slurm_cluster import node_address

SFT = ["--set", "train.max_steps=60", "--set", "train.global_batch_size=32", "--set", "train.micro_batch_size=16",
       "--set", "log.every_steps=10", "--set", "eval.every_steps=0", "--set", "eval.score_prompts=32",
       "--set", "task.eval_size=64", "--set", "task.train_size=4000", "--set", "log.tensorboard=false",
       "--set", "log.progress=false"]


def test_two_nodes_with_their_own_names_addresses_and_gpus(slurm_cluster, tmp_path):
    script = tmp_path / "where.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH -N2 --gpus-per-node=2 -o {tmp_path}/where.out\n"
                      "srun -l bash -c 'echo $(hostname) $(hostname -i) $CUDA_VISIBLE_DEVICES $SLURM_NODEID'\n")
    job = slurm_cluster.sbatch(script)
    assert slurm_cluster.wait(job, 120) == "COMPLETED"
    lines = sorted((tmp_path / "where.out").read_text().split("\n"))[-2:]
    assert lines == [f"0: n1 {node_address(1)} 0,1 0", f"1: n2 {node_address(2)} 0,1 1"]


@pytest.mark.distributed
def test_mpi_sft_across_two_nodes_learns(slurm_cluster, tmp_path):
    """`srun --mpi=pmix python -m hpcrlhf.hpc.mpi train sft`: one rank per node, rendezvous found by
    MPI, training over gloo between the nodes."""
    out = tmp_path / "sft"
    script = tmp_path / "sft.sh"
    script.write_text("\n".join([
        "#!/bin/bash", f"#SBATCH -N2 --ntasks-per-node=1 -o {tmp_path}/sft.log", "set -euo pipefail",
        "export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false", f"cd {ROOT}",
        f"srun --mpi=pmix {sys.executable} -m hpcrlhf.hpc.mpi train sft -o {out} {' '.join(SFT)}", ""]))
    job = slurm_cluster.sbatch(script)
    state = slurm_cluster.wait(job, 600)
    log = (tmp_path / "sft.log").read_text()
    assert state == "COMPLETED", log[-4000:]
    assert "2 rank(s) x 16 rows" in log
    losses = [m["train/loss"] for m in read_metrics(out) if "train/loss" in m]
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0], losses
