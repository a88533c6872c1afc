"""hpcrlhf: RLHF pipelines for shared HPC clusters."""
__version__ = "0.1.0"
