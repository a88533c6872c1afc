"""Plots of runs' metrics: a panel per key some run logged, a line per run."""

from __future__ import annotations

import json
import struct

from hpcrlhf.plots import plot_runs


def png_size(path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_runs_are_drawn_side_by_side_and_keys_no_run_logged_are_skipped(tmp_path):
    for name, slope in (("a", 1.0), ("b", 2.0)):
        (tmp_path / name).mkdir()
        rows = [{"step": s, "x": slope * s} for s in range(1, 4)] + [{"step": 3, "y": slope}]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    two = plot_runs({"a": tmp_path / "a", "b": tmp_path / "b"}, ["x", "y", "never"], tmp_path / "two.png", title="t")
    one = plot_runs({"a": tmp_path / "a"}, ["x", "never"], tmp_path / "one.png")
    (w2, h2), (w1, h1) = png_size(two), png_size(one)
    assert h1 == h2 and w2 == 2 * w1  # "never" has no panel: two panels, then one
