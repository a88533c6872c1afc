"""One rank of DeepSpeed-Chat step 3 as `hpcrlhf bench` runs it (`--dschat-dir`), and the step-2
critic it needs, made by DeepSpeed-Chat's own code.

    python -m hpcrlhf.bench.dschat_rank main.py ARGS...      (under torchrun or deepspeed's launcher)
    python -m hpcrlhf.bench.dschat_rank --make-critic MODEL OUT

Run with DeepSpeed-Chat's folder on PYTHONPATH. DSChat's `main.py` runs unchanged, with these
things around it:

- `--local_rank` from the launcher's LOCAL_RANK when not given (torchrun passes it in the
  environment only; DSChat reads the argument);
- before each of DSChat's per-step throughput lines, rank 0 prints `hpcrlhf-bench wall <seconds>`
  (a monotonic clock): the real step time is the time between two of them, where DSChat's own
  "End-to-End" latency leaves out experience making (its code says so);
- on CPU, DeepSpeed's JIT ops are prepared as for hpcrlhf's own runs (`prepare_cpu_ops`);
- its final `save_hf_format` is skipped: the benchmark needs no model, and with transformers 5
  tokenizers it fails (`save_vocabulary` wants a `vocab_file` they no longer have), after the
  steps, turning a complete run into a failed one.
"""

from __future__ import annotations

import os
import runpy
import sys
import time


WALL = "hpcrlhf-bench wall"


def make_critic(model: str, out: str) -> None:
    """A DSChat step-2 output from a Hugging Face causal LM folder: DSChat's reward model (its own
    value head on the model) as `pytorch_model.bin`, with the model's config and tokenizer files."""
    import shutil
    from pathlib import Path

    import torch
    from dschat.utils.model.model_utils import create_critic_model
    from dschat.utils.utils import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(model, fast_tokenizer=True)
    critic = create_critic_model(model, tokenizer, None, num_padding_at_beginning=0, rlhf_training=False)
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    torch.save(critic.state_dict(), target / "pytorch_model.bin")
    for f in Path(model).iterdir():
        if f.is_file() and (f.suffix in (".json", ".model", ".jinja", ".txt")):
            shutil.copy(f, target / f.name)


def prepare_cpu_ops() -> None:
    """DeepSpeed's JIT ops as hpcrlhf's own runs take them: FusedAdam's CPU kernel (what DSChat's
    optimizer loads) built once into hpcrlhf's cache under its crash-safe lock, the shared-memory
    inference all-reduce op not built (training never uses it; see `skip_shm_comm_build`)."""
    from deepspeed.ops.op_builder import FusedAdamBuilder

    from hpcrlhf.engines.deepspeed_engine import load_jit_op, skip_shm_comm_build  # torch

    skip_shm_comm_build()
    load_jit_op(FusedAdamBuilder())


def run_step3(argv: list[str]) -> None:
    script = next(a for a in argv if a.endswith(".py"))
    args = [a for a in argv if a != script]
    if not any(a.startswith("--local_rank") for a in args):
        args = ["--local_rank", os.environ.get("LOCAL_RANK", "0"), *args]
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        prepare_cpu_ops()
    import dschat.utils.perf as perf
    import dschat.utils.utils as utils

    print_step = perf.print_throughput_step3

    def stamped(*a, **kw):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{WALL} {time.monotonic():.6f}", flush=True)
        return print_step(*a, **kw)

    perf.print_throughput_step3 = stamped
    utils.save_hf_format = lambda *a, **kw: print("hpcrlhf bench: DeepSpeed-Chat's final model save skipped", flush=True)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make-critic"]:
        make_critic(sys.argv[2], sys.argv[3])
    else:
        run_step3(sys.argv[1:])
