"""Process-group lifetime: a `hpcrlhf train` job destroys its process groups itself before the
process exits (left to exit-time destructors, gloo's threads aborted finished ranks now and then:
"terminate called without an active exception", exit -6)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.launch_helpers import ROOT, cli_env

JOB = """
import sys
import torch.distributed as dist
from hpcrlhf.cli import main
code = main(["train", "sft", "-o", sys.argv[1], "--set", "train.max_steps=1", "--set", "eval.every_steps=0",
             "--set", "eval.score_prompts=0", "--set", "task.train_size=64", "--set", "task.eval_size=8",
             "--set", "log.backends=[]", "--set", "checkpoint.save_model=false"])
print("exit", code, "group left", dist.is_initialized())
"""


def test_a_cli_job_leaves_no_process_group_behind(tmp_path):
    proc = subprocess.run([sys.executable, "-c", JOB, str(tmp_path / "run")], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exit 0 group left False" in proc.stdout, proc.stdout[-2000:]


RANK_END = """
import atexit, sys
from hpcrlhf.cli import exit_rank
atexit.register(lambda: print("exit handler ran", flush=True))
print("work done", end="")  # unflushed: exit_rank flushes it
exit_rank(int(sys.argv[1]))
print("never")
"""


@pytest.mark.parametrize("code", [0, 3])
def test_a_finished_rank_ends_with_its_code_its_handlers_run_and_output_flushed(code):
    proc = subprocess.run([sys.executable, "-c", RANK_END, str(code)], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert proc.stdout == "work doneexit handler ran\n", proc.stdout
