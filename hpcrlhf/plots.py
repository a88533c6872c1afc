"""Plots of a run's metrics (PNG), for results people compare."""

from __future__ import annotations

from pathlib import Path
from collections.abc import Sequence

from hpcrlhf.run.metrics import read_metrics


def plot_metrics(run_dir: Path | str, keys: Sequence[str], out: Path | str, title: str = "") -> Path:
    """One panel per metric key against `step`; keys absent from the run are skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    keys = [k for k in keys if any(k in r for r in records)]
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(4.2 * max(1, len(keys)), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        ax.plot(*zip(*points), marker="o" if len(points) < 20 else None, markersize=3)
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
