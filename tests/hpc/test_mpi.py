"""The MPI launcher: rank discovery by host name, and a real `mpirun` of two SFT ranks that trains
exactly like torchrun's two ranks would (the same numbers as one rank with the whole batch)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest

from hpcrlhf.hpc.mpi import RankInfo, node_layout
from hpcrlhf.run.metrics import read_metrics
from tests.launch_helpers import ROOT, cli_env, run_cli

SHORT = ["--set", "train.max_steps=12", "--set", "train.global_batch_size=32", "--set", "train.micro_batch_size=16",
         "--set", "log.every_steps=1", "--set", "eval.every_steps=0", "--set", "eval.score_prompts=32",
         "--set", "task.eval_size=64", "--set", "task.train_size=2000", "--set", "log.backends=[]"]


@pytest.mark.parametrize("hosts, expected", [
    (["n1", "n1", "n2", "n2"], [(0, 2, 0), (1, 2, 0), (0, 2, 1), (1, 2, 1)]),
    (["b", "a", "b", "a", "b"], [(0, 3, 0), (0, 2, 1), (1, 3, 0), (1, 2, 1), (2, 3, 0)]),  # round-robin ranks
    (["solo"], [(0, 1, 0)]),
])
def test_node_layout_groups_ranks_by_host(hosts, expected):
    assert [node_layout(hosts, r) for r in range(len(hosts))] == expected


def test_torch_env_is_what_torchrun_sets():
    env = RankInfo(3, 4, 1, 2, 1, "10.0.0.1", 29500).torch_env()
    assert env == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                   "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    sealed = RankInfo(3, 4, 1, 2, 1, "10.0.0.1", 29500, "ab" * 64)
    assert sealed.torch_env()["HPCRLHF_STORE_SECRET"] == "ab" * 64 and "ab" * 64 not in repr(sealed)


PROBE = """
import json, os, sys, datetime, psutil
from torch.distributed import TCPStore
from hpcrlhf.engines.distributed import barrier, init_distributed
init_distributed()
barrier()
if os.environ["RANK"] == "0":
    spy = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, datetime.timedelta(seconds=10))
    keys = [[name, spy.get(name).hex()] for name in spy.list_keys()]
    listening = sorted({(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp")
                        if c.status == psutil.CONN_LISTEN})
    json.dump({"keys": keys, "listening": listening, "at": [os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]]},
              open(sys.argv[1], "w"))
barrier()
"""


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed (slurm/install-test-deps.sh)")
def test_mpi_ranks_meet_in_a_store_on_rank_0s_address_sealed(tmp_path):
    """Issue 36: the default group's store listened on every interface and any client read its keys;
    now it listens on MASTER_ADDR only and a client without the secret rank 0 sent over MPI sees
    opaque names and sealed values. (gloo's listener stays on the host name's address, and Open MPI's
    own TCP transport listens on every interface: theirs.)"""
    (tmp_path / "probe.py").write_text(PROBE)
    report = tmp_path / "report.json"
    proc = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable,
                           "-m", "hpcrlhf.hpc.mpi", "-m", "probe", str(report)], cwd=ROOT,
                          env=cli_env(PYTHONPATH=f"{tmp_path}:{ROOT}"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(report.read_text())
    host, port = found["at"][0], int(found["at"][1])
    assert [host, port] in found["listening"], found
    assert not [a for a in found["listening"] if a[1] == port and a[0] != host], found["listening"]  # there only
    assert found["keys"] and all(len(name) == 64 and "/" not in name for name, _ in found["keys"]), found["keys"]
    gloo = {socket.inet_aton(ip).hex() for ip, _ in found["listening"] if ":" not in ip}  # its address, packed
    assert not [v for _, v in found["keys"] if any(a in v for a in gloo)], "a value shows an address in the clear"


def losses(run_dir) -> dict[int, float]:
    return {m["step"]: m["train/loss"] for m in read_metrics(run_dir) if "train/loss" in m}


@pytest.mark.distributed
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed (slurm/install-test-deps.sh)")
def test_mpirun_ranks_train_like_one_rank(tmp_path):
    one = tmp_path / "one"
    run_cli(["train", "sft", "-o", str(one), *SHORT])
    two = tmp_path / "mpi"
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m", "hpcrlhf.hpc.mpi",
           "train", "sft", "-o", str(two), *SHORT]
    proc = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "2 rank(s) x 16 rows" in proc.stdout + proc.stderr  # two ranks, half the batch each
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 13))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=2e-3, abs=2e-3), step


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed (slurm/install-test-deps.sh)")
def test_mpirun_runs_a_module_with_torchrun_variables(tmp_path):
    """`python -m hpcrlhf.hpc.mpi -m MODULE ARGS` (how the benchmark starts TRL across nodes): the
    module runs as __main__ on every rank, with its arguments and torchrun's variables."""
    (tmp_path / "show_rank.py").write_text(  # a file per rank: mpirun may join the ranks' stdout lines
        "import json, os, sys\n"
        "if __name__ == '__main__':\n"
        f"    with open(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK'] + '.json'), 'w') as f:\n"
        "        json.dump({'argv': sys.argv[1:], **{k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK')}}, f)\n"
        "    sys.exit(3 if '--fail' in sys.argv else 0)\n")
    base = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m", "hpcrlhf.hpc.mpi",
            "-m", "show_rank"]
    env = cli_env(PYTHONPATH=f"{tmp_path}:{ROOT}")
    proc = subprocess.run([*base, "--x", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert rows == [{"argv": ["--x", "1"], "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)} for r in range(2)]
    failed = subprocess.run([*base, "--fail"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert failed.returncode != 0  # the module's exit status is the rank's
