"""Where the libraries' own output goes (hpcrlhf.logs), through the real `hpcrlhf` command: the
terminal holds hpcrlhf's lines (and the libraries' errors), the run folder's third_party.log the
rest -- transformers' LOAD REPORT, DeepSpeed's accelerator warning, Python warnings; the setting
`log.third_party=console` and HPCRLHF_VERBOSE=1 show them on the terminal again. (The vLLM
engine's processes: tests/trainers/ppo/test_agent_e2e.py::test_the_agent_recipe_teaches_the_tiny_model_to_call_its_calculator[vllm].)"""

from __future__ import annotations

from pathlib import Path

from hpcrlhf.logs import THIRD_PARTY_LOG
from tests.launch_helpers import foreign_lines, run_cli

ONE_STEP = ["--set", "train.max_steps=1", "--set", "eval.every_steps=0", "--set", "log.backends=[]",
            "--set", "checkpoint.save_model=false", "--set", "checkpoint.at_end=false"]
QUICK_SFT = [*ONE_STEP, "--set", "train.global_batch_size=4", "--set", "train.micro_batch_size=4",
             "--set", "task.eval_size=8", "--set", "eval.score_prompts=2", "--set", "eval.max_new_tokens=2"]

NOISY_METRIC = '''\
import logging
import warnings


def loud(prompt, response, row):
    """A metric whose code logs the way a library does, on a library's logger, and warns."""
    library = logging.getLogger("transformers.probe")
    library.warning("probe: a library's warning")
    library.error("probe: a library's error")
    warnings.warn("probe: a Python warning")
    return 0.0
'''


def noisy(tmp_path: Path) -> dict[str, str]:
    """The environment of a run whose `noisy:loud` metric (on PYTHONPATH) logs like a library."""
    (tmp_path / "noisy.py").write_text(NOISY_METRIC)
    return {"PYTHONPATH": str(tmp_path)}


def test_rm_from_a_model_folder_writes_the_libraries_lines_to_the_run_log(tiny_llama, tmp_path):
    """A reward model started from a causal LM's folder: transformers' LOAD REPORT (the LM head
    unexpected, the score head missing) and DeepSpeed's accelerator warning on a CPU host used to
    be on the terminal (stderr and stdout)."""
    out = tmp_path / "run"
    proc = run_cli(["train", "rm", "-o", str(out), "--set", f"model.path={tiny_llama}", *ONE_STEP])
    assert foreign_lines(proc) == [], proc.stdout + proc.stderr
    log = (out / THIRD_PARTY_LOG).read_text()
    assert "LlamaForSequenceClassification LOAD REPORT from" in log and "score.weight" in log, log  # without colours
    assert "(real_accelerator.py:" in log and "Setting accelerator to CPU" in log, log


def test_libraries_errors_still_reach_the_terminal(tmp_path):
    """Their warnings go to the run log; their errors are on the terminal too, with where the rest is."""
    out = tmp_path / "run"
    proc = run_cli(["train", "sft", "-o", str(out), "--set", "eval.metrics=[noisy:loud]", *QUICK_SFT],
                   env=noisy(tmp_path))
    foreign = foreign_lines(proc)
    assert foreign and all(line.endswith("ERROR: probe: a library's error") for line in foreign), foreign
    assert f"hpcrlhf: the libraries' full output: {out / THIRD_PARTY_LOG}" in proc.stderr, proc.stderr
    assert proc.stderr.count("hpcrlhf: the libraries' full output") == 1  # said once
    log = (out / THIRD_PARTY_LOG).read_text()
    for line in ("WARNING transformers.probe (noisy.py:8): probe: a library's warning",
                 "ERROR transformers.probe (noisy.py:9): probe: a library's error",
                 "UserWarning: probe: a Python warning", "WARNING DeepSpeed (real_accelerator.py:"):
        assert line in log, (line, log)


