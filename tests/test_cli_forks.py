"""The tests' forked CLI jobs (tests/cli_forks.py) behave like fresh `python -m hpcrlhf` processes:
the same status and output, the job's own environment and PYTHONPATH, and a job past its time limit
killed."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from tests.cli_forks import warm_process
from tests.launch_helpers import ROOT, cli_command, cli_env, run_cli

pytestmark = pytest.mark.skipif(os.environ.get("HPCRLHF_TEST_FORKS", "1") == "0",
                                reason="HPCRLHF_TEST_FORKS=0: CLI jobs start fresh")

PROBE = '''\
import os, sys
print("probe: HPCRLHF_VERBOSE=" + os.environ.get("HPCRLHF_VERBOSE", "-") + " cwd=" + os.getcwd(), file=sys.stderr)
if os.environ.get("PROBE_SLEEP"):
    import time
    time.sleep(600)


def score(prompt, response, row):
    return 0.0
'''


def fresh(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cli_command(args), cwd=ROOT, env=cli_env(**env), capture_output=True, text=True, timeout=300)


@pytest.fixture
def probe(tmp_path) -> dict[str, str]:
    (tmp_path / "probe.py").write_text(PROBE)
    return {"PYTHONPATH": str(tmp_path), "HPCRLHF_VERBOSE": "0"}


def test_a_forked_job_says_and_exits_what_a_fresh_one_does(probe, tmp_path):
    """A job refused before any step (its metric module, from PYTHONPATH, says what it sees, then
    lacks the function named): the same exit status and the same lines, forked or fresh."""
    assert warm_process(cli_env()) is not None and warm_process(cli_env()).accepts(cli_env(**probe))
    args = ["generate", "-m", "builtin:tiny-llama", "-o", str(tmp_path / "out.jsonl"), "--set", "metrics=[probe:nope]"]
    forked, alone = run_cli(args, env=probe, check=False), fresh(args, probe)
    assert forked.returncode == alone.returncode == 2, (forked.stderr, alone.stderr)
    assert f"probe: HPCRLHF_VERBOSE=0 cwd={ROOT}" in forked.stderr
    assert "rule 'probe:nope' cannot be imported (module 'probe' has no 'nope')" in forked.stderr
    assert untimed(forked.stderr) == untimed(alone.stderr) and untimed(forked.stdout) == untimed(alone.stdout)


def untimed(text: str) -> str:
    return re.sub(r"^\[\d\d:\d\d:\d\d hpcrlhf\]", "[hpcrlhf]", text, flags=re.MULTILINE)


def test_a_forked_job_past_its_time_limit_is_killed(probe, tmp_path):
    env = {**probe, "PROBE_SLEEP": "1"}
    warm = warm_process(cli_env())
    assert warm is not None
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run(["generate", "-m", "builtin:tiny-llama", "-o", str(tmp_path / "out.jsonl"), "--set",
                  "metrics=[probe:score]"], cli_env(**env), tmp_path, timeout=20)
    assert time.monotonic() - start < 120
    status, _, err = warm.run(["train", "sft", "--set", "no.such=1"], cli_env(), tmp_path, timeout=120)
    assert status == 2 and "no.such" in err  # the warm process serves the next job


def test_an_environment_a_library_reads_at_import_starts_a_fresh_process():
    warm = warm_process(cli_env())
    assert warm is not None
    assert not warm.accepts(cli_env(HF_HUB_OFFLINE="0")) and not warm.accepts(cli_env(OMP_NUM_THREADS="2"))
    assert warm.accepts(cli_env(SLURM_CONF="/etc/slurm.conf"))
