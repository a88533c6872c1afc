"""The watchdog (hpcrlhf.run.watchdog) with real threads, signals and processes: deadlines from a kind's
history, per-step totals, an expired wait raised in the main thread with whom it waited for and the
stacks written, a main thread no signal reaches ended with status 4 after the grace period, and py-spy
reading another process's stacks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from hpcrlhf.run.heartbeats import Heartbeats, node_name
from hpcrlhf.run.stacks import py_spy, signalled_stacks
from hpcrlhf.config.schema import WatchdogConfig
from hpcrlhf.run.watchdog import WaitExpired, Watchdog
from tests.launch_helpers import ROOT, cli_env


def test_deadline_is_factor_times_median_plus_floor_and_first_s_before_history():
    d = WatchdogConfig(factor=3.0, floor_s=10.0, first_s=600.0, history=3)
    assert d.deadline([]) == (600.0, "first_s 600 s: none finished before in this attempt")
    # the median of the last 3 (2, 9, 4) is 4: 3 x 4 + 10
    assert d.deadline([100.0, 2.0, 9.0, 4.0]) == (22.0, "3 x median 4.0 s of the last 3 + 10 s floor")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_per_step_kinds_sum_their_waits_in_a_step():
    clock = FakeClock()
    dog = Watchdog(WatchdogConfig(factor=2.0, floor_s=1.0), clock=clock)
    for took in (3.0, 4.0):  # two generations in step 1: 7 s in all
        with dog.phase("generate"):
            clock.now += took
    with dog.phase("checkpoint", per_step=False):
        clock.now += 5.0
    assert dog.history == {"checkpoint": [5.0]} and dog.spent == {"generate": 7.0}
    dog.step_done(1)
    assert dog.history == {"checkpoint": [5.0], "generate": [7.0]} and dog.step == 2
    with dog.phase("generate"):  # in step 2 the budget is 2 x 7 + 1 = 15 s for every generation together
        clock.now += 6.0
    with dog.phase("generate"):
        p = dog._phases[-1]
        assert dog._due(p)[0] == pytest.approx(clock.now - 6.0 + 15.0)


def test_an_expired_wait_raises_in_the_main_thread_naming_whom_it_waited_for(tmp_path):
    dog = Watchdog(WatchdogConfig(factor=2.0, floor_s=0.1, grace_s=60.0), folder=tmp_path).start()
    try:
        dog.history["generate"] = [0.2]  # deadline: 2 x 0.2 + 0.1 = 0.5 s
        dog.step = 7
        started = time.monotonic()
        with pytest.raises(WaitExpired) as e:
            with dog.phase("generate"):
                dog.waiting_for("vLLM engine 0")
                threading.Event().wait(30)  # a wait that never ends on its own
        waited = time.monotonic() - started
    finally:
        dog.stop()
    assert 0.5 <= waited < 5, waited
    message = str(e.value)
    assert message.startswith("step 7 hung: generate did not finish within 0.5 s (watchdog: 2 x median 0.2 s of the "
                              "last 1 + 0.1 s floor); still waiting for vLLM engine 0; stacks: "), message
    stacks = tmp_path.glob("hang-*-vLLM_engine_0.txt")
    text = next(stacks).read_text()
    assert "test_an_expired_wait_raises_in_the_main_thread_naming_whom_it_waited_for" in text, text
    assert "hpcrlhf-watchdog" in text or "_watch" in text  # every thread, the watchdog's own too


def test_a_watched_wait_polls_until_ready_or_its_timeout_and_ends_at_the_watchdogs_deadline(tmp_path):
    """`watched_wait`: the polls get at most poll_s (and no more than the time left); True once a poll says so,
    False at the timeout; under a watchdog it names its parties and its WaitExpired ends the wait."""
    from hpcrlhf.run.signals import watched_wait

    asked: list[float] = []

    def ready_at_third(seconds: float) -> bool:
        asked.append(seconds)
        return len(asked) == 3

    assert watched_wait(ready_at_third, lambda: ["nobody"], poll_s=0.01) and asked == [0.01] * 3
    asked.clear()
    started = time.monotonic()
    assert not watched_wait(lambda s: asked.append(s) or time.sleep(s) or False, lambda: [], timeout=0.25, poll_s=0.1)
    assert 0.25 <= time.monotonic() - started < 1.0 and asked[0] == 0.1 and all(0 <= s <= 0.1 for s in asked)
    dog = Watchdog(WatchdogConfig(first_s=0.3, grace_s=60.0), folder=tmp_path).start()
    try:
        with pytest.raises(WaitExpired) as e:
            with dog.phase("generate"):
                watched_wait(lambda s: time.sleep(s) or False, lambda: ["the far side"], poll_s=0.05)
    finally:
        dog.stop()
    assert "still waiting for the far side" in str(e.value)


def test_watched_until_asks_done_until_it_says_so_or_the_timeout_passes():
    """`watched_until` (a collective's `is_completed`, a future's `done`): True once `done()` -- asked every
    `every_s`, not busily --, False at the timeout."""
    from hpcrlhf.run.signals import watched_until

    ends = time.monotonic() + 0.2
    asked: list[float] = []
    assert watched_until(lambda: asked.append(time.monotonic()) or time.monotonic() >= ends, lambda: ["x"],
                         poll_s=0.05, every_s=0.02)
    assert time.monotonic() >= ends and 5 <= len(asked) <= 25, len(asked)  # (busily: thousands)
    started = time.monotonic()
    assert not watched_until(lambda: False, lambda: ["x"], timeout=0.15, poll_s=0.05)
    assert 0.15 <= time.monotonic() - started < 0.6


def test_a_wait_within_its_deadline_is_left_alone():
    dog = Watchdog(WatchdogConfig(factor=2.0, floor_s=0.5)).start()
    try:
        dog.history["step"] = [0.1]
        with dog.phase("step"):
            time.sleep(0.3)
        dog.check()  # nothing expired
    finally:
        dog.stop()
    assert not dog.expired


def test_after_an_expiry_the_checkpoint_and_the_teardown_are_not_interrupted_again():
    """They have until the grace exit: a second expiry would cut the checkpoint of the steps done short."""
    dog = Watchdog(WatchdogConfig(first_s=0.3, grace_s=60.0)).start()
    try:
        with pytest.raises(WaitExpired):
            with dog.phase("generate"):
                threading.Event().wait(30)
        with dog.phase("checkpoint", per_step=False):  # first_s 0.3 s would be its deadline too
            time.sleep(1.0)
            dog.check()
        assert dog.expired and dog._last.kind == "generate"
    finally:
        dog.stop()


def test_heartbeats_name_the_peers_gone_silent(tmp_path):
    clock = FakeClock()
    clock.now = 1000.0
    beats = [Heartbeats(tmp_path, rank, 3, period_s=5, silent_after_s=30, clock=clock) for rank in range(3)]
    beats[2].beat({"step": 7, "phases": []})  # a previous attempt's heartbeat
    clock.now = 1100.0
    beats[0]._started = beats[1]._started = clock.now  # this attempt's ranks 0 and 1 start (without threads)
    beats[1].beat({"step": 1, "phases": ["step"]})
    clock.now += 20
    here = f"{node_name()}, pid {os.getpid()}"
    assert beats[0].silent() == [f"rank 2 ({here}): no heartbeat in this attempt's 20 s"]
    clock.now += 20  # rank 1 last beat 40 s ago
    assert beats[0].silent() == [f"rank 1 ({here}): no heartbeat for 40 s", f"rank 2 ({here}): no heartbeat in this "
                                 "attempt's 40 s"]
    assert json.loads((tmp_path / "rank1.json").read_text())["phases"] == ["step"]


PEER = """
import sys, time
from pathlib import Path
from hpcrlhf.config.schema import WatchdogConfig
from hpcrlhf.run.heartbeats import Heartbeats, node_name
from hpcrlhf.run.watchdog import Watchdog
beats = Heartbeats(Path(sys.argv[1]), 1, 2, period_s=0.2, silent_after_s=1.0)
dog = Watchdog(WatchdogConfig(), heartbeats=beats).start()
print("beating", flush=True)
time.sleep(60)
"""


def test_a_rank_whose_collective_hangs_names_the_stopped_peer(tmp_path):
    """Rank 1 SIGSTOPped (its heartbeat thread too): rank 0's expired wait, which names no one itself (a
    collective), names rank 1 and how long it has been silent."""
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(tmp_path)], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                            text=True)
    try:
        assert peer.stdout.readline().strip() == "beating"
        beats = Heartbeats(tmp_path, 0, 2, period_s=0.2, silent_after_s=1.0)
        dog = Watchdog(WatchdogConfig(first_s=3.0, grace_s=60.0), heartbeats=beats).start()
        os.kill(peer.pid, signal.SIGSTOP)
        try:
            with pytest.raises(WaitExpired) as hung, dog.phase("step"):
                threading.Event().wait(30)
        finally:
            dog.stop()
        (party,) = hung.value.expiry.parties
        silent = re.fullmatch(rf"rank 1 \({re.escape(node_name())}, pid {peer.pid}\): no heartbeat for (\d+) s", party)
        assert silent and 1 <= int(silent[1]) <= 5, party  # stopped about when the wait began: its deadline, 3 s
        assert json.loads((tmp_path / "rank0.json").read_text())["pid"] == os.getpid()
    finally:
        peer.kill()
        peer.wait()


STUCK = """
import signal, time
from hpcrlhf.config.schema import WatchdogConfig
from hpcrlhf.run.watchdog import WATCHDOG_SIGNAL, Watchdog
dog = Watchdog(WatchdogConfig(first_s=0.3, grace_s=1.0)).start()
signal.pthread_sigmask(signal.SIG_BLOCK, {WATCHDOG_SIGNAL})  # as a thread stuck in C code: no handler runs
with dog.phase("weight_sync"):
    dog.waiting_for("actor rank 0")
    time.sleep(60)
