"""Fault injection for end-to-end tests: run the real `hpcrlhf` CLI with NaN injected at chosen steps.

    python -m tests.trainers.faults nan-logits 3,4 -- train sft -o RUN ...

makes the trained model's logits NaN in the training forwards of steps 3 and 4 (1-based, as
logged), so their loss and gradients are NaN: what a diverging model or a bad batch produces.
Evaluation forwards (model in eval mode) stay clean. Also a reward rule that returns NaN for the
first training prompt of the bundled task (`tests.trainers.faults:nan_for_first_prompt`), and

    python -m tests.trainers.faults engine-skip STAGE PRECISION

which prints (JSON) whether a `TrainingEngine` that met one NaN step ends where one that never
met it does, and

    python -m tests.trainers.faults hang make_experience 3 -- train ppo -o RUN ...

whose third call of that method never returns (the watchdog's tests), and

    python -m tests.trainers.faults stop-at 6 -- train sft -o RUN ...

which sends the run the stop signal (SIGUSR1, what Slurm sends before a time limit) itself as its
step 6 ends: the stop lands at that step however fast the host runs the steps after it.

A job on Ray reaches its workers through the worker setup hook (hpcrlhf.cluster.reservation.WORKER_SETUP):

    HPCRLHF_WORKER_SETUP=tests.trainers.faults:hang_in_worker HPCRLHF_WORKER_HANG=critic:1:update:3 hpcrlhf train ppo ...

makes the third `update` of critic rank 1's learner never return (role `vllm` for an engine: its
`receive_weights`, a weight-sync receiver that never takes the broadcast).
"""

from __future__ import annotations

import json
import os
import sys

from hpcrlhf.data.tasks import ArithmeticTask

_TASK = ArithmeticTask()
POISONED_PROMPT = _TASK.prompt_rows("train", 1)[0]["prompt"]


def nan_for_first_prompt(prompt: str, response: str, row) -> float:
    """The task's exact score, but NaN for one training prompt (a reward function with a bug)."""
    return float("nan") if prompt == POISONED_PROMPT else _TASK.score(prompt, response)


def inject_nan_logits(steps: set[int]) -> None:
    """Patch the training engine so training forwards during `steps` return NaN logits."""
    from hpcrlhf.engines.deepspeed_engine import TrainingEngine
    from hpcrlhf.trainers.loop import TrainingLoop

    current = {"step": 0}
    guarded_step, forward = TrainingLoop.guarded_step, TrainingEngine.__call__

    def guarded_step_spy(self, step):
        current["step"] = step + 1
        return guarded_step(self, step)

    def poisoned_forward(self, **batch):
        out = forward(self, **batch)
        if current["step"] in steps and self.module.training:
            out["logits"] = out["logits"] * float("nan")
        return out

    TrainingLoop.guarded_step, TrainingEngine.__call__ = guarded_step_spy, poisoned_forward


