"""Ctrl-C (SIGINT) asks for the same graceful stop as Slurm's signals: the step ends, a checkpoint is
written, the run exits 3 and the same command resumes. A second Ctrl-C stops at once (exit 130),
without a traceback. (It used to end in a KeyboardInterrupt traceback and no checkpoint.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from dataclasses import dataclass

import pytest

from hpcrlhf.run.signals import EXIT_INTERRUPTED, EXIT_REQUEUE, STOP_SIGNALS, StopFlag, release_interrupt
from tests.launch_helpers import ROOT, cli_command, cli_env, run_cli


@pytest.fixture
def handlers():
    """Ctrl-C as in a terminal's foreground job for the test (this process's and the CLI runs it
    starts), then this process's handlers back. A test run started in the background of a script
    (`pytest &`, no job control) has SIGINT ignored, and every process it starts inherits that:
    those runs rightly ignore Ctrl-C (test_an_ignored_sigint_stays_ignored)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, *STOP_SIGNALS)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_first_ctrl_c_requests_a_stop_and_the_second_interrupts(handlers, capfd):
    flag = StopFlag().install()
    os.kill(os.getpid(), signal.SIGINT)
    assert flag.requested and flag.signal == signal.SIGINT
    assert "Ctrl-C: stopping after this step with a checkpoint" in capfd.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    release_interrupt()  # the command is over: teardown is not interrupted by a traceback
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL


def test_an_ignored_sigint_stays_ignored(handlers):
    """A background job (`cmd &` in a script) starts with SIGINT ignored; the terminal's Ctrl-C is not for it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    flag = StopFlag().install()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and not flag.requested
    assert signal.getsignal(signal.SIGTERM) == flag._handle


# The tests below press Ctrl-C once the first step starts (the line after the evaluation before
# training is out): steps of 512 samples take ~1 s here, the window for a second press. (A press
# during a generation, such as that evaluation's, stops it at once: the last test.)
ARGS = ["--set", "train.global_batch_size=512", "--set", "train.micro_batch_size=512", "--set", "task.eval_size=16",
        "--set", "eval.score_prompts=16", "--set", "eval.every_steps=0", "--set", "log.backends=[]",
        "--set", "train.max_steps=4"]


def interrupt(out, presses: int) -> tuple[int, str]:
    """`hpcrlhf train sft` with Ctrl-C pressed `presses` times once it has started (each press after the
    previous one was acknowledged): (exit status, output)."""
    proc = subprocess.Popen(cli_command(["train", "sft", "-o", str(out), *ARGS]), cwd=ROOT, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, pressed = [], 0
    try:
        for line in proc.stdout:
            lines.append(line)
            if ("before training:" in line or "Ctrl-C: stopping" in line) and pressed < presses:
                proc.send_signal(signal.SIGINT)
                pressed += 1
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "".join(lines)


def test_cli_ctrl_c_checkpoints_exits_3_and_the_rerun_resumes(handlers, tmp_path):
    out = tmp_path / "run"
    status, log = interrupt(out, 1)
    assert status == EXIT_REQUEUE and "Traceback" not in log, log[-3000:]
    assert "Ctrl-C: stopping after this step with a checkpoint (exit 3" in log
    assert "stop requested: checkpointed at step 1" in log, log[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000001"
    again = run_cli(["train", "sft", "-o", str(out), *ARGS], timeout=300)
    assert "step_000001 at step 1" in again.stdout + again.stderr
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000004"


def test_cli_second_ctrl_c_stops_at_once_without_a_traceback(handlers, tmp_path):
    out = tmp_path / "run"
    status, log = interrupt(out, 2)
    assert status == EXIT_INTERRUPTED and "Traceback" not in log, log[-3000:]
    assert "hpcrlhf: interrupted (Ctrl-C); stopped at once, without a new checkpoint" in log, log[-3000:]
    assert "stop requested" not in log and not (out / "checkpoints" / "latest").exists()


def test_a_blocked_stop_signal_is_unblocked_by_install(handlers):
    """Seen in CI: SIGINT left blocked in the main thread by an earlier in-process user; the flag must
    still see Ctrl-C (and children must not inherit the block)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        flag = StopFlag().install()
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.requested and flag.signal == signal.SIGTERM
    finally:
        release_interrupt()
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def test_leaves_sigusr1_ignored_on_purpose():
    """(With the next test:) the suite's guard (tests/conftest.py signals_left_usable) undoes a signal
    a test left ignored, so no later test or CLI run inherits it."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def test_the_signal_left_ignored_was_restored_before_this_test():
    assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_IGN


def test_a_stop_signal_during_a_long_generation_drops_the_step_at_once(tmp_path):
    """A time-limit signal must not wait out a generation (issue 36): SIGUSR1 while step 2 generates
    440-token responses ends the generation at the next decode step; the step is dropped, the run
    keeps its checkpoint of step 1 and exits 3. (It used to finish the step first.)"""
    import time

    from hpcrlhf.run.metrics import read_metrics

    out = tmp_path / "run"
    proc = subprocess.Popen(cli_command(["train", "ppo", "-o", str(out), "--set", "train.max_steps=3",
                                         "--set", "rollout.prompts_per_step=8", "--set", "rollout.max_new_tokens=440",
                                         "--set", "rollout.min_new_tokens=440", "--set", "ppo.advantage_estimator=grpo",
                                         "--set", "checkpoint.every_steps=1",
                                         "--set", "eval.score_prompts=4", "--set", "task.eval_size=4", "--set",
                                         "log.every_steps=1", "--set", "log.backends=[]"]),
                            cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not any(m["step"] == 1 for m in read_metrics(out)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # past step 1's checkpoint: step 2 generates (~6 s of its ~9 s here)
        proc.send_signal(signal.SIGUSR1)
        signalled = time.monotonic()
        log = proc.communicate(timeout=120)[0]
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_REQUEUE and "Traceback" not in log, log[-3000:]
    assert took < 30, took  # the step, uninterrupted, would have gone on
    assert "stop requested during step 2, which is dropped: checkpointed at step 1" in log, log[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert max(m["step"] for m in read_metrics(out)) == 1, f"{took:.1f} s"


# A local run with a vLLM engine (issue 36): Ctrl-C and SIGTERM go to the whole process group -- a terminal,
# `kill -TERM -PGID`, Slurm's preemption -- so they reach the engine's processes too. Those leave the group
# (hpcrlhf.engines.vllm_plugin); the trainer checkpoints, closes the engine and exits 3 (it used to end in
# EngineDeadError, exit 1, without a checkpoint). A driver killed outright (kill -9) takes its engine along.
VLLM = ["--set", "rollout.backend=vllm", "--set", "rollout.vllm_kv_cache_gb=0.25", "--set", "rollout.prompts_per_step=8",
        "--set", "train.global_batch_size=16", "--set", "train.micro_batch_size=8", "--set", "eval.score_prompts=16",
        "--set", "eval.every_steps=0", "--set", "log.backends=[]", "--set", "log.every_steps=1",
        "--set", "train.max_steps=40"]


@dataclass
class Ended:
    status: int
    log: str
    left: list[int]
    """The run's processes still alive 10 s after its driver ended."""
    shared: dict[str, int]
    """The /dev/shm files the run's processes had mapped when it was signalled."""


