"""Plots of runs' metrics (PNG), for results people compare."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hpcrlhf.run.metrics import read_metrics


def plot_metrics(run_dir: Path | str, keys: Sequence[str], out: Path | str, title: str = "") -> Path:
    """One panel per metric key against `step`; keys absent from the run are skipped."""
    return plot_runs({"": run_dir}, keys, out, title)


def plot_runs(runs: Mapping[str, Path | str], keys: Sequence[str], out: Path | str, title: str = "") -> Path:
    """One panel per metric key against `step`, a line per run (labelled by its name, when named);
    keys no run logged are skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = {name: read_metrics(folder) for name, folder in runs.items()}
    keys = [k for k in keys if any(k in r for rows in records.values() for r in rows)]
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(4.2 * max(1, len(keys)), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for name, rows in records.items():
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), marker="o" if len(points) < 20 else None, markersize=3, label=name or None)
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
        if any(records):
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


@contextmanager
def figure(path: Path | str, ncols: int = 1, figsize: tuple[float, float] = (5, 3.2),
           dpi: int = 120) -> Iterator[tuple[Any, list[Any]]]:
    """A figure of `ncols` panels side by side (matplotlib, no display): (figure, axes), laid out and
    saved to `path` when the block ends, closed whatever happens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=figsize, squeeze=False)
    try:
        yield fig, list(axes[0])
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
