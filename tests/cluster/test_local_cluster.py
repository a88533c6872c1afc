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

pytestmark = pytest.mark.distributed


def test_a_node_that_fails_to_start_is_reported_with_the_end_of_its_log():
    root = Path(tempfile.mkdtemp(prefix="hpcrlhf-bad-", dir="/tmp"))  # short: Ray's socket paths are limited
    with pytest.raises(HpcrlhfError) as e:
        start_local_cluster(1, 0, cpus_per_node=-1, root=root, timeout_s=60)
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
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    root = Path(tempfile.mkdtemp(prefix="hpcrlhf-stray-", dir="/tmp"))
    with start_local_cluster(2, 0, cpus_per_node=1, root=root) as cluster:
        assert cluster.client_env() == {"RAY_AUTH_MODE": "disabled"}
