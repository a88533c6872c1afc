"""The real DeepSpeed-Chat step 3 (microsoft/DeepSpeedExamples, applications/DeepSpeed-Chat) as a
benchmark system: its `main.py` run with the suite's settings, its per-step log parsed.

DSChat prints, on rank 0 after every PPO step (dschat/utils/perf.py, `print_throughput_step3`):

    End-to-End => Latency: 12.34s, TFLOPs: 1.23, Samples/sec: 2.59, Time/seq 0.39s, Batch Size: 32, Total Seq. Length: 512
    Generation => Latency: 8.76s, Per-token Latency 34.22 ms, TFLOPs: 0.50, BW: 123.45 GB/sec, Answer Seq. Length: 256
    Training   => Latency: 3.58s, TFLOPs: 3.21

Its end-to-end latency is generation + training only: the reference, reward and critic forward
passes of experience making are in neither (its own code says so). The bench therefore runs each
rank through `hpcrlhf.bench.dschat_rank`, which stamps rank 0's clock before every such line: the
step time is the time between two stamps (`timing/step`), and what generation and training leave
of it is experience making (`timing/make_experience`). DSChat's own figure stays as `dschat/e2e_s`.

Everything it reads is prepared in the system's run folder, never in the user's checkout: a copy
of DeepSpeed-Chat's code with the suite's prompts as its `local/jsonfile` data (`data/train.json`),
the actor (the suite's model, whose generation config asks for exactly the suite's response
length, as every other system generates), and the critic: a DSChat step-2 output given with
`--dschat-critic`, else made from the suite's reward model by DSChat's own code.

GPU suites run it as its scripts do (the `deepspeed` launcher, ZeRO-3, the hybrid engine, the
reference offloaded). CPU suites run it with `DS_ACCELERATOR=cpu` under torchrun, in bf16 (its
`--dtype` has no fp32), ZeRO-2 (its single-node scripts' stage for small models; at ZeRO-3 its
critic's value head, made outside ZeRO-3's init, stays fp32 while the rest is bf16, which
DeepSpeed refuses), without the hybrid engine (CUDA kernels) and reference offload (a ZeRO-3 option).
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

from hpcrlhf.bench.dschat_rank import WALL
from hpcrlhf.bench.measure import summarize
from hpcrlhf.bench.runner import run_logged, step_train_flops
from hpcrlhf.bench.suites import DSCHAT_PER_DEVICE_BATCH, Suite
from hpcrlhf.errors import ConfigError, HpcrlhfError
from hpcrlhf.logs import get_logger

log = get_logger()

STEP3 = Path("applications/DeepSpeed-Chat/training/step3_rlhf_finetuning")
_NUM = r"(-?[\d.]+)"
_E2E = re.compile(rf"End-to-End => Latency: {_NUM}s, TFLOPs: {_NUM}, Samples/sec: {_NUM}, Time/seq {_NUM}s, "
                  rf"Batch Size: (\d+), Total Seq\. Length: (\d+)")
_GEN = re.compile(rf"Generation => Latency: {_NUM}s, Per-token Latency {_NUM} ms, TFLOPs: {_NUM}, BW: {_NUM} GB/sec, "
                  rf"Answer Seq\. Length: (\d+)")
_TRAIN = re.compile(rf"Training\s+=> Latency: {_NUM}s, TFLOPs: {_NUM}")


def parse_log(text: str, generation_batches: int = 1) -> list[dict[str, float]]:
    """One row per PPO step DSChat printed, in hpcrlhf's metric names (`timing/step`,
    `timing/generate`, `timing/train`, `timing/make_experience`) plus DSChat's own figures
    (`dschat/*`). A step counts once its three lines are seen, in order. DSChat's generation
    latency is its last generation batch's: the step's is `generation_batches` times it, as its
    own end-to-end figure counts it. Where `dschat_rank` stamped the clock, a step's time is the
    time since the stamp before (the first step, which has none, keeps DSChat's end-to-end
    figure); else DSChat's end-to-end figure."""
    rows: list[dict[str, float]] = []
    current: dict[str, float] = {}
    walls: list[float] = []
    for line in text.splitlines():
        if line.startswith(WALL):
            walls.append(float(line.split()[-1]))
        elif m := _E2E.search(line):
            current = {"timing/step": float(m[1]), "dschat/e2e_s": float(m[1]), "dschat/tflops": float(m[2]),
                       "dschat/samples_per_sec": float(m[3]), "dschat/batch_size": float(m[5]),
                       "dschat/seq_length": float(m[6])}
            if len(walls) >= 2:
                current["timing/step"] = walls[-1] - walls[-2]
        elif (m := _GEN.search(line)) and current:
            current.update({"timing/generate": float(m[1]) * generation_batches, "dschat/answer_length": float(m[5])})
        elif (m := _TRAIN.search(line)) and "timing/generate" in current:
            current["timing/train"] = float(m[1])
            current["rollout/response_length"] = current["dschat/answer_length"]
            if len(walls) >= 2:
                current["timing/make_experience"] = max(0.0, current["timing/step"] - current["timing/generate"]
                                                        - current["timing/train"])
            rows.append(current)
            current = {}
    return rows


