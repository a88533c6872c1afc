"""`hpcrlhf bench`: the CPU suite's harness end to end (real jobs: Ray distributed, Ray colocated,
the DSChat-style baseline and TRL's GRPOTrainer under torchrun), and the errors users get before
anything runs.
No timing assertions: the figures must be consistent, not fast."""

import json
import math
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from hpcrlhf.bench.suites import SUITES, get_suite
from hpcrlhf.errors import ConfigError
from tests.launch_helpers import ROOT, cli_command, cli_env, run_cli


RUN = ("hpcrlhf-colocated-grpo", "dschat-style", "trl-grpo", "hpcrlhf-local")
"""The cpu-tiny systems the harness test runs: one of each kind of job (Ray with a vLLM engine, the
DSChat-style baseline, TRL under torchrun, hpcrlhf's ranks under torchrun). The other three are the
same kinds in another layout (tests/cluster runs those layouts); their designs are checked from the
configs the harness builds for them. All seven took 13 minutes of CI's time."""


@pytest.fixture(scope="module")
def cpu_tiny(tmp_path_factory):
    """The cpu-tiny suite run on the systems of RUN: (folder, finished process, results, the system
    names results.json listed each time it changed while the suite ran)."""
    out = tmp_path_factory.mktemp("bench") / "cpu-tiny"
    proc = subprocess.Popen(cli_command(["bench", "--suite", "cpu-tiny", "--systems", ",".join(RUN), "--output", str(out)]),
                            cwd=ROOT,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen, deadline = [], time.monotonic() + 900
    with ThreadPoolExecutor(1) as pool:  # drains the output meanwhile
        output = pool.submit(proc.communicate)
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                names = [s["name"] for s in json.loads((out / "results.json").read_text())["systems"]]
            except (OSError, ValueError):  # not written yet, or caught half-written
                names = None
            if names and (not seen or names != seen[-1]):
                seen.append(names)
            time.sleep(0.5)
        if proc.poll() is None:
            proc.kill()
        stdout, stderr = output.result()
    assert proc.returncode == 0, f"hpcrlhf bench exited {proc.returncode}\n{stdout[-4000:]}\n{stderr[-8000:]}"
    return out, subprocess.CompletedProcess(proc.args, 0, stdout, stderr), \
        json.loads((out / "results.json").read_text()), seen


def test_every_system_runs_and_reports_consistent_figures(cpu_tiny):
    out, proc, doc, seen = cpu_tiny
    suite = get_suite("cpu-tiny")
    names = list(RUN)
    assert [s["name"] for s in doc["systems"]] == names
    # results.json is rewritten after each system: a suite cut short keeps the systems it finished
    assert len(seen) > 1 and all(got == names[:len(got)] for got in seen) and seen[-1] == names, seen
    for s in doc["systems"]:
        assert s["status"] == "ok", s.get("error")
        t = s["throughput"]
        assert t["steps"] == suite.steps
        assert t["samples_per_step"] == suite.prompts_per_step
        assert t["samples_per_s"] == pytest.approx(suite.prompts_per_step / t["step_s"])
        assert t["tokens_per_s"] == pytest.approx(t["samples_per_s"] * (suite.prompt_tokens + suite.response_tokens))
        # MFU against the peak measured at the start: above 1 only when the host was busier then (noise)
        assert 0 < t["generation_share"] < 1 and 0 < t["mfu"] and math.isfinite(t["mfu"])
        assert sum(t["phases_s"].values()) == pytest.approx(t["step_s"], rel=0.5)  # medians of parts vs of sums
        assert all(v >= 0 and math.isfinite(v) for v in t["phases_s"].values())
        rows = [json.loads(line) for line in (out / s["name"] / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "timing/step" in r]
        assert len(steps) == suite.warmup_steps + suite.steps
        # the protocol's fixed lengths: every response has exactly response_tokens tokens, none ended early
        assert all(r["rollout/response_length"] == suite.response_tokens and r["rollout/finished"] == 0 for r in steps)
    assert doc["speedup_vs_dschat_style"]["dschat-style"] == 1.0
    assert doc["peak"]["matmul_flops"] > 1e8


def test_each_system_ran_as_designed(cpu_tiny):
    import yaml

    from hpcrlhf.config.jobspec import build_config
    from hpcrlhf.config.loader import to_dict

    out, _, doc, _ = cpu_tiny
    suite = get_suite("cpu-tiny")
    prompts = str(out / "prompts.jsonl")
    cfg = {s.name: to_dict(build_config("ppo", s.recipe, suite.overrides_for(s, prompts), None)) for s in suite.systems
           if s.kind != "trl"}  # every system as the harness builds it
    for s in doc["systems"]:  # and those that ran, as they ran
        if s["kind"] != "trl":
            ran = yaml.safe_load((out / s["name"] / "config.yaml").read_text())
            assert ran == {**cfg[s["name"]], "output_dir": ran["output_dir"]}, s["name"]
    base = cfg["dschat-style"]
    assert base["placement"]["runtime"] == "local" and base["rollout"]["backend"] == "hf"
    assert base["engine"]["zero_stage"] == 3 and base["rollout"]["hf_batch_size"] == 16
    assert "--nproc_per_node=2" in (out / "dschat-style" / "command.txt").read_text()
    for name in ("hpcrlhf-local", "hpcrlhf-local-grpo"):  # every role in each of the 2 ranks, HF generate
        assert cfg[name]["placement"]["runtime"] == "local" and cfg[name]["rollout"]["backend"] == "hf"
        assert cfg[name]["engine"]["zero_stage"] == 0
    assert "--nproc_per_node=2" in (out / "hpcrlhf-local" / "command.txt").read_text()
    placement = json.loads((out / "hpcrlhf-colocated-grpo" / "placement.json").read_text())
    assert placement  # the node map and the workers' read-back were recorded
    for name in ("hpcrlhf-distributed", "hpcrlhf-colocated"):
        assert cfg[name]["placement"]["runtime"] == "ray" and cfg[name]["rollout"]["backend"] == "vllm"
    trl = (out / "trl-grpo" / "command.txt").read_text()
    for expected in ("--nproc_per_node=2", "-m hpcrlhf.bench.trl_system", "--per-device-batch 16", "--prompts-per-step 32",
                     "--response-tokens 16", "--kl 0.1", "--steps 3", "--cpu"):
        assert expected in trl, (expected, trl)
    assert "trl 1." in next(s["about"] for s in doc["systems"] if s["kind"] == "trl")  # the version is recorded
    setup = json.loads((out / "trl-grpo" / "trl_setup.json").read_text())  # read back from TRL's trainer
    assert setup["world_size"] == 2 and setup["zero_stage"] == 0 and not setup["use_vllm"]
    # every system computes in DeepSpeed-Chat's CPU dtype (it accepts no fp32 there)
    assert {c["engine"]["precision"] for c in cfg.values()} == {"bf16"} and setup["dtype"] == "bfloat16"
    assert setup["generation_batch_size"] == 32 and setup["per_device_train_batch_size"] == 16 and setup["beta"] == 0.1
    # same work everywhere: as many responses of the same length per step, the same optimizer batch
    for key in ("rollout", "train"):
        for field in ("max_new_tokens", "min_new_tokens", "global_batch_size"):
            values = {c[key][field] for c in cfg.values() if field in c[key]}
            assert len(values) <= 1, (key, field, values)
    assert {c["rollout"]["prompts_per_step"] * c["rollout"]["samples_per_prompt"] for c in cfg.values()} == {32}
    # the GRPO rows are TRL's settings: group of 2, k3 KL in the loss at TRL's beta, no critic, token-mean
    for name in ("hpcrlhf-colocated-grpo", "hpcrlhf-local-grpo"):
        grpo = cfg[name]
        assert grpo["rollout"]["samples_per_prompt"] == setup["num_generations"] == 2
        assert (grpo["ppo"]["advantage_estimator"], grpo["ppo"]["kl_estimator"], grpo["ppo"]["loss_aggregation"]) == \
            ("grpo", "k3", "token-mean")
        assert grpo["ppo"]["kl_loss_coef"] == setup["beta"] and grpo["ppo"]["init_kl_coef"] == 0
    assert cfg["hpcrlhf-colocated-grpo"]["placement"]["critic"]["gpus_per_node"] == 0


def test_report_has_table_and_plots(cpu_tiny):
    out, proc, doc, _ = cpu_tiny
    table = (out / "results.md").read_text()
    for s in doc["systems"]:
        assert f"| {s['name']} |" in table
    assert set(doc["plots"]) >= {"samples_per_s.png", "phases.png"}
    for name in doc["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| dschat-style |" in proc.stdout  # the table is printed too


def test_suites_are_valid_and_bad_input_is_refused(tmp_path):
    from hpcrlhf.bench.runner import check_systems

    for suite in SUITES.values():
        if suite.model is None:  # the cluster suites: the published shape of the size they are named after
            suite = suite.with_model(f"meta-llama/Llama-2-{suite.name.split('-')[1]}-hf", None)
        check_systems(suite, suite.systems, tmp_path / "p.jsonl")  # every system's config and node map build
    with pytest.raises(ConfigError, match="--suite: unknown suite 'nope'"):
        get_suite("nope")
    with pytest.raises(ConfigError, match="--model"):
        get_suite("gpu-7b").with_model(None, None)
    with pytest.raises(ConfigError, match="--systems: suite cpu has no system 'trl'"):
        get_suite("cpu").system("trl")
    bad = replace(get_suite("cpu-tiny"), prompts_per_step=40)
    with pytest.raises(ConfigError, match="trl: prompts_per_step 40 must be a multiple of the train batch 16 x 2"):
        check_systems(bad, bad.systems, tmp_path / "p.jsonl")
    proc = run_cli(["bench", "--suite", "cpu-tiny", "--steps", "0", "-o", str(tmp_path / "x")], check=False)
    assert proc.returncode == 2 and "--steps" in proc.stderr and not (tmp_path / "x").exists()


def test_trl_system_under_zero3_and_its_cluster_command(tmp_path):
    """The GPU suites' TRL options: ZeRO-3 through TRL's Trainer really partitions the policy (run
    here on 2 CPU ranks), and on a multi-node allocation every rank starts under srun + MPI. A torch
    build lock left in the JIT folder by a killed process (what hung a local CI run) does not stop it:
    DeepSpeed's CPU shared-memory op is neither built nor loaded, as in hpcrlhf's own ranks."""
    import subprocess
    import sys
    from pathlib import Path

    from hpcrlhf.bench.runner import system_command, write_prompts
    from tests.launch_helpers import ROOT, cli_env

    suite = get_suite("cpu-tiny")
    prompts = write_prompts(suite, tmp_path / "prompts.jsonl")
    system = replace(suite.system("trl-grpo"), overrides=("--zero-stage=3",))
    cmd = system_command(replace(suite, steps=1), system, tmp_path / "run", prompts)
    extensions = tmp_path / "torch_extensions"
    (extensions / "deepspeed_shm_comm").mkdir(parents=True)
    (extensions / "deepspeed_shm_comm" / "lock").touch()  # a dead builder's: torch would wait for it forever
    proc = subprocess.run(cmd, cwd=ROOT, env=cli_env(TORCH_EXTENSIONS_DIR=str(extensions)), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    setup = json.loads((tmp_path / "run" / "trl_setup.json").read_text())
    assert setup["zero_stage"] == 3 and setup["zero3_partitioned"] and setup["world_size"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["rollout/response_length"] == 16 for r in rows)
    gpu = get_suite("gpu-70b").with_model("/m", "/r")
    text = " ".join(system_command(gpu, gpu.system("trl-grpo"), Path("/o"), Path("/p.jsonl"), python=sys.executable))
    assert text.startswith("srun --overlap --nodes=4 --ntasks-per-node=8 --mpi=pmix")
    assert "-m hpcrlhf.hpc.mpi -m hpcrlhf.bench.trl_system" in text
    for expected in ("--bf16", "--gradient-checkpointing", "--zero-stage=3", "--offload-optimizer", "--use-vllm"):
        assert expected in text


def test_sbatch_renders_a_bench_job(tmp_path):
    proc = run_cli(["sbatch", "--kind", "bench", "gpu-7b", "--set", "model=meta-llama/Llama-2-7b-hf", "--print",
                    "-o", str(tmp_path / "b")])
    assert "#SBATCH --nodes=2" in proc.stdout and "#SBATCH --gpus-per-node=8" in proc.stdout
    assert f"ray_slurm driver bench --suite gpu-7b --output {tmp_path / 'b'} --model meta-llama/Llama-2-7b-hf" in proc.stdout
    bad = run_cli(["sbatch", "--kind", "bench", "gpu-7b", "--set", "lr=1", "--print"], check=False)
    assert bad.returncode == 2 and "a bench job takes --set KEY=VALUE" in bad.stderr
    small = run_cli(["sbatch", "--kind", "bench", "gpu-7b", "--set", "model=meta-llama/Llama-2-7b-hf", "--nodes", "1",
                     "--print"], check=False)
    assert small.returncode == 2 and "--nodes 2" in small.stderr


def test_trl_is_skipped_and_said_so_when_not_installed(tmp_path):
    """Without trl the TRL system is reported as skipped (with the fix), the rest of the run goes on."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "trl.py").write_text("raise ImportError('trl hidden by the test')\n")
    out = tmp_path / "out"
    proc = run_cli(["bench", "--suite", "cpu-tiny", "--systems", "trl-grpo", "-o", str(out)],
                   env={"PYTHONPATH": str(hide)})
    (entry,) = json.loads((out / "results.json").read_text())["systems"]
    assert entry["status"] == "skipped" and "pip install trl" in entry["error"]
    assert "| trl-grpo | skipped: trl is not installed" in (out / "results.md").read_text()
    assert "trl-grpo: skipped" in proc.stderr + proc.stdout
