"""`hpcrlhf plan`: the node map of a recipe, as text or JSON; exit status 2 with every problem."""

from __future__ import annotations

import json

import pytest

from hpcrlhf.cli import main
from hpcrlhf.config.jobspec import build_config
from hpcrlhf.placement import render_text

from .helpers import RECIPES, plan


def test_plan_prints_the_node_map(capsys):
    assert main(["plan", "ppo-7b", "--nodes", "2", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert out == render_text(plan("ppo-7b", nodes=2, gpus=8))
    assert out.startswith("node map: 2 nodes x 8 GPUs = 16 GPUs of 80.0 GiB\nnode 0\n")
    assert "  gpu 4  vllm0 tp0/1  weights 12.6 + kv_cache 59.4 = 72.0 / 80.0 GiB" in out


def test_plan_json_parses(capsys):
    assert main(["plan", str(RECIPES / "ppo-70b.yaml"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["allocation"] == {"nodes": 4, "gpus_per_node": 8, "gpu_memory_bytes": 80 << 30, "cpus_per_node": None}
    assert len(data["vllm"]["engines"]) == 4


def test_plan_applies_set_overrides(capsys):
    # the fix suggested for the idle GPUs of 3 nodes (8 engines split the rollout's 1024 sequences)
    assert main(["plan", "ppo-7b", "--nodes", "3", "--set", "placement.vllm.engines=8", "-s",
                 "placement.allow_idle_gpus=true"]) == 0
    assert "  vllm    8 engines x TP 1 " in capsys.readouterr().out


def test_impossible_shape_exits_2_with_every_problem(capsys):
    assert main(["plan", "ppo-7b", "--nodes", "1", "--gpus-per-node", "4", "--set", "train.micro_batch_size=3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err
    assert err.startswith("hpcrlhf: error: the node map for 1 node x 4 GPUs cannot work (")
    assert "placement.actor.gpus_per_node = 4" not in err  # 4 GPUs per node fit
    assert "the roles ask for 16 GPUs" in err and "fix: " in err
    assert "train.global_batch_size = 128" in err


def test_unknown_recipe_exits_2(capsys):
    assert main(["plan", "ppo-1t"]) == 2
    assert "shipped recipes: " in capsys.readouterr().err


def test_plan_says_what_the_estimator_needs_from_its_record(capsys):
    from hpcrlhf.algos.estimators import ESTIMATORS

    expected = {  # written out here, not derived from the records
        "gae": "a critic, 4 samples per prompt, a per-token KL penalty",
        "grpo": "no critic, groups of 4 samples per prompt, the KL penalty folded into each response's score",
        "dr_grpo": "no critic, groups of 4 samples per prompt, the KL penalty folded into each response's score",
        "rloo": "no critic, groups of 4 samples per prompt, the KL penalty folded into each response's score",
        "reinforce++": "no critic, 4 samples per prompt, a per-token KL penalty",
        "reinforce_baseline": "no critic, groups of 4 samples per prompt, the KL penalty folded into each response's "
                              "score",
    }
    assert sorted(expected) == sorted(ESTIMATORS)
    for name, needs in expected.items():
        no_critic = [] if name == "gae" else ["--set", "placement.critic.nodes=0", "--set", "placement.critic.gpus_per_node=0"]
        assert main(["plan", "ppo-tiny-ray-colocated", "--set", f"ppo.advantage_estimator={name}", *no_critic]) == 0
        assert f"estimator: {name} -- {ESTIMATORS[name].summary}; {needs}\n" in capsys.readouterr().out
        assert main(["plan", "ppo-tiny-ray-colocated", "--json", "--set", f"ppo.advantage_estimator={name}",
                     *no_critic]) == 0
        record = json.loads(capsys.readouterr().out)["estimator"]
        assert record["name"] == name and record["needs_critic"] == (name == "gae") and record["samples_per_prompt"] == 4


def test_plan_schedule_with_fixed_lengths_is_the_step_time_model(capsys):
    """--schedule --lengths fixed on ppo-7b (the modelled 7B layout: 16 A800s, 4 engines of TP 1): the synchronous
    row is the step-time model's step of 1024 x (1024 + 1024) tokens with the efficiencies fitted on DSChat's
    published runs, one step ahead its overlapped step; the text shows the same rows."""
    from hpcrlhf.bench.schedule import plan_schedules, LengthDist, render_schedules
    from hpcrlhf.bench.stepmodel import (A800_80GB, LLAMA2_KV_BYTES, LLAMA2_PARAMS, PAPER_LAYOUTS, Efficiency, Workload,
                                         overlapped_step, paper_predictions, predict)

    assert main(["plan", "ppo-7b", "--schedule", "--lengths", "fixed", "--json"]) == 0
    rows = {(r["k"], r["partial"], r["order"]): r for r in json.loads(capsys.readouterr().out)["schedule"]["rows"]}
    w = Workload(LLAMA2_PARAMS["7b"], LLAMA2_PARAMS["7b"], 1024, 1024, 1024, LLAMA2_KV_BYTES["7b"])
    phases = predict(w, PAPER_LAYOUTS["7b"]["distributed"], A800_80GB, Efficiency(**paper_predictions()["efficiency"]))
    assert rows[0, False, "plan"]["step_s"] == pytest.approx(phases["step"], rel=2e-3)  # 6.738e9 counted vs 6.74e9
    assert rows[1, False, "plan"]["step_s"] == pytest.approx(overlapped_step(phases), rel=2e-3)
    assert rows[2, False, "arrival"]["step_s"] == pytest.approx(rows[2, False, "plan"]["step_s"], rel=1e-9)  # no tail
    assert main(["plan", "ppo-7b", "--schedule"]) == 0
    out = capsys.readouterr().out
    node_map = plan("ppo-7b")
    assert out == render_text(node_map) + "\n" + render_schedules(plan_schedules(
        build_config("ppo", "ppo-7b", [], None), node_map, A800_80GB, LengthDist()))
    assert "  synchronous " in out and out.count(" + partial ") == 3 and "  NeMo-RL one step off: " in out
    assert out.count(", arrival ") == 3 and "dropped" in out


def test_plan_schedule_says_why_a_layout_has_none(capsys):
    assert main(["plan", "ppo-tiny-ray-colocated", "--schedule"]) == 0
    assert "  none: the engines share the roles' GPUs: generation and training take turns" in capsys.readouterr().out
    assert main(["plan", "ppo-7b", "--schedule", "--set", "rollout.backend=hf", "--set", "placement.runtime=local",
                 "--set", "placement.vllm.engines=0", "--set", "placement.allow_idle_gpus=true"]) == 0
    assert "  none: rollout.backend is hf: the actor generates itself" in capsys.readouterr().out
    assert main(["plan", "ppo-7b", "--schedule", "--lengths", "pareto"]) == 2
    assert "--schedule: lengths 'pareto': use fixed, lognormal" in capsys.readouterr().err
