"""`hpcrlhf eval` through the real CLI: three checkpoints of a run compared on sampled answers (mean@n,
pass@k, maj@n recomputed here from the answers it wrote), greedy evaluation of a checkpoint equal to the
run's own in-run evaluation, an interrupted evaluation resumed to the same results, a model folder of
another family on the user's own file and metric, and every mistake refused before a model loads."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import EvalJobConfig
from hpcrlhf.errors import ConfigError
from hpcrlhf.rewards.math_answers import last_number
from hpcrlhf.run.metrics import read_metrics
from tests.launch_helpers import cli_command, cli_env, run_cli
from tests.trainers.test_own_task import own_data, user_env

STEPS = ["--set", "train.max_steps=30", "--set", "train.global_batch_size=32", "--set", "train.micro_batch_size=16",
         "--set", "checkpoint.every_steps=10", "--set", "checkpoint.keep_last=3", "--set", "eval.every_steps=10",
         "--set", "eval.score_prompts=32", "--set", "task.eval_size=64", "--set", "log.backends=[]",
         "--set", "log.progress=false"]
SAMPLED = ["--set", "eval.samples_per_prompt=4", "--set", "eval.batch_size=8"]


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory, sft_model) -> Path:
    """An SFT run from the partly trained adder: checkpoints at steps 10, 20 and 30, evaluated in-run at each."""
    run = tmp_path_factory.mktemp("eval") / "run"
    run_cli(["train", "sft", "-o", str(run), "--set", f"model.path={sft_model}", *STEPS])
    return run


@pytest.fixture(scope="module")
def evaluated(three_checkpoints) -> tuple[Path, dict]:
    out = three_checkpoints.parent / "sampled"
    run_cli(["eval", "-r", str(three_checkpoints), "--checkpoints", "all", "-o", str(out), *SAMPLED])
    return out, json.loads((out / "results.json").read_text())


def assert_same_weights(made: Path, exported: Path) -> None:
    """The model folder `hpcrlhf eval` made from a checkpoint holds the weights of the run's own export."""
    from safetensors.torch import load_file

    a, b = load_file(made / "model.safetensors"), load_file(exported / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def answers(out: Path, target: str, dataset: str = "held_out") -> list[dict]:
    """Every prompt's record (responses, values) the evaluation wrote, in prompt order."""
    prompts = [p for f in sorted((out / "samples" / target).glob(f"{dataset}.rank*.jsonl"))
               for line in f.read_text().splitlines() for p in json.loads(line)["prompts"]]
    return sorted(prompts, key=lambda p: p["index"])


def test_eval_compares_three_checkpoints_in_json_table_and_plot(evaluated):
    out, results = evaluated
    names = [t["name"] for t in results["targets"]]
    assert names == ["step_000010", "step_000020", "step_000030"]
    assert [t["step"] for t in results["targets"]] == [10, 20, 30]
    assert results["datasets"] == [{"name": "held_out", "source": "the arithmetic task's held-out prompts", "prompts": 32}]
    for name in names:
        got = results["results"][name]["held_out"]
        prompts = answers(out, name)
        assert [p["index"] for p in prompts] == list(range(32)) and all(len(p["responses"]) == 4 for p in prompts)
        # the reference: from the 4 answers of each prompt and their 0/1 scores
        correct = [sum(v >= 1 for v in p["values"]["task_score"]) for p in prompts]
        mean = sum(sum(p["values"]["task_score"]) for p in prompts) / (4 * 32)
        pass4 = sum(c > 0 for c in correct) / 32  # n = k = 4: at least one of the 4 right
        assert got["eval/task_score"] == pytest.approx(mean, abs=1e-12)
        assert got["eval/task_score/pass@1"] == pytest.approx(mean, abs=1e-12)  # pass@1 = mean@n for 0/1 scores
        assert got["eval/task_score/pass@4"] == pytest.approx(pass4, abs=1e-12)
        majority = []
        for p in prompts:  # the value of the first sample holding the most common last number
            votes = [last_number(r) for r in p["responses"]]
            counted = [v for v in votes if v is not None]
            top = max(counted, key=counted.count) if counted else None
            majority.append(p["values"]["task_score"][votes.index(top)] if top is not None else 0.0)
        assert got["eval/task_score/maj@4"] == pytest.approx(sum(majority) / 32, abs=1e-12)
    table = (out / "results.md").read_text()
    assert "| model | step | task_score | task_score/pass@1 | task_score/pass@4 | task_score/maj@4 |" in table, table
    assert [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| step_")] == names
    assert (out / "results.png").stat().st_size > 10_000
    assert not (out / "models").exists() or not any((out / "models").iterdir())  # exported for the eval, then deleted
    # the run went on learning: its last checkpoint answers better than its first
    scores = [results["results"][n]["held_out"]["eval/task_score"] for n in names]
    assert scores[-1] > scores[0], scores


def test_greedy_eval_of_a_checkpoint_equals_the_runs_own_evaluation(three_checkpoints):
    """`-r RUN`: its latest checkpoint (and its model/), with the run's settings (greedy, its held-out prompts)."""
    out = three_checkpoints.parent / "greedy"
    run_cli(["eval", "-r", str(three_checkpoints), "--checkpoints", "latest,model", "-o", str(out),
             "--set", "keep_models=true"])
    results = json.loads((out / "results.json").read_text())
    assert [(t["name"], t["step"]) for t in results["targets"]] == [("step_000030", 30), ("model", 30)]
    assert results["sampling"]["greedy"]
    assert_same_weights(out / "models" / "step_000030", three_checkpoints / "model")  # the run ended at step 30
    in_run = next(m for m in read_metrics(three_checkpoints) if m["step"] == 30 and "eval/task_score" in m)
    assert results["results"]["step_000030"]["held_out"] == {"eval/task_score": in_run["eval/task_score"]}
    assert results["results"]["model"] == results["results"]["step_000030"]


def test_an_interrupted_eval_resumes_to_the_same_results(three_checkpoints, evaluated):
    out = three_checkpoints.parent / "interrupted"
    args = ["eval", "-r", str(three_checkpoints), "--checkpoints", "all", "-o", str(out), *SAMPLED]
    proc = subprocess.Popen(cli_command(args), env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = out / "samples" / "step_000020" / "held_out.rank0.jsonl"
    deadline = time.monotonic() + 300
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err[-3000:]
    assert "rerun the same command" in err and not (out / "results.json").exists()
    written = sum(len(f.read_text().splitlines()) for f in (out / "samples").glob("*/*.jsonl"))
    assert 5 <= written < 12  # 4 batches of 8 prompts per checkpoint: stopped in step 20's or step 30's
    run_cli(args)
    assert json.loads((out / "results.json").read_text())["results"] == evaluated[1]["results"]
    assert [p["responses"] for p in answers(out, "step_000020")] == [p["responses"] for p in answers(evaluated[0], "step_000020")]


STOPPER = """
import os, signal
from pathlib import Path

MARK = Path(__file__).with_name("stopped")
calls = []


def length(prompt, response, row):
    calls.append(1)
    if len(calls) == 33 and not MARK.exists():  # the second batch's first answer (8 prompts x 4 each a batch)
        MARK.touch()
        os.kill(os.getpid(), signal.SIGUSR1)
    return float(len(response))
"""


def test_a_stop_while_a_metric_runs_ends_with_3_and_the_rerun_goes_on(three_checkpoints, evaluated, tmp_path):
    """The stop signal comes while the user's metric scores the second batch (it raises StopRequested in the
    metric): that batch is not kept, the job exits 3, and the rerun answers the rest as an uninterrupted run."""
    (tmp_path / "stopper.py").write_text(STOPPER)
    out = tmp_path / "out"
    args = ["eval", "-r", str(three_checkpoints), "--checkpoints", "30", "-o", str(out), *SAMPLED,
            "--set", "eval.metrics=[stopper:length]"]
    proc = run_cli(args, env=user_env(tmp_path), check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert (tmp_path / "stopped").exists() and [p["index"] for p in answers(out, "step_000030")] == list(range(8))
    run_cli(args, env=user_env(tmp_path))
    got = answers(out, "step_000030")
    assert [p["responses"] for p in got] == [p["responses"] for p in answers(evaluated[0], "step_000030")]
    assert all(p["values"]["length"] == [float(len(r)) for r in p["responses"]] for p in got)
    results = json.loads((out / "results.json").read_text())["results"]["step_000030"]["held_out"]
    assert results["eval/task_score"] == evaluated[1]["results"]["step_000030"]["held_out"]["eval/task_score"]


def test_one_vllm_engine_takes_each_checkpoints_weights_in_turn(three_checkpoints, tmp_path):
    """rollout.backend=vllm: one engine for two checkpoints, the second one's weights loaded into it; its greedy
    answers equal those of an engine started on that checkpoint alone, and differ from the first one's."""
    vllm = ["--set", "rollout.backend=vllm", "--set", "rollout.vllm_kv_cache_gb=0.25", "--set", "eval.score_prompts=16"]
    both, alone = tmp_path / "both", tmp_path / "alone"
    run_cli(["eval", "-r", str(three_checkpoints), "--checkpoints", "10,30", "-o", str(both), *vllm])
    run_cli(["eval", "-r", str(three_checkpoints), "--checkpoints", "30", "-o", str(alone), *vllm])
    swapped = [p["responses"] for p in answers(both, "step_000030")]
    assert swapped == [p["responses"] for p in answers(alone, "step_000030")]
    assert swapped != [p["responses"] for p in answers(both, "step_000010")]


def test_eval_of_another_family_on_your_file_with_your_metric(tmp_path):
    """A tiny Qwen2 folder answers the user's rows (their own prompt field) twice each; the user's metric
    reported as mean@2, pass@1 and pass@2 equals the metric recomputed here on the answers written."""
    _, evals = own_data(tmp_path)
    rows = [json.loads(line) for line in evals.read_text().splitlines()]
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) + "\n"
                                                 for r in rows))
    from hpcrlhf.models.tiny import build_tiny_model_dir

    model = build_tiny_model_dir("qwen2")
    out = tmp_path / "out"
    run_cli(["eval", "-m", str(model), "-o", str(out), "--set", "eval.samples_per_prompt=2",
             "--set", "eval.max_new_tokens=4", "--set", "eval.pass_threshold=2",
             "--set", f"datasets=[{{path: {tmp_path / 'mine.jsonl'}, prompt_key: question, "
                      "metrics: ['usermetrics:length', 'usermetrics:exact']}]"],
            env=user_env(tmp_path))
    results = json.loads((out / "results.json").read_text())
    got = results["results"][model.name]["mine"]
    prompts = answers(out, model.name, "mine")
    assert [p["prompt"] for p in prompts] == [r["prompt"] for r in rows]
    lengths = [[float(len(r)) for r in p["responses"]] for p in prompts]
    assert [p["values"]["length"] for p in prompts] == lengths
    assert got["eval/length"] == pytest.approx(sum(map(sum, lengths)) / 6)
    assert got["eval/length/pass@2"] == pytest.approx(sum(any(x >= 2 for x in v) for v in lengths) / 3)
    assert got["eval/length/pass@1"] == pytest.approx(sum(sum(x >= 2 for x in v) / 2 for v in lengths) / 3)
    assert "eval/task_score" not in got and "eval/length/maj@2" not in got  # no task, no answer to vote on
    assert set(got) >= {"eval/exact", "eval/exact/pass@1", "eval/exact/pass@2"}


def test_a_batch_that_hangs_ends_the_eval_with_4_and_the_rerun_goes_on(three_checkpoints, tmp_path):
    """The eval job's watchdog: the third batch's generation never returns (tests/trainers/faults.py); past its
    deadline (2 x the median batch + 3 s) the job exits 4 naming it, the two batches answered are kept, and the
    same command then answers the rest."""
    import subprocess
    import sys

    from tests.launch_helpers import ROOT

    out = tmp_path / "hung"
    args = ["eval", "-r", str(three_checkpoints), "-o", str(out), "--set", "eval.batch_size=8",
            "--set", "watchdog.floor_s=3", "--set", "watchdog.factor=2", "--set", "watchdog.first_s=120",
            "--set", "watchdog.grace_s=30"]
    proc = subprocess.run([sys.executable, "-m", "tests.trainers.faults", "hang", "generate", "3", "--", *args],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 4, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("hpcrlhf: error: hung: batch did not finish within ") and "(watchdog: 2 x median " in error
    assert f"the answers written so far are kept in {out}/samples: rerun the same command" in error, error
    assert len(answers(out, "step_000030")) == 16 and list((out / "watchdog").glob("hang-*.txt"))
    run_cli(args)
    assert [p["index"] for p in answers(out, "step_000030")] == list(range(32))
    assert json.loads((out / "results.json").read_text())["results"]["step_000030"]["held_out"]["eval/task_score"] >= 0


def test_a_missing_checkpoint_is_named_before_anything_loads(three_checkpoints, tmp_path):
    proc = run_cli(["eval", "-r", str(three_checkpoints), "--checkpoints", "15,model", "-o", str(tmp_path / "x")],
                   check=False, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"hpcrlhf: error: checkpoints: 15,model: {three_checkpoints} has no checkpoint at step 15 (checkpoints at "
        "steps 10, 20, 30; model/)")
    assert not (tmp_path / "x").exists()


def test_a_rerun_with_other_sampling_is_refused_on_every_rank(evaluated, three_checkpoints):
    out, _ = evaluated
    other = ["eval", "-r", str(three_checkpoints), "--checkpoints", "all", "-o", str(out),
             "--set", "eval.samples_per_prompt=8", "--set", "eval.batch_size=8"]
    proc = run_cli(other, check=False, timeout=120)
    assert proc.returncode == 2
    assert "holds answers drawn with other settings (eval.samples_per_prompt: 4 -> 8)" in proc.stderr, proc.stderr[-2000:]
    proc = run_cli(other, nproc=2, check=False, timeout=180)  # rank 1 ends too, not left waiting for rank 0
    assert proc.returncode != 0
    assert proc.stderr.count("holds answers drawn with other settings (eval.samples_per_prompt: 4 -> 8)") == 2, \
        proc.stderr[-3000:]


def test_a_rerun_naming_the_run_by_a_relative_path_is_the_same_evaluation(evaluated, three_checkpoints, monkeypatch):
    from hpcrlhf.config.jobspec import EvalJob
    from hpcrlhf.evaluation import _check_rerun

    out, _ = evaluated
    monkeypatch.chdir(three_checkpoints.parent)  # as `hpcrlhf eval -r run` typed there, after sbatch's absolute one
    job = EvalJob.from_argv(["eval", "-r", three_checkpoints.name, "--checkpoints", "all", "-o", str(out), *SAMPLED])
    assert job.config().run == three_checkpoints.name
    _check_rerun(out, job.config())  # no refusal
    assert yaml.safe_load((out / "eval.yaml").read_text())["run"] == str(three_checkpoints)


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.temperature=0.7"], "rollout.temperature: 0.7 is invalid: hpcrlhf eval draws its answers as `eval` says: "
                                  "set eval.temperature instead"),
    (["eval.stop_when=eval/task_score>=0.5"], "eval.stop_when: 'eval/task_score>=0.5' is invalid: it is read during "
                                              "training only; drop it for hpcrlhf eval"),
    (["checkpoints=all"], "checkpoints: 'all' is invalid: checkpoints are a run's: name the run folder with --run"),
    (["run=r", "checkpoints=10,last"], "checkpoints: '10,last' is invalid: use latest, all, best, model or steps"),
    (["datasets=[{path: a.jsonl}, {path: b/a.jsonl}]"], "datasets[0].name: 'a' is invalid: two datasets have this name"),
    (["eval.samples_per_prompt=2", "eval.pass_k=[3]"], "eval.pass_k: [3] is invalid: each k must be 1..eval.samples_per_prompt"),
])
def test_settings_the_eval_job_cannot_honour_are_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(EvalJobConfig, overrides=overrides)
    assert message in str(e.value), str(e.value)


