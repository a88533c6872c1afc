"""The `code` rule against hand-written programs: the share of the row's tests passed, for correct,
wrong, crashing and hostile programs (each scores 0, ends within its limits and leaves nothing
behind), runs at most `rules.workers` at once, and bad rows or settings name what to fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from hpcrlhf.config.schema import CodeRuleConfig, RulesConfig
from hpcrlhf.errors import ConfigError, RuleError
from hpcrlhf.rewards.builtin import build_builtin
from hpcrlhf.rewards.code_tests import program_in
from hpcrlhf.rewards.response import Response
from hpcrlhf.run.signals import STOP_SIGNALS, StopFlag, StopRequested
from tests.launch_helpers import ROOT
from tests.rewards.programs import PYTHON, TOKEN, processes_with_token, tagged

LABEL = "reward.sources[0].rule 'code'"
SETTINGS = dict(python=PYTHON, timeout_s=3.0, cpu_time_s=1, memory_mb=256, file_size_mb=2, processes=8)
ADD_IO = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"}]
"""stdin/stdout tests of a program that prints the sum of two numbers."""
ADD_ASSERTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\nIt reads the numbers and prints their sum."


def response(text: str, tests, origin: str = "code.jsonl:3") -> Response:
    return Response("Add two numbers.", text, (), {"tests": tests}, origin)


@pytest.fixture(scope="module")
def rule(tmp_path_factory):
    if not os.access(PYTHON, os.X_OK):
        pytest.skip(f"{PYTHON} is needed to run programs as nobody")
    return build_builtin("code", RulesConfig(code=CodeRuleConfig(**SETTINGS), workers=4), LABEL)


def test_the_score_is_the_share_of_tests_passed(rule):
    half = "a, b = map(int, input().split())\nprint(a + b if a < 5 else a - b)"  # right on the first test only
    scores = rule.scores([
        response(fenced("a, b = map(int, input().split())\nprint(a + b)"), ADD_IO),
        response(fenced("print(3)"), ADD_IO),  # wrong on the second
        response(fenced(half), ADD_IO),
        response(fenced("def add(a, b):\n    return a + b"), ADD_ASSERTS),
        response(fenced("def add(a, b):\n    return 3"), ADD_ASSERTS),  # an assert fails
        response(fenced("a, b = map(int, input().split())\nprint(a + b)"), {"input": ["2 2\n"], "output": ["4\n"]}),
    ])
    assert scores == [1.0, 0.5, 0.5, 1.0, 0.5, 1.0]


@pytest.mark.parametrize("text", [
    fenced("a, b = map(int, input().split())\nprint(a - b)"),              # wrong
    fenced("raise ValueError('no')"),                                      # crashes
    fenced("print(3"),                                                     # does not compile
    fenced("import sys\nprint(3)\nsys.exit(1)"),                           # right output, exit status 1
    "a, b = map(int, input().split())\nprint(a + b)",                      # no fenced block
    "```js\nconsole.log(3)\n```",                                          # a block in another language
])
def test_wrong_crashing_and_missing_programs_score_0(rule, text):
    assert rule.scores([response(text, ADD_IO[:1])]) == [0.0]


@pytest.mark.parametrize("program", [
    "import sys\nsys.exit(0)",                                             # exits before the tests run
    "import os\nos._exit(0)",
    "def add(a, b):\n    return a + b\nraise SystemExit('done early')",  # a right function, then an error
])
def test_an_assert_test_passes_only_when_program_and_test_run_to_their_end(rule, program):
    assert rule.scores([response(fenced(program), ADD_ASSERTS)]) == [0.0]


HOSTILE = {
    "infinite loop": tagged("while True: pass"),
    "sleeps forever": tagged("import time\ntime.sleep(3600)"),
    "fork bomb": tagged("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"),
    "memory hog": "x = bytearray(10 ** 10)\nprint(3)",
    "file writer": textwrap.dedent(f"""
        import os
        for path in ["/tmp/{TOKEN}", "/dev/shm/{TOKEN}", os.path.expanduser("~/{TOKEN}"), "{ROOT}/.{TOKEN}/{TOKEN}"]:
            try:
                open(path, "w").write("x")
            except OSError:
                pass
        open("big", "w").write("x" * (8 << 20))
        print(3)
    """),
    "network user": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\nprint(3)",
    "daemon": tagged("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\nprint(3)\nos._exit(1)"),
}


def test_hostile_programs_score_0_end_within_their_limits_and_leave_nothing(rule, open_folder, tmp_path, monkeypatch):
    """Each would print the right answer (3) if its limits did not stop it first."""
    host = tmp_path / "host"
    host.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(host))
    start = time.monotonic()
    scores = rule.scores([response(fenced(program), ADD_IO[:1]) for program in HOSTILE.values()])
    took = time.monotonic() - start
    assert dict(zip(HOSTILE, scores)) == dict.fromkeys(HOSTILE, 0.0)
    assert took < 2 * (SETTINGS["timeout_s"] + 2), took  # 7 runs, 4 at a time, each within its timeout
    assert processes_with_token() == [] and list(host.iterdir()) == [] and list(open_folder.iterdir()) == []
    assert not any(os.path.exists(p) for p in (f"/tmp/{TOKEN}", f"/dev/shm/{TOKEN}", os.path.expanduser(f"~/{TOKEN}")))
    assert subprocess.run(["true"]).returncode == 0


def test_runs_go_at_most_workers_at_once():
    rule = build_builtin("code", RulesConfig(code=CodeRuleConfig(**SETTINGS), workers=2), LABEL)
    start = time.monotonic()
    assert rule.scores([response(fenced("import time\ntime.sleep(2)\nprint(3)"), ADD_IO[:1])] * 4) == [1.0] * 4
    assert 4 <= time.monotonic() - start < 7  # two rounds of two: not four at once (2 s), nor one by one (8 s)


def test_a_stop_request_ends_the_runs_under_way(rule):
    """SIGTERM (a time limit) while programs run: scoring stops at once, the runs are killed, and
    the rule scores again afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, *STOP_SIGNALS)}
    sleeper = response(fenced(tagged("import time\ntime.sleep(3600)")), ADD_IO[:1])
    try:
        StopFlag().install()
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        with pytest.raises(StopRequested):
            rule.scores([sleeper] * 4)
        assert time.monotonic() - start < SETTINGS["timeout_s"]
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    deadline = time.monotonic() + 5  # killed at once; the kernel empties their PID namespaces just after
    while processes_with_token() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with_token() == []
    assert rule.scores([response(fenced("print(3)"), ADD_IO[:1])]) == [1.0]


