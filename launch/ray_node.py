"""One Ray node of a Slurm job (head on the allocation's first host, a worker elsewhere).

    srun --ntasks-per-node=1 python launch/ray_node.py

Same as `python -m hpcrlhf.hpc.ray_slurm node` (what rendered scripts call: it also works inside
containers, where this folder is absent)."""

import sys

from hpcrlhf.hpc.ray_slurm import main

if __name__ == "__main__":
    sys.exit(main(["node"]))
