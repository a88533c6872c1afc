"""Issue 26.5: a job that starts its own Ray cluster moves into a private network first
(hpcrlhf.cluster.netns): its own user + network namespace whose only interface is loopback, so no
port of the cluster can be reached from another host. What a run inside looks like is checked in
tests/cluster/test_security.py (a live local cluster); here: the namespace itself, who enters it,
and the refusals."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

from hpcrlhf.config.jobspec import build_config
from hpcrlhf.cluster import netns
from hpcrlhf.cluster.session import isolate_local_cluster
from hpcrlhf.errors import ConfigError
from tests.launch_helpers import ROOT, cli_command, cli_env

INSIDE = textwrap.dedent("""
    import json, os, socket, sys
    from hpcrlhf.cluster import netns
    before = {"ns": netns.namespace_id(), "uid": os.getuid(), "gid": os.getgid(), "pid": os.getpid()}
    netns.enter()
    server = socket.create_server(("127.0.0.5", 0))  # anywhere on 127/8 answers: loopback is up
    reply = socket.create_connection(server.getsockname(), timeout=5)
    try:  # and nothing but loopback exists: no route anywhere else
        socket.create_connection(("10.1.2.3", 80), timeout=5)
        outside = "reached"
    except OSError as e:
        outside = e.strerror
    with open(sys.argv[1], "w") as f:
        f.write("x")
    print(json.dumps({"before": before, "ns": netns.namespace_id(), "uid": os.getuid(), "gid": os.getgid(),
                      "pid": os.getpid(), "inside": netns.inside(), "marker": os.environ.get(netns.MARKER),
                      "offline": os.environ.get("HF_HUB_OFFLINE"), "outside": outside,
                      "interfaces": [l.split(":")[0].strip() for l in open("/proc/self/net/dev").readlines()[2:]]}))
