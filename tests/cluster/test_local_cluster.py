"""A local Ray cluster whose node cannot start: the error says why, not only where the log was (on a
lent GPU machine the log's folder went with the failed run, and the job's own log said only
"`ray start ...` failed; see /tmp/.../ray_start_0.log")."""

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