print("never")
"""


def test_a_main_thread_no_signal_reaches_is_ended_with_4_after_the_grace_period():
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", STUCK], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert time.monotonic() - started < 30
    assert ("hpcrlhf: error: hung: weight_sync did not finish within 0.3 s (watchdog: first_s 0.3 s: none finished "
            "before in this attempt); still waiting for actor rank 0; the process did not end within "
            "watchdog.grace_s 1 s of it: ended with status 4 (requeued)") in proc.stderr, proc.stderr[-2000:]
    assert "never" not in proc.stdout


IN_A_COLLECTIVE = """
import signal, time
from hpcrlhf.config.schema import WatchdogConfig
from hpcrlhf.run.watchdog import WATCHDOG_SIGNAL, Watchdog
dog = Watchdog(WatchdogConfig(first_s=0.3, grace_s=120.0), answer_s=1.0).start()
signal.pthread_sigmask(signal.SIG_BLOCK, {WATCHDOG_SIGNAL})  # as a thread inside a gloo all-reduce: no handler runs
with dog.phase("step"):
    time.sleep(60)
print("never")
"""


def test_a_main_thread_that_cannot_take_the_interruption_ends_the_process_without_waiting_for_grace():
    """It could neither checkpoint nor clean up: waiting grace_s (120 s here) would only hold the allocation."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", IN_A_COLLECTIVE], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 4 and time.monotonic() - started < 20, proc.stderr[-2000:]
    assert ("hung: step did not finish within 0.3 s (watchdog: first_s 0.3 s: none finished before in this attempt); "
            "the main thread did not take the interruption within 1 s (stuck in a collective or other code no signal "
            "reaches: it can neither checkpoint nor clean up): ended with status 4 (requeued)") in proc.stderr, proc.stderr


