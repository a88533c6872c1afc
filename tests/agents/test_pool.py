"""The environment pool: calls run beside each other, coroutines on the pool's event loop, each with a
deadline from when it starts; a hung call is given up without costing the pool a thread."""

from __future__ import annotations

import asyncio
import time

import pytest

from hpcrlhf.agents.pool import CallTimeout, EnvPool


def slow(seconds: float, value):
    time.sleep(seconds)
    return value


async def slow_async(seconds: float, value):
    await asyncio.sleep(seconds)
    return value


def fails(kind):
    raise kind("it broke")


def drain(pool: EnvPool, calls, limit_s: float = 10.0) -> float:
    """Seconds until every call is done, giving up overdue ones as a scheduler would."""
    start, left = time.monotonic(), list(calls)
    while left:
        assert time.monotonic() - start < limit_s
        due = pool.next_deadline(left)
        done = pool.wait(left, None if due is None else max(0.0, due - time.monotonic()) + 0.01)
        pool.overdue(left)
        left = [c for c in left if not c.done()]
        assert all(c in calls for c in done)
    return time.monotonic() - start


def test_calls_run_beside_each_other_and_coroutines_on_the_loop():
    pool = EnvPool(3)
    try:
        calls = [pool.call(slow, 0.3, i, timeout_s=5, label=f"s{i}") for i in range(3)]
        calls.append(pool.call(slow_async, 0.3, "a", timeout_s=5, label="a"))
        took = drain(pool, calls)
        assert [c.result() for c in calls] == [0, 1, 2, "a"] and took < 0.8, took  # not 1.2 s in a row
        errors = [pool.call(fails, ValueError, timeout_s=5, label="v"), pool.call(fails, SystemExit, timeout_s=5, label="x")]
        drain(pool, errors)
        with pytest.raises(ValueError, match="it broke"):
            errors[0].result()
        with pytest.raises(SystemExit):
            errors[1].result()
    finally:
        pool.close()


def test_a_hung_call_is_given_up_at_its_deadline_and_its_thread_replaced():
    pool = EnvPool(1)
    try:
        hung = pool.call(slow, 30, "never", timeout_s=0.2, label="env.step")
        took = drain(pool, [hung])
        assert 0.2 <= took < 1.0
        with pytest.raises(CallTimeout, match="env.step took longer than 0.2 s"):
            hung.result()
        assert pool.abandoned == 1
        after = pool.call(slow, 0.05, "ok", timeout_s=5, label="next")  # the one worker still sleeps in the hung call
        assert drain(pool, [after]) < 0.5 and after.result() == "ok"
        stuck = pool.call(slow_async, 30, "never", timeout_s=0.2, label="async tool")
        assert drain(pool, [stuck]) < 1.0 and pool.abandoned == 1  # a coroutine is cancelled: no thread lost
        with pytest.raises(CallTimeout, match="async tool took longer than 0.2 s"):
            stuck.result()
    finally:
        pool.close()


def test_a_queued_calls_deadline_starts_when_it_runs():
    pool = EnvPool(1)
    try:
        calls = [pool.call(slow, 0.25, i, timeout_s=0.4, label=f"c{i}") for i in range(2)]
        assert calls[1].started is None and pool.next_deadline(calls) is not None
        drain(pool, calls)  # 0.5 s in all, past the first call's start + 0.4: only its own run counts
        assert [c.result() for c in calls] == [0, 1] and pool.abandoned == 0
    finally:
        pool.close()
