"""Session-wide fixtures: an isolated cache (tiny models and tokenizer built once per session),
offline hub settings, and a small CPU thread budget."""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models and the tokenizer are built once into the user's cache (deterministic, keyed by
# builder version); tests that check building itself use their own temporary cache.


@pytest.fixture(scope="session")
def tiny_llama() -> str:
    from hpcrlhf.models.tiny import build_tiny_model_dir

    return str(build_tiny_model_dir("llama"))


def once_per_run(tmp_path_factory, name: str, build):
    """`build(folder)`'s value (a str), computed once for the whole test run -- also when
    pytest-xdist spreads the tests over worker processes: the first worker to ask builds it in a
    folder all of them share, under a lock; the others wait for it and reuse it."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return build(tmp_path_factory.mktemp(name))
    import shutil

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent / "once"  # the run's folder, above each worker's own
    root.mkdir(exist_ok=True)
    done = root / f"{name}.value"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            folder = root / name
            shutil.rmtree(folder, ignore_errors=True)  # a worker failed to build it before
            folder.mkdir()
            done.write_text(build(folder))
        return done.read_text()


@pytest.fixture(scope="session")
def full_sft_run(tmp_path_factory):
    """`hpcrlhf train sft` on the embedded defaults, trained until it adds: stopped early at a task
    score >= 0.97 within two epochs (TensorBoard on): the run folder. The default single epoch
    ends anywhere between 0.86 and 0.96 depending on the CPU (measured), and a reward model
    started from a weaker adder stays near chance for thousands of steps.
    tests/trainers/test_sft_e2e.py checks it learns; the reward model for PPO starts from its model."""
    from tests.launch_helpers import run_cli

    def build(folder):
        run_cli(["train", "sft", "-o", str(folder / "run"), "--set", "train.epochs=2", "--set", "eval.every_steps=50",
                 "--set", "eval.stop_when=eval/task_score>=0.97", "--set", "log.backends=[tensorboard]"])
        return str(folder / "run")

    return Path(once_per_run(tmp_path_factory, "sft_full", build))


def early_stopped_sft(tmp_path_factory, name: str, overrides: tuple[str, ...], below: float) -> str:
    """The model of an SFT run with `overrides` (an `eval.stop_when` on the task score), checked to
    have stopped early with a task score under `below`: the folder of its exported model (one
    run per test run)."""
    import json

    from hpcrlhf.config.jobspec import TrainJob
    from tests.launch_helpers import run_cli

    def build(folder):
        out = folder / "run"
        run_cli(TrainJob("sft", None, (*overrides, "log.backends=[]"), str(out)).argv())
        summary = json.loads((out / "summary.json").read_text())
        assert summary.get("stopped_early") and summary["after"]["eval/task_score"] < below, summary
        return str(out / "model")

    return once_per_run(tmp_path_factory, name, build)


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory) -> str:
    """A partly trained SFT model (task score 0.1-0.3): room left for preference training to help.
    Stopped early on its score, as the step where it gets there depends on the CPU (see
    `hpcrlhf.demo.HALF_TRAINED_SFT`)."""
    from hpcrlhf.demo import SFT_BUDGET

    return early_stopped_sft(tmp_path_factory, "sft_base", (*SFT_BUDGET, "eval.stop_when=eval/task_score>=0.1"), 0.3)


@pytest.fixture(scope="session")
def policy_model(tmp_path_factory) -> str:
    """A half-trained SFT model (task score 0.45-0.65) for online RL: it answers about half the
    held-out problems, so sampled groups contain both right and wrong answers to learn from. The
    demo's SFT stage (`hpcrlhf.demo.HALF_TRAINED_SFT`: stopped early at a task score of 0.45, as no
    fixed step count gives ~0.5 on every CPU)."""
    from hpcrlhf.demo import HALF_TRAINED_SFT

    return early_stopped_sft(tmp_path_factory, "policy_base", HALF_TRAINED_SFT, 0.65)


@pytest.fixture(scope="session")
def slurm_cluster():
    """One local Slurm cluster (2 nodes x 4 fake GPUs, tests/slurm_cluster.py). Without root or the
    Slurm packages the tests asking for it skip and say why; under CI (CI=true) they fail instead,
    so the Slurm tests can never silently stop running there."""
    import tempfile

    from tests.slurm_cluster import start_slurm_cluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Slurm tests, but {reason}")
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="slurm", dir="/tmp"))
    cluster = start_slurm_cluster(base, num_nodes=2, gpus_per_node=4)
    try:
        yield cluster
    finally:
        cluster.stop()


ONE_WORKER = ("tests/cluster/", "tests/hpc/")
"""Under pytest-xdist these run in one worker: the local Ray cluster of tests/cluster, the Slurm
cluster and the CPU image are started once per worker process, and the Slurm cluster's ports and
nodes exist once per host."""

LONG_FIRST = (*ONE_WORKER, "tests/trainers/", "tests/run/", "tests/bench/", "tests/engines/", "tests/test_")
"""Where the tests that run whole jobs live, in the order a worker should start them: long work
first, the unit tests (seconds each) last, to fill the gaps, so that no worker is left with one
long module at the end."""


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to (what one worker runs whole): its module, or the ONE_WORKER
    folders together."""
    path = nodeid.split("::", 1)[0]
    return "+".join(ONE_WORKER) if path.startswith(ONE_WORKER) else path


