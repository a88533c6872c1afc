"""agent/* figures from trajectory records, against sums written out by hand."""

from __future__ import annotations

from hpcrlhf.agents.metrics import batch_stats, episode_stats
from hpcrlhf.agents.record import EpisodeRecord
from hpcrlhf.agents.scheduler import BatchStats
from hpcrlhf.run.stats import add_stats, new_stats, reduce_means


def test_figures_by_hand():
    a = EpisodeRecord("done", 2, [0.1, 0.2], 1.0, tool_calls={"multiply": 2}, tool_errors={"raised": 1, "multiply": 1},
                      env_seconds=0.5, success=True, info={"score": 2.0})
    b = EpisodeRecord("max_turns", 4, [0.0] * 4, tool_calls={"add": 1, "invalid": 1}, tool_errors={"malformed": 1})
    c = EpisodeRecord("timeout", 1, error="slow")
    s = episode_stats([a, b, c], model_tokens=[10, 20, 5], env_tokens=[6, 12, 0])
    assert s == {
        "agent/turns": (7.0, 3), "agent/model_tokens": (35.0, 3), "agent/env_tokens": (18.0, 3),
        "agent/episode_reward": (1.3, 3), "agent/env_seconds": (0.5, 3), "agent/tool_calls": (4.0, 3),
        "agent/tool_errors": (2.0, 3), "agent/timeouts": (1.0, 3), "agent/env_errors": (0.0, 3),
        "agent/truncated": (1.0, 3), "agent/truncated/max_turns": (1.0, 3), "agent/truncated/max_tokens": (0.0, 3),
        "agent/tool_calls/add": (1.0, 3), "agent/tool_calls/invalid": (1.0, 3), "agent/tool_calls/multiply": (2.0, 3),
        "agent/tool_errors/malformed": (1.0, 3), "agent/tool_errors/multiply": (1.0, 3),
        "agent/tool_errors/raised": (1.0, 3),
        "agent/success": (1.0, 1), "agent/info/score": (2.0, 1)}
    assert episode_stats([], [], []) == {}


def test_batch_figures_add_up_over_batches_as_seconds_and_calls():
    """Two batches (two ranks, or two steps): the idle share is the idle seconds over the wall seconds of
    both, not the mean of the two shares."""
    one = BatchStats(wall_s=10.0, engine_idle_s=1.0, env_calls=12, abandoned_calls=1)
    two = BatchStats(wall_s=30.0, engine_idle_s=15.0, env_calls=8)
    sums = add_stats(add_stats(new_stats(), batch_stats(one, 4)), batch_stats(two, 4))
    assert reduce_means(sums) == {"agent/engine_idle_share": 16.0 / 40.0, "agent/env_calls": 20 / 8,
                                  "agent/abandoned_calls": 1 / 8}
    assert batch_stats(one, 0) == {}
