"""Running the user's functions (reward rules, evaluation metrics, agent environments and tools)
inside a job: importing them by name (`load_named`), a deadline, stop requests, what they may not do,
and reading the numbers they return (`real_number`).

A rule is the user's code, called once per response in the middle of a training step. Three things
it may do must not take the job with it (`user_code`):

- never return (an endless loop, a network call that hangs): each call has a deadline
  (`reward.rule_timeout_s`, `eval.metric_timeout_s`, generate's `metric_timeout_s`); past it
  `UserCodeTimeout` is raised in the call, and then again every `REPEAT_S` should the call catch it;
- be running when a stop request comes (a time limit, preemption, Ctrl-C): StopRequested is raised
  in it (`hpcrlhf.run.signals.interruptible`), the step is dropped and the run checkpoints;
- raise KeyboardInterrupt itself: that is the code's doing, not the user's key press; a real Ctrl-C
  is told apart (`hpcrlhf.run.signals.Interrupted`) and ends the command as ever.

The caller (`hpcrlhf.rewards.rules.Rule`) turns a timeout, `sys.exit()` (SystemExit) and any other
BaseException the code raises into a RuleError naming the rule, instead of the job ending (with
status 0 for `sys.exit(0)`).

How: the call runs in the calling thread (a rule may need the main thread: math_verify's timeouts
use SIGALRM there), under an ITIMER_REAL timer whose SIGALRM handler raises in it. Python runs
signal handlers between bytecodes, and a signal also ends a blocking system call (sleep, a socket
read), so both kinds of hang end at the deadline. What no code in the process can end: C code that
holds the GIL and never returns (a catastrophic regular expression in `re`); such a job runs until
Slurm's time limit kills it. A rule that sets SIGALRM itself (`signal.alarm`) replaces the deadline
for that call. Outside the main thread (hpcrlhf calls rules in the main thread of every process,
Ray actors included) the code runs without a deadline.
"""

from __future__ import annotations

import importlib
import math
import numbers
import signal
import threading
import traceback
from contextlib import contextmanager, nullcontext
from collections.abc import Iterator
from typing import Any

from hpcrlhf.errors import ConfigError
from hpcrlhf.run.signals import Interrupted, interruptible

REPEAT_S = 1.0
"""After the deadline, how often the timeout is raised again in code that caught it."""


class UserCodeTimeout(BaseException):
    """The user's code passed its deadline (raised in it by `user_code`). A BaseException, so that
    the code's own `except Exception` does not swallow it."""


_armed = False
"""Whether a deadline is running: a SIGALRM that comes after the call ended raises nothing."""


def _expired(signum, frame) -> None:
    if _armed:
        raise UserCodeTimeout


def _ctrl_c(signum, frame) -> None:
    raise Interrupted


@contextmanager
def _deadline(timeout_s: float) -> Iterator[None]:
    global _armed
    previous = signal.signal(signal.SIGALRM, _expired)
    try:
        _armed = True
        signal.setitimer(signal.ITIMER_REAL, timeout_s, REPEAT_S)
        try:
            yield
        finally:
            _armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        if previous is not None:  # None: a handler set outside Python, which Python cannot set back
            signal.signal(signal.SIGALRM, previous)


@contextmanager
def _real_ctrl_c() -> Iterator[None]:
    """Where Ctrl-C has Python's default handler (no run's StopFlag: `hpcrlhf generate`), a key
    press raises Interrupted for the block, so it is not taken for the code's own KeyboardInterrupt."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    signal.signal(signal.SIGINT, _ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def user_code(timeout_s: float):
    """The block runs the user's code: a deadline of `timeout_s` (UserCodeTimeout), stop requests
    (StopRequested, at once when one came before), a real Ctrl-C (Interrupted). Main thread only;
    elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        return nullcontext()
    return _user_code(timeout_s)


@contextmanager
def _user_code(timeout_s: float) -> Iterator[None]:
    with interruptible(), _real_ctrl_c(), _deadline(timeout_s):
        yield


def load_named(name: str, label: str, kind: str) -> Any:
    """The object `package.module:attribute` names (`name`, of that form), imported: a ConfigError
    starting with `label` ("reward.sources[0]: rule 'm:f'") when the module cannot be imported or
    has no such `kind` ("function", "class")."""
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while it is imported
        raise ConfigError(f"{label} cannot be imported ({type(e).__name__}: {e}); check the module is on PYTHONPATH "
                          "and imports") from None
    value = getattr(module, attribute, None)
    if value is None:
        raise ConfigError(f"{label} cannot be imported (module '{module_name}' has no '{attribute}'); check the module "
                          f"defines the {kind}")
    return value


def real_number(value: Any) -> float | None:
    """`value` as a float when it is a real number (int, float, bool, Fraction, a numpy scalar, a 0-d
    array or tensor), else None; an int too large for a float is +-Inf."""
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        value = value.item()  # numpy scalars (np.bool_ is no numbers.Real) and 0-d arrays or tensors
    if not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def raised_at(e: BaseException) -> str:
    """` at file:line in function` of the innermost frame the exception passed through (in the user's
    code or in what it called), the caller's own frame left out; empty when it came from C code the
    caller called directly."""
    frames = traceback.extract_tb(e.__traceback__)[1:]
    return f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
