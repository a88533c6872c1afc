"""A suite's results as results.json, a markdown table (results.md) and PNG plots: samples/s per
system, the phase breakdown as stacked bars, and samples/s along the scaling axis."""

from __future__ import annotations

import json
from pathlib import Path

from hpcrlhf.bench.measure import PHASES

BASELINE = "dschat-style"
SYNC = "sync"
"""A long-tail suite's baseline: hpcrlhf generating each step's batch, then training on it."""


def _ok(doc: dict) -> list[dict]:
    return [s for s in doc["systems"] if s["status"] == "ok"]


def baseline(doc: dict) -> str:
    """The system others are compared with: DSChat-style, or a long-tail suite's synchronous run."""
    return BASELINE if doc["suite"].get("lengths") is None else SYNC


def speedups(doc: dict) -> dict[str, float]:
    """samples/s of every measured system over the baseline's (empty without it)."""
    base = next((s for s in _ok(doc) if s["name"] == baseline(doc)), None)
    if base is None:
        return {}
    ref = base["throughput"]["samples_per_s"]
    return {s["name"]: s["throughput"]["samples_per_s"] / ref for s in _ok(doc)}


def markdown(doc: dict) -> str:
    suite, peak = doc["suite"], doc["peak"]
    ups = speedups(doc)
    lines = [
        f"# Benchmark `{suite['name']}`: {suite['about']}", "",
        f"- hardware: {suite['hardware']}, {suite['nodes']} x {suite['gpus_per_node']} (devices counted: "
        f"{suite['devices']}); {peak['device']}, measured {peak['dtype']} matmul peak {peak['matmul_flops'] / 1e12:.3f} "
        f"TFLOP/s, copy bandwidth " + (f"{peak['memory_bytes_per_s'] / 1e9:.1f} GB/s" if peak.get("memory_bytes_per_s")
                                       else "not recorded"),
        f"- model {suite['model']}, reward model {suite['reward_model']}, {suite['precision']}; per step "
        f"{suite['prompts_per_step']} prompts x ({suite['prompt_tokens']} prompt + {suite['response_tokens']} "
        f"response tokens, {lengths_text(suite.get('lengths'))}), optimizer batch {suite['train_batch']}, 1 PPO epoch",
        f"- {suite['warmup_steps']} warm-up step(s) dropped, medians over {suite['steps']} measured steps; "
        f"hpcrlhf {doc['hpcrlhf']}, {doc['started']}", "",
        "| system | samples/s | samples/device/s | tokens/s | step s | " + " | ".join(f"{p} s" for p in PHASES)
        + f" | gen share | MFU | vs {baseline(doc)} |",
        "|" + " --- |" * (8 + len(PHASES)),
    ]
    for s in doc["systems"]:
        if s["status"] != "ok":
            lines.append(f"| {s['name']} | {s['status']}: {s.get('error', '').splitlines()[0][:80]} |"
                         + " |" * (6 + len(PHASES)))
            continue
        t = s["throughput"]
        mfu = "n/a" if t["mfu"] is None else f"{100 * t['mfu']:.2f} %"
        up = f"{ups[s['name']]:.2f}x" if s["name"] in ups else "n/a"
        lines.append(f"| {s['name']} | {t['samples_per_s']:.2f} | {t['samples_per_device_s']:.3f} | "
                     f"{t['tokens_per_s']:.0f} | {t['step_s']:.2f} | "
                     + " | ".join(f"{t['phases_s'][p]:.2f}" for p in PHASES)
                     + f" | {100 * t['generation_share']:.0f} % | {mfu} | {up} |")
    lines += utilisation_lines(doc) + staleness_lines(doc)
    lines += ["", "Systems:", ""] + [f"- `{s['name']}`: {s['about']}" for s in doc["systems"]]
    return "\n".join(lines) + "\n"


def lengths_text(lengths: dict | None) -> str:
    if lengths is None or lengths["kind"] == "fixed":
        return "fixed"
    return (f"at most; each prompt's responses of a log-normal length: median {lengths['median_frac']:g} of the "
            f"most, sigma {lengths['sigma']:g}, the same for every system")


def staleness_lines(doc: dict) -> list[str]:
    """A table of each asynchronous system's sample age and partial share, where measured."""
    rows = [s for s in _ok(doc) if s["throughput"].get("staleness") is not None]
    if not rows:
        return []
    lines = ["", "Samples generated ahead (medians over the measured steps): their mean age in updates, the share "
             "paused across a weight sync and continued, the seconds generation overlapped training, and the "
             "samples under way in the engine loop's mean step:", "",
             "| system | staleness | partial share | overlap s | engine rows |", "|" + " --- |" * 5]
    for s in rows:
        t = s["throughput"]
        partial = "n/a" if t.get("partial_share") is None else f"{100 * t['partial_share']:.0f} %"
        overlap = "n/a" if t.get("overlap_s") is None else f"{t['overlap_s']:.2f}"
        engine = "n/a" if t.get("engine_rows") is None else f"{t['engine_rows']:.1f}"
        lines.append(f"| {s['name']} | {t['staleness']:.2f} | {partial} | {overlap} | {engine} |")
    return lines


