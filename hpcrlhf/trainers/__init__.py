"""Trainers by job kind. Each entry takes its typed config and returns a summary dict.

A job's trainer module is imported when the job runs: each pulls in torch, transformers and
DeepSpeed, which no other job (and no other command) needs."""

from importlib import import_module

from hpcrlhf.config.schema import TrainJobConfig
from hpcrlhf.models.context import require_generation_fits
from hpcrlhf.run.lock import release_all

_RUNNERS = {"sft": ("sft", "run_sft"), "rm": ("rm", "run_rm"), "dpo": ("dpo", "run_dpo"),
            "kto": ("kto", "run_kto"), "csft": ("csft", "run_csft"),
            "ppo": ("ppo", "run_ppo"), "rs": ("rs", "run_rs")}


def _runner(kind: str):
    module, name = _RUNNERS[kind]

    def run(cfg: TrainJobConfig) -> dict:
        require_generation_fits(cfg, kind)  # before anything is loaded, started or written
        try:
            return getattr(import_module(f"hpcrlhf.trainers.{module}"), name)(cfg)
        finally:
            release_all()  # the run folder is free again, whatever ended the job

    return run


TRAINERS = {kind: _runner(kind) for kind in _RUNNERS}