def signal_after_a_step(out, sig: int, group: bool = True) -> Ended:
    """`hpcrlhf train ppo` with a vLLM engine, in a process group of its own, given `sig` (to the whole
    group, else to the driver alone) once a step (after any already in the folder) is logged."""
    import time
    import uuid

    from hpcrlhf.cluster.reaper import alive, family, shm_mapped
    from hpcrlhf.run.metrics import read_metrics

    done = len(read_metrics(out)) if (out / "metrics.jsonl").exists() else 0
    tag = f"HPCRLHF_TEST_RUN={uuid.uuid4().hex}"  # inherited by every process the run starts
    proc = subprocess.Popen(cli_command(["train", "ppo", "-o", str(out), *VLLM]), cwd=ROOT,
                            env=cli_env(**dict([tag.split("=")])), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not ((out / "metrics.jsonl").exists() and len(read_metrics(out)) > done + 1):  # eval row + a step
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        run = family(tag)  # the driver, its children (the engine's processes), theirs
        shared = shm_mapped(alive(run))
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        log = proc.communicate(timeout=180)[0]  # the step, a checkpoint, the engine closed: ~20 s
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while alive(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    return Ended(proc.returncode, log, alive(run), shared)


@pytest.mark.slow
def test_a_group_signal_to_a_vllm_run_checkpoints_exits_3_and_leaves_no_engine(handlers, tmp_path):
    out = tmp_path / "run"
    for sig in (signal.SIGTERM, signal.SIGINT):  # the second launch resumes the first
        ended = signal_after_a_step(out, sig)
        assert ended.status == EXIT_REQUEUE, ended.log[-4000:]
        assert "EngineDeadError" not in ended.log and "Traceback" not in ended.log, ended.log[-4000:]
        # the signal may come while the step generates: then that step is dropped (issue 36, item 5)
        assert re.search(r"stop requested(| during step \d+, which is dropped): checkpointed at step", ended.log), \
            ended.log[-3000:]
        assert not ended.left, f"processes of the run alive after it ended: {ended.left}"
    assert int((out / "checkpoints" / "latest").read_text().strip().split("_")[1]) >= 2
    killed = signal_after_a_step(out, signal.SIGKILL, group=False)  # the driver alone, killed outright
    assert killed.status == -signal.SIGKILL and killed.shared, killed.log[-3000:]  # the engine had shared memory
    assert not killed.left, f"processes of the killed run still alive 10 s later: {killed.left}"
    assert not [path for path in killed.shared if os.path.exists(path)], killed.shared