def test_console_setting_shows_the_libraries_lines(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(["train", "sft", "-o", str(out), "--set", "eval.metrics=[noisy:loud]", "--set", "log.third_party=console",
                    *QUICK_SFT], env=noisy(tmp_path))
    terminal = proc.stdout + proc.stderr
    for line in ("probe: a library's warning", "UserWarning: probe: a Python warning", "real_accelerator"):
        assert line in terminal, (line, terminal)
    assert not (out / THIRD_PARTY_LOG).exists()


def test_commands_without_a_run_folder_show_the_libraries_lines_when_verbose(tiny_llama, tmp_path):
    """`generate` has no run folder: the libraries' lines below an error are left out, unless
    HPCRLHF_VERBOSE=1 (any value but 0/1 is refused, naming the variable)."""
    env = noisy(tmp_path)
    args = ["generate", "-m", tiny_llama, "-o", str(tmp_path / "out.jsonl"), "--set", "task.eval_size=2",
            "--set", "metrics=[noisy:loud]", "--set", "rollout.max_new_tokens=2"]
    quiet = run_cli(args, env=env)
    assert foreign_lines(quiet) and all("ERROR: probe: a library's error" in line for line in foreign_lines(quiet))
    assert "rerun with HPCRLHF_VERBOSE=1" in quiet.stderr, quiet.stderr
    verbose = run_cli(args, env={**env, "HPCRLHF_VERBOSE": "1"})
    assert "probe: a library's warning" in verbose.stderr and "UserWarning: probe: a Python warning" in verbose.stderr
    wrong = run_cli(args, env={**env, "HPCRLHF_VERBOSE": "yes please"}, check=False)
    assert wrong.returncode == 2 and wrong.stderr.startswith("hpcrlhf: error: HPCRLHF_VERBOSE='yes please'"), wrong.stderr


ROUTED = '''\
import logging, subprocess, sys
from pathlib import Path

from hpcrlhf.logs import route_third_party, third_party_processes, third_party_to

route_third_party(run_folder_follows=True)
logging.getLogger("transformers.early").warning("logged before the run folder was known")
third_party_to(sys.argv[1], Path(sys.argv[2]))
if sys.argv[3] == "processes":
    try:
        with third_party_processes("starting the engine"):
            child = "import sys, time; print('child: stdout'); print('child: stderr', file=sys.stderr); "
            subprocess.run([sys.executable, "-c", child])
            later = subprocess.Popen([sys.executable, "-c", child + "time.sleep(1); print('child: still there')"])
            raise RuntimeError("the engine died")
    except RuntimeError:
        later.wait()
        print("the block's error reached its caller")
'''


def routed(tmp_path: Path, *args: str):
    import subprocess
    import sys

    from tests.launch_helpers import ROOT, cli_env

    return subprocess.run([sys.executable, "-c", ROUTED, *args], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=120)


def test_lines_logged_before_the_run_folder_is_known_reach_its_log_or_the_terminal(tmp_path):
    log = tmp_path / THIRD_PARTY_LOG
    to_file = routed(tmp_path, "file", str(log), "-")
    assert to_file.returncode == 0 and to_file.stdout + to_file.stderr == "", to_file
    assert "WARNING transformers.early (<string>:7): logged before the run folder was known" in log.read_text()
    to_console = routed(tmp_path, "console", str(tmp_path / "unused.log"), "-")
    assert "logged before the run folder was known" in to_console.stderr and not (tmp_path / "unused.log").exists()


def test_processes_started_while_routed_print_into_the_run_log(tmp_path):
    """vLLM's engine processes print as they like (C++ messages, progress bars): whatever the
    processes started in `third_party_processes` write, for as long as they run, is in the run log;
    when the block fails, its last lines are shown with the error."""
    log = tmp_path / THIRD_PARTY_LOG
    proc = routed(tmp_path, "file", str(log), "processes")
    assert proc.returncode == 0 and proc.stdout == "the block's error reached its caller\n", proc
    assert f"starting the engine failed; the last lines of {log}:\n" in proc.stderr, proc.stderr
    assert "child: stderr" in proc.stderr.split("the last lines of")[1]
    written = log.read_text()
    for line in ("child: stdout", "child: stderr", "child: still there"):
        assert line in written, (line, written)


def test_a_call_of_the_cli_in_a_callers_process_leaves_its_logging_as_it_was(caplog):
    """A test or script calling `hpcrlhf.cli.main([...])` in its own process gets its logging back."""
    import logging

    from hpcrlhf.cli import main

    assert main(["config", "sft"]) == 0
    assert logging.getLoggerClass() is logging.Logger and logging._warnings_showwarning is None
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torch.probe").warning("a library's warning after the call")
    assert "a library's warning after the call" in caplog.text
