"""The README's first command: `hpcrlhf demo` runs SFT -> RM -> PPO and reports each stage."""

from __future__ import annotations

import re

import pytest

from tests.launch_helpers import run_cli


@pytest.mark.slow
def test_demo_runs_the_whole_pipeline_and_ppo_improves_on_sft(tmp_path):
    out = tmp_path / "demo"
    proc = run_cli(["demo", "-o", str(out)], timeout=900)
    scores = dict(re.findall(r"^\s+(after SFT|after PPO)\s+([0-9.]+)", proc.stdout, flags=re.M))
    assert set(scores) == {"after SFT", "after PPO"}, proc.stdout
    assert float(scores["after PPO"]) > float(scores["after SFT"]) > 0.3
    for name in ("sft", "rm", "ppo"):
        assert (out / f"{name}_curves.png").stat().st_size > 0 and (out / name / "model" / "config.json").exists()
