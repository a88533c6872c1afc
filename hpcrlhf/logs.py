"""Rank-aware console output: one logger that speaks on rank 0, a progress display, and the
libraries' own output kept off the terminal.

On a terminal the progress is a tqdm bar; in batch logs (Slurm, CI) it is a one-line status
every few seconds with rate and ETA, so job logs stay readable.

The libraries' output. transformers, DeepSpeed, vLLM, Ray and torch log to the terminal on their
own (a LOAD REPORT table when a reward model starts from a causal LM, DeepSpeed's "Setting
accelerator to CPU", ~80 lines of vLLM per engine start and shutdown), and Python warnings print
there too. The `hpcrlhf` command sends them elsewhere (`route_third_party`, first thing it does):
a run's into its folder's `third_party.log` (`third_party_to`, when the run folder is known; held
in memory until then), those of a command without a run folder nowhere. Their errors (ERROR and
above) still reach the terminal, followed once by where the rest is. `log.third_party=console`,
or HPCRLHF_VERBOSE=1 for any command, leaves the libraries to print as they do.

Why at the logger class: a library's logger gets its own terminal handlers whenever the library
likes -- transformers and DeepSpeed at import, vLLM at import and again at every engine start (its
dictConfig) -- so handlers taken away would come back. Every record, whichever logger it is logged
on, passes through that logger's `callHandlers`; a library's loggers made after `route_third_party`
(and those already there) are of a class that hands their records to this module instead.

Output that bypasses Python's logging is a process's own: vLLM's engine core and its workers
print logs, warnings, C++ messages and progress bars on their standard output and error, which
they inherit when they start. `third_party_processes` points this process's stdout and stderr at
the run log while it starts them (hpcrlhf.engines.rollout.vllm). Ray's workers never print to the
driver's terminal (hpcrlhf starts Ray with log_to_driver=False); their output is in Ray's session
logs. Library calls from Python (not the `hpcrlhf` command) are left alone.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterator

from tqdm import tqdm

from hpcrlhf.errors import ConfigError, HpcrlhfError
from hpcrlhf.run.files import append, open_in_place, os_error_reason

_FORMAT = "[%(asctime)s hpcrlhf] %(message)s"


def get_logger(name: str = "hpcrlhf") -> logging.Logger:
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
        rank = int(os.environ.get("RANK", 0))
        logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return logger


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Steps done out of a total, with rate and ETA; silent off rank 0 or when disabled."""

    def __init__(self, total: int, *, initial: int = 0, desc: str = "train", enabled: bool = True,
                 status_every_s: float = 15.0):
        self.total, self.done, self.desc = total, initial, desc
        self.enabled = enabled
        self._start, self._start_step = time.monotonic(), initial
        self._last_status = self._start
        self._every = status_every_s
        self._bar = None
        if enabled and sys.stderr.isatty():
            self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def update(self, n: int = 1, **postfix: float) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last_status >= self._every or self.done == self.total:
            self._last_status = now
            get_logger().info(self.status_line(now, postfix))

    def status_line(self, now: float, postfix: dict[str, float]) -> str:
        rate = (self.done - self._start_step) / max(now - self._start, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        extra = " ".join(f"{k}={v:.4g}" for k, v in postfix.items())
        eta_s = format_duration(eta) if eta != float("inf") else "?"
        return f"{self.desc} {self.done}/{self.total} [{rate:.2f} step/s, ETA {eta_s}] {extra}".rstrip()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# --- the libraries' output ------------------------------------------------------------------------

THIRD_PARTY = ("transformers", "vllm", "DeepSpeed", "deepspeed", "torch", "ray", "accelerate", "datasets",
               "huggingface_hub", "tokenizers", "peft", "trl", "safetensors", "filelock", "urllib3", "httpx", "httpcore",
               "fsspec", "py.warnings")
"""The loggers (with those under them) whose records are third-party output; `py.warnings`: Python
warnings (logging.captureWarnings)."""
_UNDER = tuple(f"{name}." for name in THIRD_PARTY)
THIRD_PARTY_LOG = "third_party.log"
"""The file in a run folder that receives the libraries' output."""
VERBOSE_ENV = "HPCRLHF_VERBOSE"
HELD_RECORDS = 10_000
"""Records kept (the latest) until the run folder is known."""
_FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s (%(filename)s:%(lineno)d): %(message)s"
_TERMINAL_FORMAT = "[%(asctime)s %(name)s] %(levelname)s: %(message)s"
_COLOURS = re.compile(r"\x1b\[[0-9;]*m")


class _PlainFormatter(logging.Formatter):
    """A formatter for a file: without the terminal colour codes some libraries put in their messages."""

    def format(self, record: logging.LogRecord) -> str:
        return _COLOURS.sub("", super().format(record))


def is_third_party(name: str) -> bool:
    return name in THIRD_PARTY or name.startswith(_UNDER)


def verbose() -> bool:
    """Whether HPCRLHF_VERBOSE asks to show the libraries' output (1) or not (0, empty, unset)."""
    value = os.environ.get(VERBOSE_ENV, "")
    if value not in ("", "0", "1"):
        raise ConfigError(f"{VERBOSE_ENV}={value!r}: use 1 to show the libraries' own output (transformers, DeepSpeed, "
                          "vLLM, warnings) on the terminal, or 0 (or leave it unset) to keep it off")
    return value == "1"


class _Output:
    """Where this process sends the libraries' records: `mode` None (the hpcrlhf command does not
    route them: the libraries' own handlers), "console" (the same, chosen by a run's setting),
    "held" (in memory until the run folder is known), "file" or "dropped". In the last three their
    errors also go to the terminal."""

    ROUTED = ("held", "file", "dropped")

    def __init__(self) -> None:
        self.mode: str | None = None
        self.held: deque[logging.LogRecord] = deque(maxlen=HELD_RECORDS)
        self.path: Path | None = None
        self.terminal: logging.StreamHandler | None = None
        self.told = False
        self.file_format = _PlainFormatter(_FILE_FORMAT)

    def start(self, mode: str) -> None:
        try:  # the terminal as it is now: stderr may point at the run log for a while (third_party_processes)
            stream = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
        except OSError:
            stream = sys.stderr
        self.terminal = logging.StreamHandler(stream)
        self.terminal.setLevel(logging.ERROR)
        self.terminal.setFormatter(logging.Formatter(_TERMINAL_FORMAT, "%H:%M:%S"))
        self.mode, self.path, self.told = mode, None, False
        logging.captureWarnings(True)

    def stop(self) -> None:
        if self.mode is None:
            return
        logging.captureWarnings(False)
        self.mode = None
        self.held.clear()
        if self.terminal is not None and self.terminal.stream is not sys.stderr:
            self.terminal.stream.close()
        self.terminal = None

    def routes(self, name: str) -> bool:
        return self.mode in self.ROUTED and is_third_party(name)

    def handle(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR and self.terminal is not None:
            self.terminal.handle(record)
            self.tell_where_the_rest_is()
        if self.mode == "held":
            self.held.append(record)
        elif self.mode == "file" and record.levelno >= logging.INFO:
            self.write(record)

    def tell_where_the_rest_is(self) -> None:
        if self.told or self.mode == "held":
            return
        self.told = True
        where = (f"the libraries' full output: {self.path}" if self.mode == "file" else
                 f"the libraries' other lines are left out: rerun with {VERBOSE_ENV}=1 to see them")
        self.terminal.stream.write(f"hpcrlhf: {where}\n")

    def write(self, record: logging.LogRecord) -> None:
        try:
            append(self.path, (self.file_format.format(record) + "\n").encode(errors="backslashreplace"))
        except (OSError, HpcrlhfError) as e:  # a full disk, a file swapped for a link: the job goes on
            reason = os_error_reason(e, self.path) if isinstance(e, OSError) else str(e)
            self.mode = "dropped"
            get_logger().warning(f"cannot write {self.path} ({reason}): the libraries' lines below an error are left "
                                 "out from now on")

    def to_file(self, path: Path) -> None:
        self.path, self.mode, self.told = path, "file", False
        logging.captureWarnings(True)  # again after a run that chose the console (the demo's stages)
        rank = int(os.environ.get("RANK", 0))
        self.file_format = _PlainFormatter(_FILE_FORMAT.replace("%(name)s", f"rank {rank} %(name)s") if rank
                                           else _FILE_FORMAT)
        while self.held and self.mode == "file":
            record = self.held.popleft()
            if record.levelno >= logging.INFO:
                self.write(record)

    def to_console(self) -> None:
        """The libraries' own handlers from now on; what was held goes to them now (their errors
        were shown already)."""
        self.mode = "console"
        logging.captureWarnings(False)
        while self.held:
            record = self.held.popleft()
            if record.levelno < logging.ERROR:
                logging.Logger.callHandlers(logging.getLogger(record.name), record)


_output = _Output()


class _RoutedLogger(logging.Logger):
    """A logger that, when it is a library's (`THIRD_PARTY`) and the hpcrlhf command routes their
    output, hands its records to `_output` instead of to the handlers it and its parents have."""

    def callHandlers(self, record: logging.LogRecord) -> None:
        if _output.routes(self.name):
            _output.handle(record)
        else:
            super().callHandlers(record)


def route_third_party(*, run_folder_follows: bool) -> None:
    """The `hpcrlhf` command's first step: the libraries' records (and Python warnings) go to a run
    folder's log (`run_folder_follows`: held until `third_party_to`) or nowhere, their errors to the
    terminal too; nothing changes under HPCRLHF_VERBOSE=1. ConfigError for a bad HPCRLHF_VERBOSE."""
    if verbose() or _output.mode is not None:
        return
    if logging.getLoggerClass() is logging.Logger:
        logging.setLoggerClass(_RoutedLogger)
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if type(logger) is logging.Logger and is_third_party(name):  # made before: a launcher imported Ray, MPI
            logger.__class__ = _RoutedLogger
    _output.start("held" if run_folder_follows else "dropped")


def stop_routing_third_party() -> None:
    """The libraries' own handlers again (for a caller of the CLI's `main` in its own process)."""
    _output.stop()
    if logging.getLoggerClass() is _RoutedLogger:
        logging.setLoggerClass(logging.Logger)  # the loggers made meanwhile stay, and pass records on as ever


def third_party_to(setting: str, path: Path) -> None:
    """Once a run folder is checked: the libraries' output of this process goes to `path` (its
    third_party.log), or with `setting` "console" to the terminal as they print it. Nothing when the
    command does not route it (HPCRLHF_VERBOSE=1, a library call)."""
    if _output.mode is None:
        return
    if setting == "console":
        _output.to_console()
    else:
        _output.to_file(path)


@contextmanager
def third_party_processes(what: str) -> Iterator[None]:
    """Processes started in the block (vLLM's engine core and its workers) write their standard
    output and error, for their whole life, into the run log -- nowhere without a run folder; the
    terminal when nothing is routed. Meanwhile this process's own stdout and stderr point there too
    (the libraries' errors keep the terminal: `_Output.start`). When the block fails, the last lines
    of the log (or how to see them) are logged as an error naming `what`."""
    if _output.mode not in _Output.ROUTED:
        yield
        return
    to_file = _output.mode == "file"
    target = (open_in_place(_output.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT) if to_file
              else os.open(os.devnull, os.O_WRONLY))
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    for fd in (1, 2):
        os.dup2(target, fd)
    os.close(target)
    failed = False
    try:
        yield
    except Exception:
        failed = True
        raise
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd, kept in zip((1, 2), saved):
            os.dup2(kept, fd)
            os.close(kept)
        if failed:
            get_logger().error(f"{what} failed; " + (f"the last lines of {_output.path}:\n{last_lines(_output.path)}"
                                                     if to_file else f"rerun with {VERBOSE_ENV}=1 to see its output"))


def last_lines(path: Path, count: int = 40, most_bytes: int = 16384) -> str:
    """The last `count` lines of a text file (of its last `most_bytes`)."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - most_bytes))
        return "\n".join(f.read().decode(errors="replace").splitlines()[-count:])