@dataclass(frozen=True)
class DSChat:
    checkout: Path
    critic: Path | None
    """A DSChat step-2 output; None: made from the suite's reward model (`dschat_rank.make_critic`)."""

    @classmethod
    def from_args(cls, dschat_dir: str, *, critic: str | None, suite: Suite) -> DSChat:
        """Checked before anything runs: the checkout, the batches, the step-2 critic if given."""
        checkout = Path(dschat_dir).expanduser().resolve()
        if not (checkout / STEP3 / "main.py").is_file():
            raise ConfigError(f"--dschat-dir: {checkout} is not a DeepSpeedExamples checkout ({STEP3}/main.py is "
                              "missing); clone https://github.com/microsoft/DeepSpeedExamples and give its folder")
        if critic is not None and not (Path(critic) / "pytorch_model.bin").is_file():
            raise ConfigError(f"--dschat-critic: {critic!r} is not a DeepSpeed-Chat step-2 output (a folder with "
                              "pytorch_model.bin); give DSChat step 2's output folder, or leave --dschat-critic out "
                              "to have one made from the suite's reward model")
        generation_batches(suite)
        return cls(checkout, Path(critic).resolve() if critic else None)

    @property
    def chat(self) -> Path:
        return self.checkout / STEP3.parents[1]

    def prepare(self, suite: Suite, prompts: Path, run_dir: Path) -> tuple[Path, Path, Path]:
        """(DeepSpeed-Chat's code, the actor, the critic) for a run in `run_dir`: its code copied
        with the suite's prompts as its data, the actor with the suite's fixed response length."""
        import json
        import shutil
        import subprocess

        from hpcrlhf.models.loading import load_tokenizer, resolve_model_path  # torch, transformers

        chat = run_dir / "DeepSpeed-Chat"
        media = shutil.ignore_patterns(".git", "assets", "*.png", "*.mp4", "*.gif", "__pycache__")
        shutil.copytree(self.chat, chat, ignore=lambda folder, names: set(media(folder, names)) | (
            {"data"} if Path(folder) == self.chat else set()))  # its own data/ is the suite's prompts
        texts = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]
        fitted = fit_prompts(load_tokenizer(suite.model), texts, suite.prompt_tokens)
        (chat / "data").mkdir()
        rows = "".join(json.dumps({"prompt": t, "chosen": "", "rejected": ""}) + "\n" for t in fitted)
        for split in ("train", "eval"):
            (chat / "data" / f"{split}.json").write_text(rows)
        actor = run_dir / "actor"
        shutil.copytree(resolve_model_path(suite.model), actor)
        generation = actor / "generation_config.json"
        config = json.loads(generation.read_text()) if generation.exists() else {}
        generation.write_text(json.dumps({**config, "min_new_tokens": suite.response_tokens}, indent=2))
        critic = self.critic
        if critic is None:
            critic = run_dir / "critic"
            reward = resolve_model_path(suite.reward_model or suite.model)
            subprocess.run([sys.executable, "-m", "hpcrlhf.bench.dschat_rank", "--make-critic", str(reward),
                            str(critic)], env=self.env(suite, chat), check=True, capture_output=True, text=True)
        return chat, actor, critic

    def env(self, suite: Suite, chat: Path) -> dict[str, str]:
        import os

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(chat), os.environ.get("PYTHONPATH")]))}
        if suite.hardware == "cpu":
            env.update(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0")
        return env

    def command(self, suite: Suite, actor: Path, critic: Path, out: Path) -> list[str]:
        """DSChat step 3 with the suite's settings: its defaults where the suite is silent."""
        gpu = suite.hardware == "gpu"
        args = ["--data_path", "local/jsonfile", "--data_split", "0,0,1",  # every prompt row for step 3
                "--actor_model_name_or_path", str(actor), "--critic_model_name_or_path", str(critic),
                "--num_padding_at_beginning", "0",  # llama-family tokenizers (OPT: 1)
                "--per_device_generation_batch_size", str(DSCHAT_PER_DEVICE_BATCH),
                "--per_device_training_batch_size", str(DSCHAT_PER_DEVICE_BATCH),
                "--generation_batches", str(generation_batches(suite)), "--ppo_epochs", "1",
                "--max_prompt_seq_len", str(suite.prompt_tokens), "--max_answer_seq_len", str(suite.response_tokens),
                "--actor_zero_stage", "3" if gpu else "2", "--critic_zero_stage", "3" if gpu else "2",
                "--dtype", "bf16" if suite.precision == "bf16" or not gpu else "fp16",
                *(["--enable_hybrid_engine", "--offload_reference_model"] if gpu else []),
                "--enable_test_mode", "--test_stop_step", str(suite.warmup_steps + suite.steps),
                "--deepspeed", "--seed", "1234", "--output_dir", str(out)]
        if suite.gradient_checkpointing:
            args += ["--actor_gradient_checkpointing", "--critic_gradient_checkpointing"]
        rank = ["--module", "hpcrlhf.bench.dschat_rank", "main.py", *args]  # each rank: `dschat_rank` runs main.py
        if gpu:
            return ["deepspeed", f"--num_nodes={suite.nodes}", f"--num_gpus={suite.gpus_per_node}", *rank]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={suite.ranks}", *rank]

    def run(self, suite: Suite, out: Path, index: int, peak) -> dict:
        """Prepare and run DSChat, parse its log and summarise it like the other systems."""
        run_dir = out / "dschat"
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)  # a benchmark always measures a fresh run
        run_dir.mkdir(parents=True)

        log.info(f"bench [{index}/{index}] dschat: DeepSpeed-Chat step 3 from {self.checkout}")
        started = time.monotonic()
        chat, actor, critic = self.prepare(suite, out / "prompts.jsonl", run_dir)
        code = run_logged(self.command(suite, actor, critic, run_dir / "output"), run_dir, cwd=chat / STEP3.relative_to(
            STEP3.parents[1]), env=self.env(suite, chat))
        how = "hybrid engine, ZeRO-3" if suite.hardware == "gpu" else "CPU: bf16, ZeRO-2, no hybrid engine"
        entry = {"name": "dschat", "kind": "dschat", "about": f"DeepSpeed-Chat step 3 ({how})",
                 "scaling": None, "run_dir": str(run_dir), "wall_s": time.monotonic() - started}
        rows = parse_log((run_dir / "job.log").read_text(errors="replace"), generation_batches(suite))
        return entry | summarize_dschat(rows, suite, peak, code)


