"""`hpcrlhf demo`: the main job on the embedded defaults, with a before/after report.

The pipeline so far: SFT of the bundled tiny model on the bundled arithmetic task, then a reward
model trained from the SFT model on the task's preference pairs (easy: wrong number of digits;
hard: off by one digit). PPO is appended here when it lands. Every stage resumes if the demo is
interrupted and run again.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import RMConfig, SFTConfig
from hpcrlhf.logs import get_logger

RM_STEPS = 400
"""Reward-model steps in the demo (the RM's default one epoch over 80k pairs takes longer)."""


def run_demo(out: Path, *, fresh: bool = False) -> int:
    from hpcrlhf.plots import plot_metrics
    from hpcrlhf.trainers.rm import run_rm
    from hpcrlhf.trainers.sft import run_sft

    if fresh and out.exists():
        shutil.rmtree(out)
    sft = run_sft(load_config(SFTConfig, overrides=[f"output_dir={out / 'sft'}"]))
    if sft["status"] != "done":
        return 3
    rm = run_rm(load_config(RMConfig, overrides=[f"output_dir={out / 'rm'}", f"model.path={out / 'sft' / 'model'}",
                                                  f"train.max_steps={RM_STEPS}", "eval.every_steps=100"]))
    if rm["status"] != "done":
        return 3
    report = ["", "hpcrlhf demo on held-out arithmetic prompts",
              "  policy: task score (exact-match accuracy of greedy answers)"]
    if sft.get("before"):
        report.append(f"    {'base model':<12}{sft['before']['eval/task_score']:>8.3f}")
    report.append(f"    {'after SFT':<12}{sft['after']['eval/task_score']:>8.3f}")
    after = rm["after"]
    report += ["  reward model: pairwise accuracy (chosen = correct answer scores higher)",
               f"    {'all pairs':<12}{after['eval/accuracy']:>8.3f}",
               f"    {'easy pairs':<12}{after.get('eval/accuracy_easy', float('nan')):>8.3f}   (wrong number of digits)",
               f"    {'hard pairs':<12}{after.get('eval/accuracy_hard', float('nan')):>8.3f}   (off by one digit)"]
    sft_png = plot_metrics(out / "sft", ["train/loss", "eval/loss", "eval/task_score"], out / "sft_curves.png",
                           title="hpcrlhf demo: SFT of the tiny llama on arithmetic")
    rm_png = plot_metrics(out / "rm", ["train/loss", "eval/accuracy", "eval/accuracy_hard"], out / "rm_curves.png",
                          title="hpcrlhf demo: reward model from the SFT model")
    report.append(f"  run folders: {out / 'sft'}, {out / 'rm'} (metrics.jsonl, tensorboard/, model/)")
    report.append(f"  curves: {sft_png}, {rm_png}")
    print("\n".join(report))
    get_logger().info("demo finished")
    return 0
