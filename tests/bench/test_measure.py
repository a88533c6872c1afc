"""Benchmark maths against hand computation: phase medians, throughput, MFU, FLOP counts, the
step-time model and DeepSpeed-Chat's log format."""

import math

import pytest

from hpcrlhf.bench.dschat import parse_log
from hpcrlhf.bench.flops import Shape, causal_context, forward_flops, train_flops
from hpcrlhf.bench.measure import PHASES, phase_seconds, summarize
from hpcrlhf.bench.stepmodel import A800_80GB, Efficiency, SystemShape, Workload, fit, paper_predictions, predict
from hpcrlhf.errors import HpcrlhfError


def row(step, gen, reward, exp, train, sync):
    return {"step": step, "timing/step": step_s(gen, reward, exp, train, sync) + 0.1, "timing/generate": gen,
            "timing/reward": reward, "timing/make_experience": exp, "timing/train": train, "timing/weight_sync": sync,
            "timing/train_actor": train, "rollout/response_length": 16.0}


def step_s(*parts):
    return sum(parts)


def test_summary_drops_warmup_and_takes_medians():
    rows = [{"step": 0}, row(1, 9.0, 1, 1, 1, 1), row(2, 1.0, 0.5, 0.5, 2.0, 0.2), row(3, 3.0, 0.5, 0.5, 4.0, 0.2),
            row(4, 2.0, 0.5, 0.5, 3.0, 0.2)]
    t = summarize(rows, warmup=1, samples=32, prompt_tokens=16, devices=2, train_flops_per_step=6e9, peak_flops=1e9)
    assert t.steps == 3
    # steps: 4.3, 8.3, 6.3 -> median 6.3; phases: generate median 2, make_experience 1, train 3
    assert t.step_s == pytest.approx(6.3)
    assert t.phases_s == pytest.approx({"generate": 2.0, "make_experience": 1.0, "train": 3.0, "weight_sync": 0.2,
                                        "other": 0.1})
    assert t.samples_per_s == pytest.approx(32 / 6.3)
    assert t.samples_per_device_s == pytest.approx(32 / 6.3 / 2)
    assert t.tokens_per_s == pytest.approx(32 * 32 / 6.3)
    assert t.generated_tokens_per_s == pytest.approx(32 * 16 / 6.3)
    assert t.generation_share == pytest.approx(2 / 6.3)
    assert t.mfu == pytest.approx(6e9 / (3.0 * 2 * 1e9))


def test_idle_shares_and_sync_size_are_medians_where_measured(tmp_path):
    """util/<role>_idle and weight_sync/bytes: medians over the measured steps; a role (or the
    sync size) that some step lacks is not reported, and the report's table shows what is."""
    from hpcrlhf.bench.report import utilisation_lines

    rows = [{"step": 0}]
    for i, (actor, vllm, sync) in enumerate([(0.9, 0.1, 5e6), (0.2, 0.6, 4e6), (0.4, 0.5, 3e6), (0.3, 0.7, 2e6)], 1):
        rows.append({**row(i, 1, 0, 0, 1, 0), "util/actor_idle": actor, "util/vllm_idle": vllm, "weight_sync/bytes": sync,
                     "timing/overlap": 0.1 * i, "timing/generate_ahead_wait": 0.5})
    rows[2]["util/ref_idle"] = 0.5  # one step only: not reported
    t = summarize(rows, warmup=1, samples=8, prompt_tokens=4, devices=1, train_flops_per_step=1, peak_flops=1)
    assert t.idle == pytest.approx({"actor": 0.3, "vllm": 0.6}) and t.sync_bytes == pytest.approx(3e6)
    assert t.overlap_s == pytest.approx(0.3)  # steps 2-4: 0.2, 0.3, 0.4
    assert t.phases_s["generate"] == pytest.approx(1.5)  # the step's own wait and the wait for the next one
    plain = summarize([{"step": 0}, row(1, 1, 0, 0, 1, 0), row(2, 1, 0, 0, 1, 0)], warmup=1, samples=1, prompt_tokens=1,
                      devices=1, train_flops_per_step=1, peak_flops=1)
    assert plain.idle == {} and plain.sync_bytes is None and plain.overlap_s is None
    doc = {"systems": [{"name": "a", "status": "ok", "throughput": t.to_dict()},
                       {"name": "b", "status": "ok", "throughput": plain.to_dict()}]}
    assert utilisation_lines(doc)[-1] == "| a | 30 % | 60 % | 3.0 | 0.30 |"
    from hpcrlhf.bench.report import plot

    doc["suite"] = {"name": "t"}
    drawn = {p.name for p in plot(doc, tmp_path)}
    assert "idle.png" in drawn and (tmp_path / "idle.png").read_bytes()[:4] == b"\x89PNG"
    assert utilisation_lines({"systems": doc["systems"][1:]}) == []