def generation_batches(suite: Suite) -> int:
    """DSChat's generation batches per PPO step: the suite's prompts over its per-device batch on every rank."""
    per_step = DSCHAT_PER_DEVICE_BATCH * suite.ranks
    if suite.prompts_per_step % per_step:
        raise ConfigError(f"suite {suite.name}: {suite.prompts_per_step} prompts per step is not a multiple of "
                          f"DSChat's {DSCHAT_PER_DEVICE_BATCH} per device x {suite.ranks} devices")
    return suite.prompts_per_step // per_step


def fit_prompts(tokenizer, texts: Sequence[str], max_tokens: int) -> list[str]:
    """The prompts as DSChat keeps them: its `local/jsonfile` reader prefixes a space, and step 3
    drops a prompt of more than `max_tokens` tokens (it left-pads the others to exactly that), so
    each text loses its last words until " " + text fits."""
    out = []
    for text in texts:
        words = text.split()
        while words and len(tokenizer(" " + " ".join(words))["input_ids"]) > max_tokens:
            words.pop()
        if not words:
            raise ConfigError(f"a prompt cannot be cut to {max_tokens} tokens for DeepSpeed-Chat: {text[:60]!r}")
        out.append(" ".join(words))
    return out


def summarize_dschat(rows: Sequence[dict], suite: Suite, peak, returncode: int) -> dict:
    """A results entry (status, throughput or error) from DSChat's parsed steps."""
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
