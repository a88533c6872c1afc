"""A job as data (hpcrlhf.config.jobspec): one conversion to and from its command line, the same one
the `hpcrlhf` command parses (its `train` and `bench` arguments are built from the same functions)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcrlhf.cli import build_parser
from hpcrlhf.config.jobspec import BenchJob, TrainJob, build_config, job_from_argv, resolve_recipe
from hpcrlhf.config.schema import JOB_CONFIGS
from hpcrlhf.errors import ConfigError

text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=30)
path = text.filter(str.strip)  # a path option refuses an empty (or blank) value


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(sorted(JOB_CONFIGS)), recipe=st.none() | path, overrides=st.lists(text, max_size=4),
       output_dir=st.none() | path)
def test_a_train_job_survives_its_command_line_and_the_cli_reads_it_alike(kind, recipe, overrides, output_dir):
    job = TrainJob(kind, recipe, tuple(overrides), output_dir)
    argv = job.argv()
    assert TrainJob.from_argv(argv) == job == job_from_argv(argv)
    assert TrainJob.from_args(build_parser().parse_args(argv)) == job  # what `hpcrlhf train` would run


@settings(max_examples=200, deadline=None)
@given(suite=text, output=st.none() | path, model=st.none() | path, systems=st.none() | text,
       steps=st.none() | st.integers(-5, 10**6))
def test_a_bench_job_survives_its_command_line(suite, output, model, systems, steps):
    job = BenchJob(suite, output, model, model, systems, steps)
    assert BenchJob.from_argv(job.argv()) == job == job_from_argv(job.argv())
    parsed = build_parser().parse_args(job.argv())
    assert (parsed.suite, parsed.output, parsed.model, parsed.steps) == (suite, output, model, steps)


def test_a_cluster_benchmark_takes_only_the_bench_options_as_settings():
    job = BenchJob.from_settings("cpu-tiny", ["model=/m", "steps=3", "systems=a,b"], "/out")
    assert job == BenchJob("cpu-tiny", "/out", "/m", None, "a,b", 3)
    assert job.argv() == ["bench", "--suite", "cpu-tiny", "--output", "/out", "--model", "/m", "--systems", "a,b",
                          "--steps", "3"]
    with pytest.raises(ConfigError, match=r"--set optim.lr=1: a bench job takes --set KEY=VALUE with KEY one of "
                                          r"model, reward_model, systems, steps"):
        BenchJob.from_settings("cpu-tiny", ["optim.lr=1"], "/out")
    with pytest.raises(ConfigError, match=r"--set steps=many: steps is a whole number"):
        BenchJob.from_settings("cpu-tiny", ["steps=many"], "/out")


@pytest.mark.parametrize("argv, message", [
    (["sbatch", "x"], "cluster jobs run `hpcrlhf train ...`, not `hpcrlhf sbatch x`"),
    (["train", "nope"], "not a valid `hpcrlhf train` command line (argument kind: invalid choice: 'nope'"),
    (["train", "sft", "--bogus"], "not a valid `hpcrlhf train` command line (unrecognized arguments: --bogus)"),
    (["bench", "--output", "x"], "a bench job names its suite (--suite NAME)"),
])
def test_a_command_line_that_is_not_a_job_is_refused_naming_it(argv, message):
    with pytest.raises(ConfigError) as e:
        job_from_argv(argv)
    assert message in str(e.value)


def test_a_job_builds_the_config_train_would(tmp_path):
    job = TrainJob("ppo", "ppo-tiny-ray", ("optim.lr=1e-3",), str(tmp_path / "run"))
    cfg = job.config()
    assert cfg == build_config("ppo", resolve_recipe("ppo-tiny-ray"), ["optim.lr=1e-3"], str(tmp_path / "run"))
    assert cfg.optim.lr == 1e-3 and cfg.output_dir == str(tmp_path / "run") and cfg.placement.nodes == 2
    with pytest.raises(ConfigError, match="--config: 'no-such' is neither a file nor a shipped recipe; shipped "
                                          "recipes: .*ppo-7b"):
        resolve_recipe("no-such")


@pytest.mark.parametrize("folder", ["2024-01-01", '"x"', "'x'", "runs/a #1", "null", "~", "1e5", "1:30", "[a]", "x: y"])
def test_a_run_folder_argument_is_a_path_taken_literally(folder):
    """`-o '"x"'` wrote into `x/`, `-o 2024-01-01` asked to quote it: -o was read as YAML (issue 36)."""
    assert TrainJob.from_argv(["train", "sft", "-o", folder]).config().output_dir == folder
    assert TrainJob.from_args(build_parser().parse_args(["train", "sft", "-o", folder])).config().output_dir == folder


@pytest.mark.parametrize("argv", [["train", "sft", "-o", ""], ["train", "sft", "--output-dir", " "],
                                  ["train", "sft", "--config", ""], ["bench", "--suite", "cpu", "--output", ""],
                                  ["bench", "--suite", "cpu", "--model", ""]])
def test_an_empty_path_option_is_refused_not_read_as_the_default(argv, capsys):
    """`-o "$OUT"` with OUT unset trained into the default folder."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert "is an empty path (an unset shell variable?): give the file or folder" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="is an empty path"):
        job_from_argv(argv)
