"""Starting the local Ray cluster (hpcrlhf.cluster.local): a node that cannot start says why, not
only where its log was (on a lent GPU machine the log's folder went with the failed run, and the
job's log said only "`ray start ...` failed; see /tmp/.../ray_start_0.log"); and the nodes of a
cluster without authentication join whatever Ray token files the user has; and two clusters starting
at once on one host never pick the same ports (`port_pick_lock`)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from hpcrlhf.cluster.local import port_pick_lock, start_local_cluster
from hpcrlhf.errors import HpcrlhfError
from tests.launch_helpers import in_a_fresh_process

pytestmark = pytest.mark.distributed


def _start_a_bad_node(root: Path) -> None:
    start_local_cluster(1, 0, cpus_per_node=-1, root=root, timeout_s=60)


def _start_two_nodes_and_stop(root: Path) -> dict[str, str]:
    """Start a 2-node cluster without authentication, return its client settings, stop it."""
    with start_local_cluster(2, 0, cpus_per_node=1, root=root) as cluster:
        return cluster.client_env()


def test_a_node_that_fails_to_start_is_reported_with_the_end_of_its_log():
    root = Path(tempfile.mkdtemp(prefix="hpcrlhf-bad-", dir="/tmp"))  # short: Ray's socket paths are limited
    with pytest.raises(HpcrlhfError) as e:
        in_a_fresh_process(_start_a_bad_node, root)
    said = str(e.value)
    assert "ray start" in said and "ray_start_0.log" in said
    assert "Resource quantities must be nonnegative" in said, said  # Ray's own words, from the log


def test_nodes_join_a_cluster_without_authentication_even_with_a_stray_ray_token(tmp_path, monkeypatch):
    """Ray 2.60's `ray start --head` turns token authentication on by itself where ~/.ray/auth_token
    exists (any local `ray.init()` writes one) and RAY_AUTH_MODE is unset, while the other nodes'
    `ray start` does not: the second node then failed to join ("InvalidAuthToken") -- seen when a
    test run left such a file. The cluster says RAY_AUTH_MODE=disabled itself."""
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("a" * 64)
    monkeypatch.setenv("HOME", str(tmp_path))  # the spawned process inherits the environment
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    root = Path(tempfile.mkdtemp(prefix="hpcrlhf-stray-", dir="/tmp"))
    assert in_a_fresh_process(_start_two_nodes_and_stop, root) == {"RAY_AUTH_MODE": "disabled"}


def test_a_nodes_daemons_leave_out_the_log_monitor(ray_cluster):
    """hpcrlhf's drivers never print the workers' output (`log_to_driver=False`), so no node runs Ray's
    log monitor, which tails every log file of the node to publish it (~2.5 % of CI's CPU)."""
    import psutil

    daemons = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])
               if _group_of(p.pid) in ray_cluster.groups]
    assert sum("/raylet " in c for c in daemons) == len(ray_cluster.node_ips), daemons  # the survey sees each node
    assert not [c for c in daemons if "log_monitor" in c], daemons


def _group_of(pid: int) -> int | None:
    import os

    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_a_process_with_a_ray_driver_is_refused_before_any_node_starts(ray_cluster):
    """Ray allows one driver per process and the join check needs one: said plainly, nothing started."""
    root = Path(tempfile.mkdtemp(prefix="hpcrlhf-2nd-", dir="/tmp"))
    with pytest.raises(HpcrlhfError, match=r"already has a Ray driver connected.*ray.shutdown\(\)"):
        start_local_cluster(1, 0, cpus_per_node=1, root=root)
    assert not any(root.iterdir()), "nothing may start"


HOLD_THE_LOCK = """import sys
from pathlib import Path
from hpcrlhf.cluster.local import port_pick_lock
with port_pick_lock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""


@contextmanager
def held_elsewhere(lock: Path):
    """`lock` held by another process until `release()` is called (or the block ends)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder.stdin.close  # the holder leaves its `with`: the lock is free
    finally:
        holder.kill()
        holder.wait()


def test_a_port_block_is_picked_by_one_process_at_a_time(tmp_path):
    """A cluster holds the pick lock from choosing its block until its nodes listen there: another
    process's pick waits for it (else both would find the same block free and collide)."""
    lock = tmp_path / "pick.lock"
    with held_elsewhere(lock) as release:
        taken = threading.Event()

        def pick():
            with port_pick_lock(lock):
                taken.set()

        picker = threading.Thread(target=pick, daemon=True)
        picker.start()
        assert not taken.wait(1.0)  # the other process holds it
        release()
        assert taken.wait(30)
        picker.join(30)


def test_a_pick_lock_that_cannot_be_had_is_gone_around_with_a_warning(tmp_path, caplog):
    """Best effort: a lock file that is a symbolic link (planted in a shared /tmp), or one held past
    the wait, delays a start at most `wait_s` and never stops it."""
    link = tmp_path / "link.lock"
    link.symlink_to(tmp_path / "elsewhere")
    with port_pick_lock(link):
        pass
    assert "cannot open the port-pick lock" in caplog.text and not (tmp_path / "elsewhere").exists()
    lock = tmp_path / "pick.lock"
    with held_elsewhere(lock):
        with port_pick_lock(lock, wait_s=0.3):
            pass
        assert "was held for more than 0.3 s" in caplog.text