def test_the_program_is_the_last_block_of_the_language():
    text = "```python\nfirst\n```\n```Python3 run\nsecond\n```\n```js\nthird\n```"
    assert program_in(text, "python") == "first\n"  # the info string's first word, whole: 'python3' is another
    assert program_in(text.replace("Python3", "Python"), "python") == "second\n"
    assert program_in(text, "") == "third\n" and program_in(text, None) == text
    assert program_in("```python\nnever closed", "python") is None


@pytest.mark.parametrize("tests, message", [
    (None, "field 'tests' (rules.code.tests_key) of the row of prompt 'Add two numbers.' (code.jsonl:3) is None, not a "
           "non-empty list of tests"),
    ([], "is [], not a non-empty list of tests"),
    (["assert True", {"input": "1"}], "field 'tests'[1] (rules.code.tests_key) of the row of prompt 'Add two numbers.' "
                                      "(code.jsonl:3) is {'input': '1'}, not a test (Python text, or a mapping of 'input' "
                                      "and 'output' texts"),
    ({"input": ["1"], "output": []}, "not a non-empty list of tests, or a mapping of two lists of the same length"),
])
def test_bad_tests_name_the_rule_the_row_and_the_field(rule, tests, message):
    with pytest.raises(RuleError) as e:
        rule.scores([response(fenced("print(3)"), tests)])
    assert str(e.value).startswith(LABEL) and message in str(e.value), str(e.value)


def test_a_row_without_tests_names_the_field_and_its_fields(rule):
    with pytest.raises(RuleError, match=r"has no field 'tests' \(rules.code.tests_key\); its fields: 'prompt', 'answer'"):
        rule.scores([Response("Q", "```python\nprint(3)\n```", (), {"prompt": "Q", "answer": 3}, "code.jsonl:9")])


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.realpath(sys.executable).startswith("/root/"),
                    reason="a job run as root from a Python under /root")
def test_an_interpreter_the_programs_user_cannot_run_fails_at_the_start():
    """Run as root, programs run as nobody, who cannot run the job's own Python here (rules.code.python null)."""
    with pytest.raises(ConfigError, match=r"^rules.code.python: .* cannot be run by the sandbox's user \(uid 65534\); "
                                          r"name an interpreter it can run, e.g. /usr/bin/python3"):
        build_builtin("code", RulesConfig(code=CodeRuleConfig(**{**SETTINGS, "python": None})), LABEL)
