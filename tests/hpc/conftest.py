from __future__ import annotations

import pytest

from tests.hpc.slurm_jobs import SFT, run_rendered


@pytest.fixture(scope="session")
def sft_straight(slurm_cluster, tmp_path_factory):
    """The rendered 2-node MPI SFT script run straight through on the host's Python (the reference of
    the requeued run in test_slurm.py and of the same job inside the image in test_container.py)."""
    return run_rendered(slurm_cluster, tmp_path_factory.mktemp("sft-straight") / "run", "--kind", "sft",
                        "--launcher", "mpi", "--nodes", "2", "--gpus-per-node", "1", *SFT)
