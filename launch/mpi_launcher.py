"""torch.distributed ranks started by MPI instead of torchrun (SFT, RM, DPO, KTO, CSFT, ...).

    mpirun -n 8 python launch/mpi_launcher.py train sft --config recipe.yaml
    srun --mpi=pmix python launch/mpi_launcher.py train dpo --config recipe.yaml

Same as `python -m hpcrlhf.hpc.mpi <args>`."""

import sys

from hpcrlhf.hpc.mpi import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
