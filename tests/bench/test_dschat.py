"""Real DeepSpeed-Chat step 3 as a bench system (`--dschat-dir`): the checks before anything runs,
its command on GPU and CPU suites, the prompts cut to what it keeps, its log parsed with the clock
stamps `dschat_rank` adds -- and, where a DeepSpeedExamples checkout is at HPCRLHF_DSCHAT_DIR, a real
run on this machine (CI has none: skipped, and said so)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from hpcrlhf.bench.dschat import STEP3, DSChat, fit_prompts, parse_log
from hpcrlhf.bench.suites import get_suite
from hpcrlhf.errors import ConfigError
from tests.launch_helpers import run_cli


def fake_checkout(root: Path) -> Path:
    (root / STEP3).mkdir(parents=True)
    (root / STEP3 / "main.py").write_text("")
    return root


def test_dschat_is_checked_before_anything_runs(tmp_path):
    gpu = get_suite("gpu-7b").with_model("/m", None)
    with pytest.raises(ConfigError, match="--dschat-dir: .* is not a DeepSpeedExamples checkout"):
        DSChat.from_args(str(tmp_path), critic=None, suite=gpu)
    checkout = fake_checkout(tmp_path / "dse")
    with pytest.raises(ConfigError, match="--dschat-critic: .* is not a DeepSpeed-Chat step-2 output"):
        DSChat.from_args(str(checkout), critic=str(tmp_path), suite=gpu)
    with pytest.raises(ConfigError, match="32 prompts per step is not a multiple of DSChat's 16 per device x 4 devices"):
        DSChat.from_args(str(checkout), critic=None, suite=replace(get_suite("cpu-tiny"), dschat_ranks=4))
    assert DSChat.from_args(str(checkout), critic=None, suite=get_suite("cpu")).critic is None  # made from the RM


def test_gpu_suites_run_it_as_its_scripts_and_cpu_suites_in_bf16_zero2(tmp_path):
    checkout = fake_checkout(tmp_path / "dse")
    gpu = get_suite("gpu-7b").with_model("/m", None)
    text = " ".join(DSChat.from_args(str(checkout), critic=None, suite=gpu).command(gpu, Path("a"), Path("c"), Path("o")))
    for expected in ("deepspeed --num_nodes=2 --num_gpus=8 --module hpcrlhf.bench.dschat_rank main.py",
                     "--per_device_generation_batch_size 16", "--per_device_training_batch_size 16",
                     "--generation_batches 4", "--max_answer_seq_len 1024", "--actor_zero_stage 3",
                     "--enable_hybrid_engine", "--offload_reference_model", "--test_stop_step 4",
                     "--data_path local/jsonfile", "--actor_model_name_or_path a", "--critic_model_name_or_path c"):
        assert expected in text, expected
    cpu = get_suite("cpu")
    text = " ".join(DSChat.from_args(str(checkout), critic=None, suite=cpu).command(cpu, Path("a"), Path("c"), Path("o")))
    for expected in ("-m torch.distributed.run --standalone --nproc_per_node=2 --module hpcrlhf.bench.dschat_rank",
                     "--dtype bf16", "--actor_zero_stage 2", "--critic_zero_stage 2", "--generation_batches 2",
                     "--max_prompt_seq_len 32", "--max_answer_seq_len 32", "--test_stop_step 5"):
        assert expected in text, expected
    assert "--enable_hybrid_engine" not in text and "--offload_reference_model" not in text


def test_prompts_are_cut_to_what_dschat_keeps():
    from hpcrlhf.models.loading import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-llama")
    texts = ["1 2 3 4 5 6 7 8 9 the a of and to is 9 8 7 6 5 4 3 2 1", "the 1", "a " * 40]
    cut = fit_prompts(tokenizer, texts, 12)
    for original, short in zip(texts, cut):
        assert original.split()[:len(short.split())] == short.split()  # the same words, the last ones dropped
        assert len(tokenizer(" " + short)["input_ids"]) <= 12
        longer = original.split()[:len(short.split()) + 1]
        assert longer == short.split() or len(tokenizer(" " + " ".join(longer))["input_ids"]) > 12  # as long as fits
    assert cut[1] == "the 1"


LOG = """noise
hpcrlhf-bench wall 100.0
End-to-End => Latency: 3.00s, TFLOPs: 1.00, Samples/sec: 10.67, Time/seq 0.09s, Batch Size: 32, Total Seq. Length: 64
Generation => Latency: 1.00s, Per-token Latency 31.25 ms, TFLOPs: 0.50, BW: 1.00 GB/sec, Answer Seq. Length: 32
Training   => Latency: 1.00s, TFLOPs: 2.00
hpcrlhf-bench wall 104.0
End-to-End => Latency: 2.50s, TFLOPs: 1.00, Samples/sec: 12.80, Time/seq 0.08s, Batch Size: 32, Total Seq. Length: 64
Generation => Latency: 0.75s, Per-token Latency 23.44 ms, TFLOPs: 0.50, BW: 1.00 GB/sec, Answer Seq. Length: 32
Training   => Latency: 1.00s, TFLOPs: 2.00
hpcrlhf-bench wall 107.5
End-to-End => Latency: 2.50s, TFLOPs: 1.00, Samples/sec: 12.80, Time/seq 0.08s, Batch Size: 32, Total Seq. Length: 64
"""


def test_the_log_gives_wall_clock_steps_and_the_experience_dschat_leaves_out():
    rows = parse_log(LOG, generation_batches=2)
    assert len(rows) == 2  # the third step's lines are incomplete
    first, second = rows
    assert first["timing/step"] == 3.0 and "timing/make_experience" not in first  # no stamp before it: DSChat's figure
    # step 2: 4.0 s between the stamps; generation 2 batches x 0.75 s, training 1.0 s: 1.5 s of experience making
    assert second["timing/step"] == pytest.approx(4.0) and second["dschat/e2e_s"] == 2.5
    assert second["timing/generate"] == 1.5 and second["timing/train"] == 1.0
    assert second["timing/make_experience"] == pytest.approx(1.5)
    assert second["rollout/response_length"] == 32 and second["dschat/batch_size"] == 32
    assert parse_log(LOG.replace("hpcrlhf-bench wall", "other"))[1]["timing/step"] == 2.5  # unstamped: DSChat's


def test_only_dschat_needs_its_checkout(tmp_path):
    bad = run_cli(["bench", "--suite", "cpu-tiny", "--systems", "dschat", "-o", str(tmp_path / "b")], check=False)
    assert bad.returncode == 2 and "--systems: dschat (real DeepSpeed-Chat) needs --dschat-dir" in bad.stderr


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("HPCRLHF_DSCHAT_DIR"),
                    reason="set HPCRLHF_DSCHAT_DIR to a DeepSpeedExamples checkout to run real DeepSpeed-Chat here")
def test_real_dschat_runs_on_this_machine_with_the_suites_prompts_and_lengths(tmp_path):
    out = tmp_path / "bench"
    run_cli(["bench", "--suite", "cpu-tiny", "--systems", "dschat", "--dschat-dir", os.environ["HPCRLHF_DSCHAT_DIR"],
             "-o", str(out)], timeout=1200)
    doc = json.loads((out / "results.json").read_text())
    (entry,) = doc["systems"]
    assert entry["name"] == "dschat" and entry["status"] == "ok", entry
    suite = get_suite("cpu-tiny")
    assert entry["throughput"]["steps"] == suite.steps and entry["throughput"]["samples_per_step"] == suite.prompts_per_step
    rows = parse_log((out / "dschat" / "job.log").read_text(), 1)
    assert len(rows) == suite.warmup_steps + suite.steps
    assert all(r["timing/step"] >= r["dschat/e2e_s"] - 0.02 and r["timing/make_experience"] > 0 for r in rows[1:])
    data = (out / "dschat" / "DeepSpeed-Chat" / "data" / "train.json").read_text().splitlines()
    assert len(data) == suite.prompts_per_step * (suite.warmup_steps + suite.steps)  # the suite's prompts, each once
    assert "filtered=0" in (out / "dschat" / "job.log").read_text()  # DSChat kept every prompt