def engine_skip_report(stage: int, precision: str) -> dict:
    """Two engines from the same weights, accumulation 2: A takes steps good, NaN, good; B takes
    good, good. A skipped step must leave weights, Adam moments and the schedule as they were, so
    A ends exactly where B does."""
    import torch

    from hpcrlhf.config.schema import EngineConfig, OptimConfig
    from hpcrlhf.engines.deepspeed_engine import TrainingEngine, build_deepspeed_config
    from hpcrlhf.engines.distributed import init_distributed
    from hpcrlhf.models.loading import load_causal_lm
    from hpcrlhf.models.tiny import build_tiny_model_dir

    init_distributed()
    optim = OptimConfig(scheduler="linear", warmup_ratio=0.0)
    ds = build_deepspeed_config(EngineConfig(zero_stage=stage, precision=precision), optim, micro_batch_size=2,
                                grad_accum_steps=2, world_size=1)
    batches = [torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def engine() -> TrainingEngine:
        torch.manual_seed(0)
        model = load_causal_lm(str(build_tiny_model_dir("llama")), dtype=precision)
        return TrainingEngine(model, ds, optim=optim, total_steps=10)

    def optimizer_step(e: TrainingEngine, nan: bool) -> None:
        for ids in batches[:2] if not nan else batches[2:]:
            loss = e(input_ids=ids, labels=ids).loss
            e.backward(loss * float("nan") if nan else loss)
            e.step()

    def weights(e: TrainingEngine) -> dict:
        return {k: v.detach().float().clone() for k, v in e.module.state_dict().items()}

    a, b = engine(), engine()
    optimizer_step(a, False), optimizer_step(b, False)
    before = weights(a)
    optimizer_step(a, True)
    unchanged = all(torch.equal(before[k], v) for k, v in weights(a).items())
    skipped, lr_after_skip = a.skipped_updates, a.lr()
    optimizer_step(a, False), optimizer_step(b, False)
    wa, wb = weights(a), weights(b)
    return {"unchanged_by_nan_step": unchanged, "skipped_updates": skipped, "lr_after_skip": lr_after_skip,
            "same_as_never_nan": all(torch.equal(wa[k], wb[k]) for k in wa),
            "finite": all(bool(torch.isfinite(v).all()) for v in wa.values()), "lr_a": a.lr(), "lr_b": b.lr()}


HANGS = {"make_experience": ("hpcrlhf.trainers.ppo.driver", "PPOTrainer"), "train_step": ("hpcrlhf.trainers.sft", "SFTTrainer"),
         "generate": ("hpcrlhf.engines.rollout.hf", "HFRollout"),
         "update": ("hpcrlhf.trainers.ppo.learner", "PPOLearner"),  # in a Ray worker: `hang_in_worker`
         "receive_weights": ("hpcrlhf.engines.rollout.vllm", "VLLMRollout")}
"""The methods `hang` can make hang, and their classes."""

WORKER_HANG = "HPCRLHF_WORKER_HANG"
"""ROLE:RANK:METHOD:CALL, read by `hang_in_worker` in every Ray worker of the job."""


def inject_hang(method: str, call: int) -> None:
    """Patch `method` (a key of HANGS) so that its `call`-th call sleeps instead of returning (a wait that
    never ends: a role that stopped answering, a collective whose peer died)."""
    import importlib
    import time

    module, cls = HANGS[method]
    owner = getattr(importlib.import_module(module), cls)
    original, calls = getattr(owner, method), {"n": 0}

    def hanging(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            time.sleep(3600)
        return original(self, *args, **kwargs)

    setattr(owner, method, hanging)


def hang_in_worker(worker) -> None:
    """The worker setup hook (HPCRLHF_WORKER_SETUP): in the worker WORKER_HANG names, its METHOD's CALL-th call
    never returns. (A Ray actor's own methods are bound when it is created, so the hang goes into a class
    they call: the learner, the vLLM engine.)"""
    role, rank, method, call = os.environ[WORKER_HANG].split(":")
    if (worker.role, worker.rank) == (role, int(rank)):
        inject_hang(method, int(call))


def inject_stop(step: int) -> None:
    """Patch the run so that the process signals itself SIGUSR1 as step `step` ends (`Run.step_done`):
    the real handler takes it, and the loop's stop check at that step's end finds it."""
    import os
    import signal

    from hpcrlhf.run.folder import Run

    step_done = Run.step_done

    def signalling(self, done: int) -> None:
        step_done(self, done)
        if done == step:
            os.kill(os.getpid(), signal.SIGUSR1)

    Run.step_done = signalling


def main(argv: list[str]) -> int:
    if argv[:1] == ["engine-skip"]:
        print("REPORT " + json.dumps(engine_skip_report(int(argv[1]), argv[2])))
        return 0
    if argv[:1] == ["hang"] and len(argv) > 3 and argv[1] in HANGS and argv[3] == "--":
        inject_hang(argv[1], int(argv[2]))
        cli_args = argv[4:]
    elif argv[:1] in (["nan-logits"], ["stop-at"]) and len(argv) > 2 and argv[2] == "--":
        if argv[0] == "stop-at":
            inject_stop(int(argv[1]))
        else:
            inject_nan_logits({int(s) for s in argv[1].split(",")})
        cli_args = argv[3:]
    else:
        raise SystemExit("usage: python -m tests.trainers.faults nan-logits STEP[,STEP...] -- HPCRLHF ARGS\n"
                         f"       python -m tests.trainers.faults hang {{{','.join(HANGS)}}} CALL -- HPCRLHF ARGS\n"
                         "       python -m tests.trainers.faults stop-at STEP -- HPCRLHF ARGS\n"
                         "       python -m tests.trainers.faults engine-skip STAGE PRECISION")
    from hpcrlhf.cli import main as cli_main

    return cli_main(cli_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