def _rank(path: str) -> int:
    return next((i for i, prefix in enumerate(LONG_FIRST) if path.startswith(prefix)), len(LONG_FIRST))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """In a pytest-xdist worker: the tests in LONG_FIRST's order (a stable sort: each module's own
    order is kept), which the scheduler below hands out in."""
    if hasattr(config, "workerinput"):
        root = Path(config.rootpath)
        items.sort(key=lambda item: _rank(Path(str(item.fspath)).relative_to(root).as_posix()))


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist is not installed: pytest runs the tests in one process
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:
    class ModuleScheduling(LoadScopeScheduling):
        """`make test`'s scheduling (`-n 2`): each module is one unit of work, run whole by one
        worker (its module fixtures built once), and the ONE_WORKER folders are one unit together;
        units go out in collection order (LONG_FIRST). Session fixtures that train a model are
        shared by the workers through `once_per_run`."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # keep LONG_FIRST's order, not the largest unit first

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    def pytest_xdist_make_scheduler(config, log):
        return ModuleScheduling(config, log)


_seconds: dict[tuple[str, str], float] = {}
"""(worker, unit) -> seconds its tests' setup, call and teardown took, for the summary below."""


_config: pytest.Config | None = None


def pytest_configure(config) -> None:
    global _config
    _config = config


def pytest_runtest_logreport(report) -> None:
    node = getattr(report, "node", None)  # under pytest-xdist: the worker that ran it
    worker = node.gateway.id if node is not None else os.environ.get("PYTEST_XDIST_WORKER", "main")
    key = (worker, unit_of(report.nodeid))
    _seconds[key] = _seconds.get(key, 0.0) + report.duration
    if report.failed and _config is not None and not hasattr(_config, "workerinput"):
        _name_at_once(report)


def _name_at_once(report) -> None:
    """A failure is named the moment it happens (`-q` prints only its letter until the end): a run
    cut short by CI's time limit still says what failed, in which phase, after how long."""
    reporter = _config.pluginmanager.get_plugin("terminalreporter") if _config is not None else None
    if reporter is None:
        return
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    why = crash.message.splitlines()[0][:300] if crash is not None and crash.message else ""
    reporter.write_line(f"\nfailed: {report.nodeid} ({report.when}, {report.duration:.0f} s) {why}")


def pytest_terminal_summary(terminalreporter, config) -> None:
    """Where the run's time went, by worker and by unit of work: the run lasts as long as its busiest
    worker, and the largest units are what to shorten or split first (CI's time budget, docs/tests.md)."""
    if hasattr(config, "workerinput") or not _seconds:
        return
    by_worker: dict[str, float] = {}
    for (worker, _), s in _seconds.items():
        by_worker[worker] = by_worker.get(worker, 0.0) + s
    terminalreporter.section("test time by worker and unit")
    for worker, s in sorted(by_worker.items()):
        terminalreporter.write_line(f"{worker}: {s:7.0f} s in tests")
    for (worker, unit), s in sorted(_seconds.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{s:7.0f} s  {worker}  {unit}")


WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
_ignored_at_start = {sig: signal.getsignal(sig) is signal.SIG_IGN for sig in WATCHED_SIGNALS}


@pytest.fixture(autouse=True)
def signals_left_usable(request):
    """No test (or library it runs in this process) may leave a watched signal ignored or blocked
    that was not so when the session started: CLI runs started later would inherit it (an ignored
    SIGINT: Ctrl-C does nothing). What a test leaves is undone here and named in the output. (A
    session started in a script's background has SIGINT ignored from the start: that is kept, and
    tests/run/test_signals sets its own.)"""
    yield
    leaks = []
    for sig in WATCHED_SIGNALS:
        handler = signal.getsignal(sig)
        if handler is signal.SIG_IGN and not _ignored_at_start[sig]:
            handler = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            leaks.append(f"{sig.name} ignored")
        if handler is not None:  # set again: also undoes a disposition C code changed behind Python's back
            signal.signal(sig, handler)
    blocked = set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) & set(WATCHED_SIGNALS)
    if blocked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
        leaks.append(f"{', '.join(sorted(s.name for s in blocked))} blocked")
    if leaks:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        message = f"{request.node.nodeid} left {'; '.join(leaks)} in the test process (restored)"
        if reporter is not None:
            reporter.write_line(f"\nsignals: {message}")
        warnings.warn(message, stacklevel=2)


def pytest_collection_finish(session) -> None:
    """A session that will need hpcrlhf's CPU image (~16 min of CPU to build when its stack changed:
    tests/images.py) starts building it now, in the background, so that the build overlaps the
    tests before the first one that needs it instead of adding to the run."""
    if any("cpu_image" in getattr(item, "fixturenames", ()) for item in session.items):
        from tests.images import start_cpu_image_build, unavailable_reason

        if unavailable_reason() is None:
            start_cpu_image_build()


def pytest_sessionfinish(session, exitstatus) -> None:
    from tests.images import stop_cpu_image_build

    worker = os.environ.get("PYTEST_XDIST_WORKER")  # another worker may still wait for its build
    stop_cpu_image_build(needed_elsewhere=worker is not None and exitstatus != pytest.ExitCode.INTERRUPTED)


@pytest.fixture(scope="session")
def cpu_image() -> str:
    """hpcrlhf's CPU Apptainer image, built from apptainer/hpcrlhf-cpu.def by apptainer/build.sh
    and kept, keyed by the digest of its stack (tests/images.py), in ~/.cache/hpcrlhf-tests/ (a
    rerun with the same stack reuses it). Without apptainer the tests asking for it skip; under CI
    they fail."""
    from tests.images import build_cpu_image, unavailable_reason

    reason = unavailable_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the container tests, but {reason}")
        pytest.skip(reason)
    return str(build_cpu_image())


@pytest.fixture(scope="session")
def in_image(cpu_image) -> list[str]:
    """The options that run a job inside the CPU image with the checkout's hpcrlhf (bound over the
    image's copy: tests/images.py)."""
    from tests.images import checkout_bind

    return ["--container", cpu_image, "--bind", checkout_bind(Path(cpu_image))]
