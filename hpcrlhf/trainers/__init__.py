"""Trainers by job kind. Each entry takes its typed config and returns a summary dict."""


def _sft(cfg):
    from hpcrlhf.trainers.sft import run_sft

    return run_sft(cfg)


TRAINERS = {"sft": _sft}