HUNG_TEARDOWN = """
import time
from hpcrlhf.config.schema import WatchdogConfig
from hpcrlhf.run.watchdog import WaitExpired, Watchdog
dog = Watchdog(WatchdogConfig(first_s=0.3, grace_s=1.0)).start()
try:
    with dog.phase("generate"):
        dog.waiting_for("vLLM engine 0")
        time.sleep(60)
except WaitExpired:
    print("expired", flush=True)
    dog.stop(until_exit=True)  # the run ends (Run.finish) ...
    time.sleep(60)  # ... and its teardown hangs on the same stuck party (killing it, closing the engines)
print("never")
"""


def test_a_hung_runs_teardown_that_hangs_too_is_ended_with_4_after_the_grace_period():
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", HUNG_TEARDOWN], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 4 and proc.stdout.split() == ["expired"], proc.stderr[-2000:]
    assert time.monotonic() - started < 30
    assert "still waiting for vLLM engine 0; the process did not end within watchdog.grace_s 1 s of it" in proc.stderr


def test_a_watchdog_that_saw_no_expiry_stops_for_good():
    dog = Watchdog(WatchdogConfig(first_s=0.3, grace_s=0.1)).start()
    dog.stop(until_exit=True)
    assert dog._thread is not None and not dog._thread.is_alive() and not dog.expired


ARMED = """
import time
from hpcrlhf.run.stacks import dump_on_signal
print(dump_on_signal(), dump_on_signal(), flush=True)  # once per process: the same file
def waiting_here():
    time.sleep(60)
waiting_here()
"""


def test_an_armed_process_writes_its_stacks_on_the_signal_into_a_file_without_a_name():
    child = subprocess.Popen([sys.executable, "-c", ARMED], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, text=True)
    try:
        fd, again = map(int, child.stdout.readline().split())
        assert fd == again
        time.sleep(0.3)  # into waiting_here
        first, second = signalled_stacks(child.pid, fd), signalled_stacks(child.pid, fd)
        assert "waiting_here" in first and "(most recent call first)" in first, first
        assert second.count("waiting_here") == 1, second  # each answer holds only what was written for it
        target = os.readlink(f"/proc/{child.pid}/fd/{fd}")  # the file has no name left: nothing stays behind
        assert target.startswith(f"{tempfile.gettempdir()}/hpcrlhf-stacks-") and target.endswith(" (deleted)"), target
    finally:
        child.kill()
        child.wait()
    assert signalled_stacks(child.pid, fd) == f"(no stacks of process {child.pid}: it has ended)"


def test_py_spy_reads_the_stacks_of_another_process():
    child = subprocess.Popen([sys.executable, "-c", "import time\ndef waiting_here():\n    time.sleep(60)\nwaiting_here()"])
    try:
        time.sleep(1.0)
        text = py_spy(child.pid)
    finally:
        child.kill()
        child.wait()
    if text.startswith("(no stacks"):  # no ptrace rights here: the reason is said
        assert "py-spy" in text
    else:
        assert "waiting_here" in text, text
