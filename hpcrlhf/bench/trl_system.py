"""TRL's online RL trainer as a benchmark system (run when `trl` is installed).

TRL 1.x has no PPO trainer any more (its PPOTrainer left for `trl.experimental` and was then
dropped); its online RL trainers are GRPOTrainer and RLOOTrainer. This runs GRPOTrainer on the
suite's prompts with the suite's settings, as close to the PPO step as GRPO allows:

- same policy (actor), reference (`beta` = the suite's KL coefficient, so TRL keeps a reference
  model) and reward model (the suite's reward folder as `AutoModelForSequenceClassification`,
  one score head, as hpcrlhf's reward role loads it);
- same samples per step (the suite's prompts per step; GRPO needs groups, so 2 samples for each
  of half as many distinct prompts), fixed-length answers (`min_new_tokens`), temperature 1,
  one epoch, clip 0.2, DSChat's per-device batch 16 on every rank (torchrun, as dschat-style);
- generation by the policy with Hugging Face `generate` (TRL's default; `--use-vllm` switches
  to TRL's colocated vLLM on GPU clusters);
- no critic: GRPO does less work per sample than PPO (no value model forward or update), so its
  samples/s is an upper bound for a TRL PPO step on the same hardware.

A step here is one generation round (`steps_per_generation` optimizer steps). The subclass times
TRL's own phases: `_generate` (generate), the rest of `_generate_and_score_completions` (reward
model, reference log-probs: make_experience) and the remainder of the round (train), written as
hpcrlhf metrics rows (`metrics.jsonl`) so `hpcrlhf bench` reads them like any other run.

    python -m hpcrlhf.bench.trl_system --model M --reward-model R --prompts P --output-dir D \
        --prompts-per-step N --response-tokens T --steps S [--kl 0.1] [--bf16] [--use-vllm]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from hpcrlhf.bench.suites import GRPO_GROUP as SAMPLES_PER_PROMPT
from hpcrlhf.errors import ConfigError


def trl_version() -> str | None:
    """The installed trl's version, or None."""
    try:
        import trl
    except ImportError:
        return None
    return trl.__version__


def rounds_layout(prompts_per_step: int, per_device_batch: int, processes: int) -> int:
    """Optimizer steps per generation round: the round's samples in per-device batches on every
    process; the numbers must divide (GRPO's groups of 2 included)."""
    global_batch = per_device_batch * processes
    if prompts_per_step % global_batch or prompts_per_step % SAMPLES_PER_PROMPT:
        raise ConfigError(f"trl: prompts_per_step {prompts_per_step} must be a multiple of the train batch "
                          f"{per_device_batch} x {processes} processes and of GRPO's group size {SAMPLES_PER_PROMPT}")
    return prompts_per_step // global_batch