def test_too_few_steps_is_a_clear_error():
    with pytest.raises(HpcrlhfError, match="1 timed step.*warm-up"):
        summarize([{"step": 0}, row(1, 1, 1, 1, 1, 1)], warmup=1, samples=1, prompt_tokens=1, devices=1,
                  train_flops_per_step=1, peak_flops=1)


def test_other_is_never_negative():
    r = row(1, 1, 0, 0, 1, 0)
    r["timing/step"] = 1.5  # overlapping phases can sum past the step
    assert phase_seconds(r)["other"] == 0.0


def test_flops_count_the_real_model_matmuls(tiny_llama):
    """Matmul parameters from the config = the weights of every nn.Linear of the built model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    shape = Shape.from_config(config)
    assert shape.matmul_params(lm_head=True) == linear
    # by hand: 2 layers x (q,o 2x128x128 + k,v 2x128x64 + mlp 3x128x256) + head 128x512
    assert linear == 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256) + 128 * 512
    ctx = causal_context(16, 16)
    assert ctx == 16.5
    assert forward_flops(shape, 10, ctx) == 10 * (2 * linear + 4 * 2 * 16.5 * 128)
    assert train_flops(shape, 10, ctx, recompute=True) == 4 * forward_flops(shape, 10, ctx)
    # a step's updates: PPO trains actor (with head) + critic (no head); TRL's GRPO the actor alone
    from hpcrlhf.bench.runner import step_train_flops
    from hpcrlhf.bench.suites import get_suite

    suite = get_suite("cpu-tiny")
    tokens, step_ctx = 32 * (16 + 16), causal_context(16, 16)
    lm_head, value_head = 6 * tokens * 128 * 512, 6 * tokens * 128  # 6 x a head's matmul params per token
    assert step_train_flops(suite, critic=False) == train_flops(shape, tokens, step_ctx, lm_head=True)
    assert step_train_flops(suite) == 2 * step_train_flops(suite, critic=False) - lm_head + value_head


def test_step_model_by_hand_and_fit_inverts_predict():
    hw = A800_80GB
    w = Workload(params=1e9, critic_params=1e9, prompt=100, response=200, samples=64, kv_bytes_per_token=1000.0)
    lay = SystemShape("distributed", 8, actor=2, critic=2, ref=1, reward=1, engines=2, tp=1)
    eff = Efficiency()
    p = predict(w, lay, hw, eff)
    rows = 32
    decode = max((2e9 + rows * 1000.0 * 200) / (hw.hbm_bytes_per_s * eff.decode_bw),
                 2e9 * rows / (hw.peak_flops * eff.forward_mfu))
    prefill = 2e9 * rows * 100 / (hw.peak_flops * eff.forward_mfu)
    assert p["generate"] == pytest.approx(200 * decode + prefill)
    tokens = 64 * 300
    assert p["train"] == pytest.approx(8 * 1e9 * tokens / (2 * hw.peak_flops * eff.train_mfu))
    assert p["step"] == pytest.approx(sum(p[k] for k in PHASES))
    measured = {"generate": 2 * p["generate"], "train": 3 * p["train"], "make_experience": 0.5 * p["make_experience"]}
    fitted = fit(w, lay, hw, measured)
    again = predict(w, lay, hw, fitted)
    for phase, seconds in measured.items():
        assert again[phase] == pytest.approx(seconds, rel=1e-6)


def test_paper_predictions_reproduce_the_fitted_7b_and_check_13b():
    r = paper_predictions()
    assert 0 < r["efficiency"]["train_mfu"] < 1 and 0 < r["efficiency"]["gather_bw"] < 1
    for shape in r["shapes"].values():
        assert set(shape["phases_s"]) == {"distributed", "colocated", "dschat-style"}
        assert all(math.isfinite(v) and v > 0 for v in shape["speedup_vs_dschat_style"].values())
    assert all(abs(c["error"]) < 1 for c in r["check_13b"].values())


DSCHAT_LOG = """\
[2026-11-01 10:00:00] Epoch: 0 | Step: 0 | PPO Epoch: 1 | Actor Loss: 0.1 | Critic Loss: 0.2 | Unsupervised Loss: 0.0
End-to-End => Latency: 12.50s, TFLOPs: 10.00, Samples/sec: 10.24, Time/seq 0.10s, Batch Size: 128, Total Seq. Length: 512
Generation => Latency: 9.00s, Per-token Latency 35.16 ms, TFLOPs: 2.00, BW: 400.00 GB/sec, Answer Seq. Length: 256
Training   => Latency: 3.50s, TFLOPs: 30.00
Actor Model Parameters => 6.738 B, Critic Model Parameters => 6.607 B
Average reward score: 0.1 | EMA reward score: 0.1
End-to-End => Latency: 10.00s, TFLOPs: 12.00, Samples/sec: 12.80, Time/seq 0.08s, Batch Size: 128, Total Seq. Length: 512
Generation => Latency: 7.00s, Per-token Latency 27.34 ms, TFLOPs: 2.50, BW: -1.00 GB/sec, Answer Seq. Length: 256
Training   => Latency: 3.00s, TFLOPs: 35.00
End-to-End => Latency: 11.00s, TFLOPs: 12.00, Samples/sec: 11.64, Time/seq 0.09s, Batch Size: 128, Total Seq. Length: 512
"""


def test_dschat_log_parsed_into_steps():
    rows = parse_log(DSCHAT_LOG)
    assert len(rows) == 2  # the third step's lines are incomplete
    assert rows[1]["timing/step"] == 10.0 and rows[1]["timing/generate"] == 7.0 and rows[1]["timing/train"] == 3.0
    assert rows[0]["dschat/batch_size"] == 128 and rows[0]["rollout/response_length"] == 256
    t = summarize([{"step": 0}, *rows], warmup=1, samples=128, prompt_tokens=256, devices=8,
                  train_flops_per_step=1.0, peak_flops=1.0)
    assert t.samples_per_s == pytest.approx(12.8) and t.phases_s["make_experience"] == 0.0


@pytest.mark.parametrize("recorded, odd", [("gpu-1-h100", "skipped"), ("gpu-1-h100-vllm", "failed")])
def test_results_table_rows_have_the_header_s_cells(recorded, odd):
    """The recorded gpu-1 results (one system skipped; one failed, with no copy bandwidth
    recorded): every row of the table, the separator and the odd one included, has as many cells
    as the header."""
    import json
    from pathlib import Path

    from hpcrlhf.bench.report import markdown

    doc = json.loads((Path(__file__).parents[2] / f"benchmarks/results/{recorded}/results.json").read_text())
    assert any(s["status"] == odd for s in doc["systems"])
    table = [line for line in markdown(doc).splitlines() if line.startswith("| system | samples/s")
             or line.startswith("| ---") or any(line.startswith(f"| {s['name']} |") for s in doc["systems"])]
    assert len(table) == 2 + len(doc["systems"])
    assert {line.count("|") for line in table} == {table[0].count("|")}, table


def test_the_overlapped_schedule_hides_generation_behind_training_only_on_separate_engines():
    """rollout.max_staleness 1 in the model: the distributed layout's step is max(generate,
    make_experience + train) + weight_sync; layouts whose engines share the training devices gain nothing."""
    r = paper_predictions()
    for shape in r["shapes"].values():
        d = shape["phases_s"]["distributed"]
        assert d["step_overlapped"] == pytest.approx(
            max(d["generate"], d["make_experience"] + d["train"]) + d["weight_sync"])
        assert d["step_overlapped"] < d["step"]
        for name in ("colocated", "dschat-style"):
            assert shape["phases_s"][name]["step_overlapped"] == shape["phases_s"][name]["step"]


def test_a_run_counts_as_finished_only_when_its_summary_says_every_step_was_done(tmp_path):
    """A job that crashes at process exit after its last step (seen once: a C++ thread torn down
    under a torchrun rank) keeps its figures; one that stopped early or never wrote a summary does not."""
    import json

    from hpcrlhf.bench.runner import finished_run

    assert not finished_run(tmp_path, 5)
    for summary, done in (({"status": "done", "step": 5}, True), ({"status": "done", "step": 4}, False),
                          ({"status": "stopped", "step": 5}, False)):
        (tmp_path / "summary.json").write_text(json.dumps(summary))
        assert finished_run(tmp_path, 5) is done
    (tmp_path / "summary.json").write_text("{broken")
    assert not finished_run(tmp_path, 5)