""")


def run_python(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=env or {k: v for k, v in os.environ.items() if k not in (netns.MARKER, "HF_HUB_OFFLINE")})


def test_a_process_that_enters_has_only_loopback_and_stays_itself(tmp_path):
    import json

    proc = run_python(INSIDE, str(tmp_path / "written"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout)
    assert seen["ns"] != seen["before"]["ns"] and seen["ns"] != netns.namespace_id()
    assert seen["interfaces"] == ["lo"], seen
    assert seen["outside"] == "Network is unreachable", seen
    # the same process, user and group: signals, files and Slurm's accounting still see the job
    assert (seen["pid"], seen["uid"], seen["gid"]) == tuple(seen["before"][k] for k in ("pid", "uid", "gid"))
    assert (tmp_path / "written").stat().st_uid == os.getuid()
    assert seen["inside"] and seen["marker"] == seen["ns"] and seen["offline"] == "1"


def test_a_child_knows_it_is_inside_and_an_outsider_with_a_stale_marker_does_not():
    code = ("import os, subprocess, sys\nfrom hpcrlhf.cluster import netns\nnetns.enter()\n"
            "print(subprocess.run([sys.executable, '-c', 'from hpcrlhf.cluster import netns; print(netns.inside())'],"
            " capture_output=True, text=True).stdout.strip())")
    proc = run_python(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-3000:]
    # a marker copied from elsewhere names another namespace: not inside
    env = {**os.environ, netns.MARKER: "net:[1]"}
    proc = run_python("from hpcrlhf.cluster import netns; print(netns.inside())", env=env)
    assert proc.stdout.strip() == "False", proc.stderr


def test_only_a_single_threaded_process_can_enter_and_auto_then_stays_on_the_host(caplog):
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        assert "single-threaded" in netns.why_not()
        with pytest.raises(OSError, match="single-threaded"):
            netns.isolate("private")
        assert netns.isolate("auto") is False
        assert "guarded by its token only" in caplog.text and "placement.local_network=host" in caplog.text
        assert netns.isolate("host") is False
    finally:
        stop.set()
        worker.join()
    assert not netns.inside()


@pytest.mark.parametrize("kind, sets, ray_address", [
    ("sft", [], None),                                       # not a Ray job
    ("ppo", ["placement.runtime=local"], None),             # PPO in this process
    ("ppo", [], "127.0.0.2:30000"),                         # a cluster it joins, not its own (a Slurm job's)
    ("ppo", ["placement.local_network=host"], None),        # asked for the host's network
])
def test_jobs_that_start_no_cluster_of_their_own_stay_where_they_are(monkeypatch, kind, sets, ray_address):
    """Called in this (multi-threaded) test process, an attempt to enter would raise: none is made."""
    recipe = "ppo-tiny-ray-colocated" if kind == "ppo" else None
    cfg = build_config(kind, recipe, sets, None)
    if kind == "ppo" and "placement.local_network=host" not in sets:
        cfg = build_config(kind, recipe, [*sets, "placement.local_network=private"], None)
    if ray_address:
        monkeypatch.setenv("RAY_ADDRESS", ray_address)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    before = netns.namespace_id()
    isolate_local_cluster(kind, cfg)
    assert netns.namespace_id() == before and not netns.inside()


def test_a_private_network_that_cannot_be_had_is_a_config_error(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = build_config("ppo", "ppo-tiny-ray-colocated", ["placement.local_network=private"], None)
    with pytest.raises(ConfigError, match=r"placement.local_network=private: .*single-threaded.*"
                                          r"placement.local_network=auto"):
        isolate_local_cluster("ppo", cfg)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux `unshare` is needed to switch namespaces off")
def test_where_user_namespaces_are_off_private_fails_before_anything_starts(tmp_path):
    """The CLI in a user namespace whose limit of nested user namespaces is 0 (what
    user.max_user_namespaces=0 does on a host): `private` is refused at once, naming the setting
    and the way out, before Ray or the run folder exist."""
    run = tmp_path / "run"
    cmd = cli_command(["train", "ppo", "--config", "ppo-tiny-ray-colocated", "-o", str(run),
                       "--set", "placement.local_network=private"])
    script = "echo 0 > /proc/sys/user/max_user_namespaces && exec \"$@\""
    env = {k: v for k, v in cli_env().items() if k not in ("RAY_ADDRESS", netns.MARKER)}
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script, "sh", *cmd], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("hpcrlhf: error: placement.local_network=private: this job cannot enter a private network namespace "
            "(the kernel allows no more user namespaces here (sysctl user.max_user_namespaces is 0 or reached))"
            in proc.stderr), proc.stderr[-3000:]
    assert "placement.local_network=auto" in proc.stderr and "Traceback" not in proc.stderr
    assert not run.exists() and "starting a local Ray cluster" not in proc.stderr + proc.stdout


def test_a_hub_model_the_private_network_cannot_reach_is_refused_with_the_way_out(tmp_path):
    """Inside the private network the hub is out of reach: a hub name not in the local cache fails
    before Ray starts, and the error says why here and what to do (download first, or `host`)."""
    run = tmp_path / "run"
    cmd = cli_command(["train", "ppo", "--config", "ppo-tiny-ray-colocated", "-o", str(run),
                       "--set", "model.path=Qwen/Qwen2.5-0.5B", "--set", "placement.gpu_memory_gb=80",
                       "--set", "placement.vllm.gpu_memory_utilization=0.5"])
    env = {k: v for k, v in cli_env(HF_HOME=str(tmp_path / "empty-hub-cache")).items()
           if k not in ("RAY_ADDRESS", netns.MARKER)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "runs in a private network namespace" in proc.stderr
    assert ("this job runs in a private network (placement.local_network), where the hub cannot be reached: download "
            "the model beforehand, or set placement.local_network=host") in proc.stderr, proc.stderr[-3000:]
    assert "starting a local Ray cluster" not in proc.stderr
