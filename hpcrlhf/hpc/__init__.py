"""Running on HPC clusters: MPI rank discovery, Slurm (sbatch scripts, submitit), Ray on Slurm."""
