"""The real DeepSpeed-Chat step 3 (microsoft/DeepSpeedExamples, applications/DeepSpeed-Chat) as a
benchmark system: its `main.py` run with the suite's settings, its per-step log parsed.

DSChat prints, on rank 0 after every PPO step (dschat/utils/perf.py, `print_throughput_step3`):

    End-to-End => Latency: 12.34s, TFLOPs: 1.23, Samples/sec: 2.59, Time/seq 0.39s, Batch Size: 32, Total Seq. Length: 512
    Generation => Latency: 8.76s, Per-token Latency 34.22 ms, TFLOPs: 0.50, BW: 123.45 GB/sec, Answer Seq. Length: 256
    Training   => Latency: 3.58s, TFLOPs: 3.21

Its end-to-end latency is generation + training only: the reference, reward and critic forward
passes of experience making are in neither (its own code says so), so DSChat's samples/s is
optimistic by that much; `make_experience` is reported as 0 for it.

DSChat needs CUDA GPUs (fp16/bf16 DeepSpeed engines, FusedAdam), so it runs in gpu suites only,
and its critic must be a DSChat step-2 output (a folder with `pytorch_model.bin`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from hpcrlhf.bench.measure import summarize
from hpcrlhf.bench.suites import DSCHAT_PER_DEVICE_BATCH, Suite
from hpcrlhf.errors import ConfigError
from hpcrlhf.logs import get_logger

log = get_logger()

STEP3 = Path("applications/DeepSpeed-Chat/training/step3_rlhf_finetuning")
_NUM = r"(-?[\d.]+)"
_E2E = re.compile(rf"End-to-End => Latency: {_NUM}s, TFLOPs: {_NUM}, Samples/sec: {_NUM}, Time/seq {_NUM}s, "
                  rf"Batch Size: (\d+), Total Seq\. Length: (\d+)")
_GEN = re.compile(rf"Generation => Latency: {_NUM}s, Per-token Latency {_NUM} ms, TFLOPs: {_NUM}, BW: {_NUM} GB/sec, "
                  rf"Answer Seq\. Length: (\d+)")
_TRAIN = re.compile(rf"Training\s+=> Latency: {_NUM}s, TFLOPs: {_NUM}")


def parse_log(text: str) -> list[dict[str, float]]:
    """One row per PPO step DSChat printed, in hpcrlhf's metric names (`timing/step`,
    `timing/generate`, `timing/train`) plus DSChat's own figures (`dschat/*`). A step counts
    once its three lines are seen, in order."""
    rows: list[dict[str, float]] = []
    current: dict[str, float] = {}
    for line in text.splitlines():
        if m := _E2E.search(line):
            current = {"timing/step": float(m[1]), "dschat/tflops": float(m[2]), "dschat/samples_per_sec": float(m[3]),
                       "dschat/batch_size": float(m[5]), "dschat/seq_length": float(m[6])}
        elif (m := _GEN.search(line)) and current:
            current.update({"timing/generate": float(m[1]), "dschat/answer_length": float(m[5])})
        elif (m := _TRAIN.search(line)) and "timing/generate" in current:
            current["timing/train"] = float(m[1])
            current["rollout/response_length"] = current["dschat/answer_length"]
            rows.append(current)
            current = {}
    return rows


@dataclass(frozen=True)
class DSChat:
    checkout: Path
    critic: Path

    @classmethod
    def from_args(cls, dschat_dir: str, *, critic: str | None, suite: Suite) -> "DSChat":
        """Checked before anything runs: the checkout, the suite's hardware, the step-2 critic."""
        checkout = Path(dschat_dir).expanduser().resolve()
        if not (checkout / STEP3 / "main.py").is_file():
            raise ConfigError(f"--dschat-dir: {checkout} is not a DeepSpeedExamples checkout ({STEP3}/main.py is "
                              "missing); clone https://github.com/microsoft/DeepSpeedExamples and give its folder")
        if suite.hardware != "gpu":
            raise ConfigError(f"--dschat-dir: DeepSpeed-Chat needs CUDA GPUs; suite {suite.name} is a CPU suite: use a "
                              "gpu-* suite (the dschat-style system is the CPU stand-in)")
        if critic is None or not (Path(critic) / "pytorch_model.bin").is_file():
            raise ConfigError(f"--dschat-critic: {critic!r} is not a DeepSpeed-Chat step-2 output (a folder with "
                              "pytorch_model.bin); train one with DSChat's step 2 and give its output folder")
        return cls(checkout, Path(critic).resolve())

    def command(self, suite: Suite, out: Path) -> list[str]:
        """DSChat step 3 with the suite's settings: its defaults where the suite is silent."""
        per_step = DSCHAT_PER_DEVICE_BATCH * suite.ranks
        if suite.prompts_per_step % per_step:
            raise ConfigError(f"suite {suite.name}: {suite.prompts_per_step} prompts per step is not a multiple of "
                              f"DSChat's {DSCHAT_PER_DEVICE_BATCH} per device x {suite.ranks} devices")
        args = ["--data_path", "Dahoas/rm-static", "--data_split", "2,4,4",
                "--actor_model_name_or_path", str(suite.model), "--critic_model_name_or_path", str(self.critic),
                "--num_padding_at_beginning", "0",  # llama-family tokenizers (OPT: 1)
                "--per_device_generation_batch_size", str(DSCHAT_PER_DEVICE_BATCH),
                "--per_device_training_batch_size", str(DSCHAT_PER_DEVICE_BATCH),
                "--generation_batches", str(suite.prompts_per_step // per_step), "--ppo_epochs", "1",
                "--max_prompt_seq_len", str(suite.prompt_tokens), "--max_answer_seq_len", str(suite.response_tokens),
                "--actor_zero_stage", "3", "--critic_zero_stage", "3", "--dtype", suite.precision.replace("fp32", "fp16"),
                "--enable_hybrid_engine", "--offload_reference_model",
                "--enable_test_mode", "--test_stop_step", str(suite.warmup_steps + suite.steps),
                "--deepspeed", "--seed", "1234", "--output_dir", str(out)]
        if suite.gradient_checkpointing:
            args += ["--actor_gradient_checkpointing", "--critic_gradient_checkpointing"]
        return ["deepspeed", f"--num_nodes={suite.nodes}", f"--num_gpus={suite.gpus_per_node}", "main.py", *args]

    def run(self, suite: Suite, out: Path, index: int, peak) -> dict:
        """Run DSChat, parse its log and summarise it like the other systems."""
        run_dir = out / "dschat"
        run_dir.mkdir(parents=True, exist_ok=True)
        from hpcrlhf.bench.runner import run_logged

        log.info(f"bench [{index}/{index}] dschat: DeepSpeed-Chat step 3 from {self.checkout}")
        started = time.monotonic()
        code = run_logged(self.command(suite, run_dir), run_dir, cwd=self.checkout / STEP3)
        entry = {"name": "dschat", "kind": "dschat", "about": "DeepSpeed-Chat step 3 (hybrid engine, ZeRO-3)",
                 "scaling": None, "run_dir": str(run_dir), "wall_s": time.monotonic() - started}
        rows = parse_log((run_dir / "job.log").read_text(errors="replace"))
        return entry | summarize_dschat(rows, suite, peak, code)


def summarize_dschat(rows: Sequence[dict], suite: Suite, peak, returncode: int) -> dict:
    """A results entry (status, throughput or error) from DSChat's parsed steps."""
    from hpcrlhf.bench.runner import step_train_flops
    from hpcrlhf.errors import HpcrlhfError

    if returncode != 0 and len(rows) <= suite.warmup_steps:
        return {"status": "failed", "error": f"DeepSpeed-Chat exited {returncode} after {len(rows)} step(s)"}
    try:
        batch = int(rows[-1]["dschat/batch_size"]) if rows else suite.prompts_per_step
        t = summarize(rows, warmup=suite.warmup_steps, samples=batch, prompt_tokens=suite.prompt_tokens,
                      devices=suite.devices, train_flops_per_step=step_train_flops(suite) * batch / suite.prompts_per_step,
                      peak_flops=peak.matmul_flops)
    except HpcrlhfError as e:
        return {"status": "failed", "error": str(e)}
    return {"status": "ok", "throughput": t.to_dict()}
