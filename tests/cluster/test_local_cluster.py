"""Starting the local Ray cluster (hpcrlhf.cluster.local): a node that cannot start says why, not
only where its log was (on a lent GPU machine the log's folder went with the failed run, and the
job's log said only "`ray start ...` failed; see /tmp/.../ray_start_0.log"); and the nodes of a
cluster without authentication join whatever Ray token files the user has."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from hpcrlhf.cluster.local import start_local_cluster
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


def test_a_process_with_a_ray_driver_is_refused_before_any_node_starts(ray_cluster):
    """Ray allows one driver per process and the join check needs one: said plainly, nothing started."""
    root = Path(tempfile.mkdtemp(prefix="hpcrlhf-2nd-", dir="/tmp"))
    with pytest.raises(HpcrlhfError, match=r"already has a Ray driver connected.*ray.shutdown\(\)"):
        start_local_cluster(1, 0, cpus_per_node=1, root=root)
    assert not any(root.iterdir()), "nothing may start"
