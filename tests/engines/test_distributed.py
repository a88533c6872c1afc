"""Process-group lifetime: a `hpcrlhf train` job destroys its process groups itself before the
process exits (left to exit-time destructors, gloo's threads aborted finished ranks now and then:
"terminate called without an active exception", exit -6)."""

from __future__ import annotations

import subprocess
import sys

from tests.launch_helpers import ROOT, cli_env

JOB = """
import sys
import torch.distributed as dist
from hpcrlhf.cli import main
code = main(["train", "sft", "-o", sys.argv[1], "--set", "train.max_steps=1", "--set", "eval.every_steps=0",
             "--set", "eval.score_prompts=0", "--set", "task.train_size=64", "--set", "task.eval_size=8",
             "--set", "log.tensorboard=false", "--set", "checkpoint.save_model=false"])
print("exit", code, "group left", dist.is_initialized())
"""


def test_a_cli_job_leaves_no_process_group_behind(tmp_path):
    proc = subprocess.run([sys.executable, "-c", JOB, str(tmp_path / "run")], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exit 0 group left False" in proc.stdout, proc.stdout[-2000:]
