"""The long-tail suites (issue 40): every system generates the same per-prompt response lengths, drawn once
from the suite's stated distribution into the prompts file (`rollout.length_key`), and compares with the
synchronous run; the lengths reach the engine (tests/engines) and bad rows are refused before a step."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from hpcrlhf.bench.report import markdown, speedups
from hpcrlhf.bench.runner import check_systems, write_prompts
from hpcrlhf.bench.schedule import LengthDist
from hpcrlhf.bench.suites import LENGTH_KEY, get_suite, longtail_systems
from hpcrlhf.config.jobspec import build_config
from hpcrlhf.data.prompts import Prompt, response_lengths
from hpcrlhf.errors import DataError
from hpcrlhf.run.metrics import read_metrics
from tests.budget import long_only
from tests.launch_helpers import run_cli


def test_every_system_of_a_longtail_suite_gets_the_same_seeded_lengths(tmp_path):
    suite = get_suite("cpu-longtail-tiny")
    first, second = write_prompts(suite, tmp_path / "a.jsonl"), write_prompts(suite, tmp_path / "b.jsonl")
    assert first.read_text() == second.read_text()  # seeded: the same file for every system and every run
    rows = [json.loads(line) for line in first.read_text().splitlines()]
    lengths = [r[LENGTH_KEY] for r in rows]
    assert len(rows) == suite.prompts_per_step * (suite.warmup_steps + suite.steps)
    assert all(1 <= n <= suite.response_tokens for n in lengths)
    # the stated shape (LengthDist, drawn by hand here): median max/8, sigma 1 -> a tail far above the median
    assert lengths == LengthDist().draw(suite.response_tokens, len(rows), random.Random(0))
    assert max(lengths) >= 4 * statistics.median(lengths)
    check_systems(suite, suite.systems, first)  # every system's config is valid as the harness builds it
    configs = {s.name: build_config("ppo", s.recipe, suite.overrides_for(s, str(first)), None) for s in suite.systems}
    assert {(c.rollout.length_key, c.rollout.max_new_tokens, c.rollout.min_new_tokens,
             c.rollout.prompts_per_step * c.rollout.samples_per_prompt) for c in configs.values()} == \
        {(LENGTH_KEY, suite.response_tokens, 0, suite.prompts_per_step)}
    assert {(c.rollout.max_staleness, c.rollout.partial) for c in configs.values()} == {(0, False), (2, True)}
    # k steps ahead launch nothing in their last k steps: those run after the measured ones, dropped
    assert {c.train.max_steps for c in configs.values()} == {suite.warmup_steps + suite.steps + k for k in (0, 2)}
    for name in ("cpu-longtail", "cpu-longtail-emulated", "gpu-1-longtail", "gpu-1-longtail-1k"):  # the recorded ones
        check_systems(get_suite(name), get_suite(name).systems, first)
    emulated = get_suite("cpu-longtail-emulated")  # every system's engine steps the same floor, the synchronous one's too
    assert {build_config("ppo", s.recipe, emulated.overrides_for(s, str(first)), None).rollout.min_engine_step_s
            for s in emulated.systems} == {0.02}


def test_the_suites_that_run_a_few_long_tail_systems_pick_them_by_name():
    assert [s.name for s in get_suite("gpu-1-longtail").systems] == ["sync", "k2-partial", "k2-arrival-partial"]
    assert [s.name for s in get_suite("cpu-longtail-tiny").systems] == ["sync", "k2-partial", "k2-arrival-partial",
                                                                        "k2-arrival-keep"]
    assert len(get_suite("cpu-longtail").systems) == 6
    with pytest.raises(ValueError, match="no system \\['k3'\\]"):
        longtail_systems(1, names=("sync", "k3"))


def test_a_longtail_report_compares_with_the_synchronous_run():
    run = {"steps": 2, "samples_per_s": 4.0, "samples_per_device_s": 4.0, "tokens_per_s": 100.0, "step_s": 8.0,
           "phases_s": dict.fromkeys(("generate", "make_experience", "train", "weight_sync", "other"), 1.0),
           "generation_share": 0.5, "mfu": None, "staleness": None, "partial_share": None, "overlap_s": None}
    doc = {"suite": {"name": "cpu-longtail-tiny", "about": "x", "hardware": "cpu", "nodes": 1, "gpus_per_node": 1,
                     "devices": 1, "model": "m", "reward_model": "m", "prompt_tokens": 16, "response_tokens": 64,
                     "prompts_per_step": 32, "train_batch": 16, "warmup_steps": 1, "steps": 2, "precision": "bf16",
                     "lengths": {"kind": "lognormal", "median_frac": 0.125, "sigma": 1.0}},
           "peak": {"device": "cpu", "dtype": "bf16", "matmul_flops": 1e9}, "hpcrlhf": "0", "started": "now",
           "systems": [{"name": "sync", "status": "ok", "about": "a", "throughput": run},
                       {"name": "k2-partial", "status": "ok", "about": "b",
                        "throughput": {**run, "samples_per_s": 6.0, "staleness": 1.5, "partial_share": 0.25,
                                       "overlap_s": 2.0}}]}
    assert speedups(doc) == {"sync": 1.0, "k2-partial": 1.5}
    table = markdown(doc)
    assert "| vs sync |" in table and "| 1.50x |" in table and "| k2-partial | 1.50 | 25 % | 2.00 | n/a |" in table
    assert "log-normal length: median 0.125 of the most, sigma 1" in table


def test_a_row_without_a_usable_length_is_refused_naming_it():
    prompts = [Prompt((1, 2), "a", {"prompt": "a", "length": 5}, "p.jsonl:1"),
               Prompt((1, 3), "b", {"prompt": "b", "length": 70}, "p.jsonl:2")]
    assert response_lengths(prompts[:1], "length", 64) == (5,)
    with pytest.raises(DataError, match=r"p.jsonl:2: field 'length' \(rollout.length_key\) is 70; give each row a "
                                        r"whole number of response tokens from 1 to rollout.max_new_tokens \(64\)"):
        response_lengths(prompts, "length", 64)
    for bad in (None, "7", 2.5, True, 0):
        with pytest.raises(DataError, match="p.jsonl:1"):
            response_lengths([Prompt((1,), "a", {"length": bad}, "p.jsonl:1")], "length", 64)


@pytest.mark.slow
@long_only(160, "the pieces: the lengths in the engines (tests/engines/test_streaming.py, test_loop.py), the "
                "suites' configs above, the engine loop learning with partial rollouts (tests/trainers/ppo)")
def test_the_longtail_harness_runs_every_system_on_the_same_lengths(tmp_path):
    """`hpcrlhf bench --suite cpu-longtail-tiny` end to end: every response has its prompt's length in every
    system, the asynchronous one's samples are as old as planned, and the report compares with sync."""
    out = tmp_path / "lt"
    run_cli(["bench", "--suite", "cpu-longtail-tiny", "--output", str(out)], timeout=900)
    doc = json.loads((out / "results.json").read_text())
    suite = get_suite("cpu-longtail-tiny")
    assert [s["name"] for s in doc["systems"]] == [s.name for s in suite.systems]
    assert all(s["status"] == "ok" for s in doc["systems"]), [s.get("error") for s in doc["systems"]]
    rows = {s["name"]: [r for r in read_metrics(out / s["name"]) if "timing/step" in r] for s in doc["systems"]}
    lengths = [json.loads(line)[LENGTH_KEY] for line in (out / "prompts.jsonl").read_text().splitlines()]
    # the same lengths in both systems (each step trains its planned prompts): mean response length per step
    steps = suite.warmup_steps + suite.steps  # k2-partial runs 2 more (its tail, dropped from the figures)
    assert [r["rollout/response_length"] for r in rows["sync"]] == [r["rollout/response_length"]
                                                                    for r in rows["k2-partial"][:steps]]
    assert min(r["rollout/response_length"] for r in rows["sync"]) >= min(lengths)
    assert [r["rollout/staleness"] for r in rows["k2-partial"]] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert doc["speedup_vs_sync"]["sync"] == 1.0 and "| vs sync |" in (out / "results.md").read_text()
