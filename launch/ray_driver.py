"""The driver of a Ray job on Slurm: checks the job against the allocation, waits until every node
has joined, then runs `hpcrlhf <args>` on that cluster.

    python launch/ray_driver.py train ppo --config recipe.yaml -o /shared/runs/x

Same as `python -m hpcrlhf.hpc.ray_slurm driver <args>`."""

import sys

from hpcrlhf.hpc.ray_slurm import main

if __name__ == "__main__":
    sys.exit(main(["driver", *sys.argv[1:]]))
