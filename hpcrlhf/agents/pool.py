"""Environment and tool calls off the generation path: worker threads for plain functions, one event
loop thread for coroutines, and a deadline on every call.

The scheduler hands each call to the pool and goes on feeding the engine; it collects calls as they
finish (`wait`). A call that runs past its deadline (`overdue`) is given up: a coroutine is cancelled;
a plain function cannot be stopped from outside, so its thread is abandoned (it ends when the
call returns, if ever) and a new thread takes its place, keeping the pool's capacity. Abandoned
threads are counted (`abandoned`): a run whose tools keep hanging shows it.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any


class CallTimeout(Exception):
    """A call ran past its deadline (the pool gave it up)."""


@dataclass(eq=False)
class Call:
    """One call under way: its result (`future`), what it is (`label`, for errors) and its deadline."""

    label: str
    timeout_s: float
    future: Future = field(default_factory=Future)
    started: float | None = None
    """time.monotonic() when it began running (queued calls have no deadline yet)."""
    abandoned: bool = False
    cancel: Callable[[], Any] | None = None
    """Stops a coroutine's call (None: a plain function's, which cannot be stopped)."""

    def done(self) -> bool:
        return self.future.done()

    @property
    def lost_thread(self) -> bool:
        """Given up while a plain function ran it: its thread was left to it (a coroutine is cancelled)."""
        return self.abandoned and self.cancel is None

    def result(self) -> Any:
        """Its return value, or what it raised (CallTimeout when given up)."""
        return self.future.result()


class EnvPool:
    """`workers` threads for plain functions and one event-loop thread (started when first needed) for
    coroutine functions."""

    def __init__(self, workers: int, name: str = "hpcrlhf-env") -> None:
        if workers < 1:
            raise ValueError(f"EnvPool: workers must be >= 1, got {workers}")
        self.name, self.abandoned = name, 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        for _ in range(workers):
            self._add_worker()

    def _add_worker(self) -> None:
        thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            call, fn, args = item
            if not call.future.set_running_or_notify_cancel():
                continue
            call.started = time.monotonic()
            try:
                _settle(call.future, result=fn(*args))
            except BaseException as e:  # the call's to report, whatever it is (SystemExit included)
                _settle(call.future, error=e)
            if call.abandoned:
                return  # a replacement took this thread's place while the call hung

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name=f"{self.name}-loop", daemon=True).start()
            return self._loop

    def call(self, fn: Callable, *args: Any, timeout_s: float, label: str) -> Call:
        """Start `fn(*args)`: on a worker thread, or on the event loop when `fn` is a coroutine function."""
        call = Call(label, timeout_s)
        if inspect.iscoroutinefunction(fn):
            call.started = time.monotonic()

            async def bounded():
                try:
                    return await asyncio.wait_for(fn(*args), timeout_s)
                except asyncio.TimeoutError:
                    raise CallTimeout(f"{label} took longer than {timeout_s:g} s") from None

            call.future.set_running_or_notify_cancel()
            inner = asyncio.run_coroutine_threadsafe(bounded(), self._event_loop())
            inner.add_done_callback(lambda f: _copy_outcome(f, call.future))
            call.cancel = inner.cancel
        else:
            self._queue.put((call, fn, args))
        return call

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` here and now, a coroutine function's call awaited on the pool's event
        loop: how code on a worker thread calls user methods that may be `async def`."""
        if inspect.iscoroutinefunction(fn):
            return asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), self._event_loop()).result()
        return fn(*args, **kwargs)

    def overdue(self, calls: Iterable[Call], now: float | None = None) -> list[Call]:
        """The calls of `calls` past their deadline, given up now: each fails with CallTimeout, and the
        thread of a plain function's call is replaced (`Call.lost_thread`). One that finished meanwhile is
        left to its result."""
        now = time.monotonic() if now is None else now
        given_up = []
        for c in [c for c in calls if not c.done() and c.started is not None and now - c.started > c.timeout_s]:
            if not _settle(c.future, error=CallTimeout(f"{c.label} took longer than {c.timeout_s:g} s")):
                continue  # it finished meanwhile: its thread goes on serving
            c.abandoned = True  # its thread ends once the call returns, if ever
            given_up.append(c)
            if c.cancel is not None:
                c.cancel()
            else:
                self.abandoned += 1
                self._add_worker()
        return given_up

    def wait(self, calls: Iterable[Call], timeout_s: float | None) -> list[Call]:
        """The calls of `calls` that are done, waiting up to `timeout_s` for the first one."""
        pending = {c.future: c for c in calls}
        done, _ = wait_futures(list(pending), timeout=timeout_s, return_when=FIRST_COMPLETED)
        return [pending[f] for f in done]

    def next_deadline(self, calls: Iterable[Call]) -> float | None:
        """time.monotonic() by which the next call of `calls` may be due (a queued call: its timeout
        from now, at the earliest), or None when all are done: how long a scheduler may wait."""
        now = time.monotonic()
        due = [(c.started if c.started is not None else now) + c.timeout_s for c in calls if not c.done()]
        return min(due) if due else None

    def close(self) -> None:
        """Let the worker threads end once their calls are done (a hung one stays, as a daemon)."""
        for _ in self._threads:
            self._queue.put(None)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)


def _settle(future: Future, *, result: Any = None, error: BaseException | None = None) -> bool:
    """Give `future` its outcome unless it has one already (a call given up, then returning); True
    when this one counts."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        return False
    return True


def _copy_outcome(source: Future, target: Future) -> None:
    if source.cancelled():
        _settle(target, error=CallTimeout("cancelled"))
    else:
        _settle(target, result=None if source.exception() else source.result(), error=source.exception())