def test_run_settings_come_from_the_runs_config(three_checkpoints):
    from hpcrlhf.config.jobspec import run_settings

    settings, source = run_settings(str(three_checkpoints))
    run = yaml.safe_load((three_checkpoints / "config.yaml").read_text())
    assert source.endswith("config.yaml") and settings["model"] == run["model"] and settings["task"] == run["task"]
    assert settings["eval"]["score_prompts"] == 32 and "every_steps" not in settings["eval"]
    assert "response_key" not in settings["data"] and "max_samples" not in settings["data"]
    cfg = load_config(EvalJobConfig, overrides=["eval.samples_per_prompt=3"], base=(settings, source))
    assert cfg.model.path == run["model"]["path"] and cfg.eval.samples_per_prompt == 3 and cfg.eval.score_prompts == 32


def test_sbatch_writes_an_mpi_eval_job_that_reads_the_run_and_writes_beside_it(tmp_path):
    run = tmp_path / "runs" / "sft"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: {path: builtin:tiny-llama}\neval: {samples_per_prompt: 4, every_steps: 10}\n")
    script = run_cli(["sbatch", "--kind", "eval", "--set", f"run={run}", "--set", "checkpoints=all", "--nodes", "2",
                      "--print"]).stdout
    job = f"eval --set run={run} --set checkpoints=all --set 'run=\"{run}\"' --output-dir {run}/eval"
    assert f"-m hpcrlhf.hpc.allocation mpi {job} || exit 2" in script, script
    assert f"srun --mpi=pmix --kill-on-bad-exit=1 {sys.executable} -m hpcrlhf.hpc.mpi {job}" in script, script
    proc = run_cli(["sbatch", "--kind", "eval", "--set", f"run={run}", "--launcher", "ray", "--print"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("hpcrlhf: error: launcher ray: an eval job runs as ranks of its own; "
                                                    "use --launcher mpi (one rank per GPU)")


def test_a_runs_checkpoints_are_plotted_at_their_steps_other_models_in_order():
    from hpcrlhf.evaluation import x_axis

    checkpoints = [{"name": "step_000030", "step": 30}, {"name": "step_000010", "step": 10}]
    assert x_axis(checkpoints) == ([30.0, 10.0], "step")  # spaced as trained (plot_results sorts them)
    models = [{"name": "base", "step": None}, {"name": "step_000010", "step": 10}]
    assert x_axis(models) == ([0.0, 1.0], None)  # a model of no run: by position, named on the axis
    assert x_axis([{"name": "a", "step": 5}, {"name": "b", "step": 5}]) == ([0.0, 1.0], None)  # two runs' step 5
