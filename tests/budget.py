"""Tests CI leaves out for its minutes: CI has 90 minutes on a 2-core host and the suite is bound by
its total CPU (docs/tests.md, "Where CI's time goes"). A test marked `long_only` checks a claim
another test already covers more cheaply in CI, or checks it again in a costlier setting; it runs
where `HPCRLHF_LONG_TESTS=1` (`HPCRLHF_LONG_TESTS=1 make test`, or one module with pytest), and the
skip says so and why."""

from __future__ import annotations

import os

import pytest

LONG = os.environ.get("HPCRLHF_LONG_TESTS") == "1"


def long_only(cpu_s: int, covered_by: str) -> pytest.MarkDecorator:
    """Skip unless HPCRLHF_LONG_TESTS=1; the reason names the CPU seconds saved and what covers the
    claim in CI meanwhile."""
    return pytest.mark.skipif(not LONG, reason=f"left out of CI for its ~{cpu_s} CPU-s (covered there by "
                                               f"{covered_by}): HPCRLHF_LONG_TESTS=1 runs it")
