"""`hpcrlhf demo`: the main job on the embedded defaults, with a before/after report.

For now the pipeline is SFT of the bundled tiny model on the bundled arithmetic task; later stages
(reward model, PPO) are appended here as they land.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import SFTConfig
from hpcrlhf.logs import get_logger


def run_demo(out: Path, *, fresh: bool = False) -> int:
    from hpcrlhf.trainers.sft import run_sft

    if fresh and out.exists():
        shutil.rmtree(out)
    sft = run_sft(load_config(SFTConfig, overrides=[f"output_dir={out / 'sft'}"]))
    if sft["status"] != "done":
        return 3
    report = ["", "hpcrlhf demo: task score (exact-match accuracy on held-out arithmetic prompts)",
              f"  {'stage':<12}{'score':>8}"]
    if sft.get("before"):
        report.append(f"  {'base model':<12}{sft['before']['eval/task_score']:>8.3f}")
    report.append(f"  {'after SFT':<12}{sft['after']['eval/task_score']:>8.3f}")
    from hpcrlhf.plots import plot_metrics

    png = plot_metrics(out / "sft", ["train/loss", "eval/loss", "eval/task_score"], out / "sft_curves.png",
                       title="hpcrlhf demo: SFT of the tiny llama on arithmetic")
    report.append(f"  run folder: {out / 'sft'} (metrics.jsonl, tensorboard/, model/); curves: {png}")
    print("\n".join(report))
    get_logger().info("demo finished")
    return 0