def utilisation_lines(doc: dict) -> list[str]:
    """A table of each system's median idle share per role and weight-sync size, where measured."""
    rows = [s for s in _ok(doc) if s["throughput"].get("idle")]
    if not rows:
        return []
    roles = sorted({role for s in rows for role in s["throughput"]["idle"]})
    lines = ["", "Idle share of a step per role (median; 1 - the role's busy seconds / step seconds), weight-sync size "
             "and seconds of generation overlapped with training (rollout.max_staleness 1):",
             "", "| system | " + " | ".join(f"{r} idle" for r in roles) + " | weight sync MB | overlap s |",
             "|" + " --- |" * (len(roles) + 3)]
    for s in rows:
        t = s["throughput"]
        cells = [f"{100 * t['idle'][r]:.0f} %" if r in t["idle"] else "" for r in roles]
        size = "n/a" if t.get("sync_bytes") is None else f"{t['sync_bytes'] / 1e6:.1f}"
        overlap = "n/a" if t.get("overlap_s") is None else f"{t['overlap_s']:.2f}"
        lines.append(f"| {s['name']} | " + " | ".join(cells) + f" | {size} | {overlap} |")
    return lines


def plot(doc: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = _ok(doc)
    if not ok:
        return []
    names = [s["name"] for s in ok]
    paths = []

    fig, ax = plt.subplots(figsize=(1.6 * len(ok) + 2.5, 3.4))
    ax.bar(names, [s["throughput"]["samples_per_s"] for s in ok], color="tab:blue")
    for i, s in enumerate(ok):
        ax.annotate(f"{s['throughput']['samples_per_s']:.2f}", (i, s["throughput"]["samples_per_s"]), ha="center",
                    va="bottom", fontsize=8)
    ax.set_ylabel("PPO samples / s")
    ax.set_title(f"{doc['suite']['name']}: throughput (same hardware, same run)")
    ax.tick_params(axis="x", labelrotation=20)
    paths.append(_save(fig, out / "samples_per_s.png"))

    fig, ax = plt.subplots(figsize=(1.6 * len(ok) + 3.5, 3.6))
    bottom = [0.0] * len(ok)
    for phase in PHASES:
        values = [s["throughput"]["phases_s"][phase] for s in ok]
        ax.bar(names, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("seconds per PPO step (median)")
    ax.set_title(f"{doc['suite']['name']}: where a step's time goes")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", labelrotation=20)
    paths.append(_save(fig, out / "phases.png"))

    measured = [s for s in ok if s["throughput"].get("idle")]
    if measured:
        paths.append(idle_plot(doc, measured, out / "idle.png"))

    points = sorted((s["scaling"][1], s["throughput"]["samples_per_s"]) for s in ok if s.get("scaling"))
    if len(points) >= 2:
        axis = next(s["scaling"][0] for s in ok if s.get("scaling"))
        fig, ax = plt.subplots(figsize=(4.5, 3.4))
        ax.plot(*zip(*points), marker="o")
        ax.set_xlabel(axis)
        ax.set_ylabel("PPO samples / s")
        ax.set_title(f"{doc['suite']['name']}: scaling ({axis})")
        ax.grid(alpha=0.3)
        paths.append(_save(fig, out / "scaling.png"))
    return paths


def idle_plot(doc: dict, systems: list[dict], path: Path) -> Path:
    """Each system's idle share per role (grouped bars), with the seconds of generation overlapped
    with training written over the systems that overlap (rollout.max_staleness 1)."""
    import matplotlib.pyplot as plt

    roles = sorted({role for s in systems for role in s["throughput"]["idle"]})
    width = 0.8 / len(roles)
    fig, ax = plt.subplots(figsize=(1.6 * len(systems) + 3.5, 3.6))
    for j, role in enumerate(roles):
        xs = [i + (j - (len(roles) - 1) / 2) * width for i in range(len(systems))]
        ax.bar(xs, [100 * s["throughput"]["idle"].get(role, 0.0) for s in systems], width, label=f"{role} idle")
    for i, s in enumerate(systems):
        if s["throughput"].get("overlap_s"):
            ax.annotate(f"{s['throughput']['overlap_s']:.2f} s overlapped", (i, 100), ha="center", va="bottom",
                        fontsize=8)
    ax.set_xticks(range(len(systems)), [s["name"] for s in systems])
    ax.set_ylim(0, 112)
    ax.set_ylabel("% of a step the role waited (median)")
    ax.set_title(f"{doc['suite']['name']}: idle share per role")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", labelrotation=20)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_report(doc: dict, out: Path) -> None:
    """results.json, results.md and the plots into `out`."""
    doc[f"speedup_vs_{baseline(doc).replace('-', '_')}"] = speedups(doc)
    doc["plots"] = [p.name for p in plot(doc, out)]
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "results.md").write_text(markdown(doc))