def deepspeed_config(stage: int, offload_optimizer: bool) -> dict | None:
    """The DeepSpeed config TRL's Trainer gets ("auto": the Trainer fills in its own batch sizes and
    precision); None for stage 0 (plain DDP)."""
    if stage == 0:
        return None
    zero: dict = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    # no train_batch_size: DeepSpeed derives it (micro x accumulation x world), also while the models
    # are loaded, before the Trainer has joined the process group
    return {"zero_optimization": zero, "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}


def _trainer_class():
    import torch
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that adds up the seconds of its generation and scoring per round."""

        phase_s: dict = defaultdict(float)
        response_lengths: list = []
        finished: list = []
        """Per round: answers that ended (EOS) before the token limit; 0 under fixed lengths."""
        max_tokens = 0

        def _generate(self, prompts):
            start = time.perf_counter()
            out = super()._generate(prompts)
            self.phase_s["generate"] += time.perf_counter() - start
            return out

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.phase_s["score"] += time.perf_counter() - start
            lengths = torch.as_tensor(out["completion_mask"]).sum(-1).float()
            self.response_lengths.append(float(lengths.mean()))
            self.finished.append(float((lengths < self.max_tokens).float().mean()))
            return out

    return TimedGRPOTrainer


def _round_logger(trainer_cls, out: Path, per_round: int):
    from transformers import TrainerCallback

    class RoundLogger(TrainerCallback):
        """One metrics row per generation round, on the main process."""

        def __init__(self) -> None:
            self.start = 0.0
            self.sink = None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step % per_round == 0:
                self.start = time.perf_counter()
                trainer_cls.phase_s.clear()
                trainer_cls.response_lengths.clear()
                trainer_cls.finished.clear()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % per_round or not state.is_world_process_zero:
                return
            step_s = time.perf_counter() - self.start
            gen, score = trainer_cls.phase_s["generate"], trainer_cls.phase_s["score"]

            def mean(values: list[float]) -> float:
                return sum(values) / max(1, len(values))

            row = {"step": state.global_step // per_round, "timing/step": step_s, "timing/generate": gen,
                   "timing/make_experience": max(0.0, score - gen), "timing/train": max(0.0, step_s - score),
                   "rollout/response_length": mean(trainer_cls.response_lengths),
                   "rollout/finished": mean(trainer_cls.finished)}
            if self.sink is None:
                self.sink = (out / "metrics.jsonl").open("a")
            self.sink.write(json.dumps(row) + "\n")
            self.sink.flush()

    return RoundLogger()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcrlhf.bench.trl_system", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--reward-model", required=True)
    p.add_argument("--prompts", required=True, help="JSONL rows with a 'prompt' text")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--prompts-per-step", type=int, required=True)
    p.add_argument("--response-tokens", type=int, required=True)
    p.add_argument("--steps", type=int, required=True, help="generation rounds (warm-up included)")
    p.add_argument("--per-device-batch", type=int, default=16)
    p.add_argument("--kl", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--use-vllm", action="store_true", help="TRL's colocated vLLM (GPU)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0,
                   help="DeepSpeed ZeRO stage through TRL's Trainer (0: plain DDP, TRL's default)")
    p.add_argument("--offload-optimizer", action="store_true", help="ZeRO: Adam states in CPU memory")
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args(argv)

    import os

    import torch
    from datasets import Dataset
    from trl import GRPOConfig

    from hpcrlhf.engines.deepspeed_engine import skip_shm_comm_build  # torch, as the imports above
    from hpcrlhf.models.loading import load_tokenizer, resolve_model_path  # torch, transformers

    skip_shm_comm_build()  # as hpcrlhf's own ranks: not built, not loaded under torch's lock file
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    per_round = rounds_layout(args.prompts_per_step, args.per_device_batch, processes)
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    # each prompt once per group member: GRPO repeats every prompt num_generations times itself
    distinct = prompts[: len(prompts) // SAMPLES_PER_PROMPT]
    dataset = Dataset.from_list([{"prompt": t} for t in distinct])
    model, reward = resolve_model_path(args.model), resolve_model_path(args.reward_model)
    config = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=args.per_device_batch, gradient_accumulation_steps=1,
        num_generations=SAMPLES_PER_PROMPT, generation_batch_size=args.prompts_per_step,
        max_completion_length=args.response_tokens, generation_kwargs={"min_new_tokens": args.response_tokens},
        temperature=1.0, top_p=1.0, top_k=0, beta=args.kl, num_iterations=1, epsilon=0.2,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, max_steps=args.steps * per_round,
        logging_steps=1, report_to=[], save_strategy="no", seed=0, shuffle_dataset=False,
        bf16=args.bf16, use_cpu=args.cpu, gradient_checkpointing=args.gradient_checkpointing,
        use_vllm=args.use_vllm, vllm_mode="colocate", dataloader_num_workers=0, disable_tqdm=True,
        ddp_find_unused_parameters=False, deepspeed=deepspeed_config(args.zero_stage, args.offload_optimizer),
        model_init_kwargs={"dtype": torch.bfloat16 if args.bf16 else torch.float32},
    )
    trainer_cls = _trainer_class()
    trainer_cls.max_tokens = args.response_tokens
    trainer = trainer_cls(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=load_tokenizer(model), callbacks=[_round_logger(trainer_cls, out, per_round)])
    trainer.train()
    if trainer.accelerator.is_main_process:  # how TRL really ran, read back from its trainer
        plugin = trainer.accelerator.state.deepspeed_plugin
        setup = {"trl": trl_version(), "world_size": trainer.accelerator.num_processes,
                 "zero_stage": plugin.zero_stage if plugin is not None else 0,
                 "zero3_partitioned": any(hasattr(p, "ds_id") for p in trainer.model_wrapped.parameters()),
                 "dtype": str(next(trainer.model.parameters()).dtype).removeprefix("torch."),
                 "use_vllm": config.use_vllm, "generation_batch_size": config.generation_batch_size,
                 "per_device_train_batch_size": config.per_device_train_batch_size,
                 "steps_per_generation": per_round, "num_generations": config.num_generations, "beta": config.beta}
        (out / "trl_setup.json").write_text(json.dumps(setup, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
