"""Where a CI run's CPU goes: samples /proc every second and adds each process's CPU time since the
last sample to the kind of process it is (pytest worker, Ray daemon, Ray actor by class, vLLM engine,
Slurm daemon, compiler, ...). On SIGTERM or SIGINT it prints the table, largest first.

    python .ci/cpu_by_process.py [SECONDS_BETWEEN_SAMPLES]

A process that lives less than one interval is missed (compiler jobs partly): the table is a lower
bound per kind, good for seeing which kinds cost the most core-seconds."""

from __future__ import annotations

import functools
import os
import re
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
KINDS = [  # (pattern searched in the command line, kind); first match wins
    (r"^ray::(\w+)", None),  # Ray actors and tasks: the class or function name
    (r"^\S*raylet ", "ray: raylet"), (r"^\S*gcs_server ", "ray: gcs_server"),  # before: the raylet's names the worker's
    (r"default_worker\.py", "ray: worker starting"), (r"dashboard/agent", "ray: dashboard agent"),
    (r"log_monitor", "ray: log_monitor"), (r"monitor\.py", "ray: autoscaler monitor"),
    (r"runtime_env/agent", "ray: runtime_env agent"),
    (r"hpcrlhf\.cluster\.reaper|cluster/reaper", "hpcrlhf: reaper"),
    (r"slurmctld", "slurm: slurmctld"), (r"slurmd\b", "slurm: slurmd"), (r"slurmstepd", "slurm: slurmstepd"),
    (r"slurmdbd", "slurm: slurmdbd"), (r"munged", "munge"), (r"mariadbd|mysqld", "mariadb"),
    (r"apptainer|squashfs|mksquashfs|unsquashfs|starter", "apptainer"),
    (r"\bpip\b|pip install", "pip"), (r"\b(orted|prterun|mpirun|prted)\b", "openmpi"),
    (r"torchrun|torch\.distributed\.run", "torchrun agent"), (r"deepspeed", "deepspeed launcher"),
    (r"-m hpcrlhf|bin/hpcrlhf |hpcrlhf\.cli", "hpcrlhf CLI (fresh)"),
    (r"tests\.cli_forks|cli_forks", "hpcrlhf CLI (forked) + warm process"),
    (r"VLLM|EngineCore|vllm", "vllm: engine"),
    (r"exec\(eval\(sys\.stdin|xdist|execnet", "pytest worker"), (r"pytest", "pytest main"),
    (r"multiprocessing\.spawn|multiprocessing\.forkserver", "python multiprocessing child"),
]


COMPILERS = {"cc1plus", "cc1", "c++", "g++", "gcc", "ninja", "ld", "collect2", "as", "x86_64-linux-gnu-g++"}


@functools.lru_cache(maxsize=4096)
def kind_of(cmdline: str, comm: str) -> str:
    cmdline = cmdline.strip()
    if comm in COMPILERS:
        return "compiler"
    for pattern, kind in KINDS:
        m = re.search(pattern, cmdline)
        if m:
            return kind or f"ray actor/task: {m.group(1)}"
    return f"other: {' '.join(cmdline.split()[:3])[:80]}"


def sample(last: dict[int, int], totals: dict[str, float]) -> None:
    """Add each process's CPU time since the last sample (`last`: pid -> ticks then) to its kind's total.
    The kind is read anew each time: Ray workers and vLLM's processes retitle themselves."""
    seen: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            ticks = int(fields[11]) + int(fields[12])  # utime + stime
            raw = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        before = last.get(pid, 0)
        totals[kind_of(raw or comm, comm)] += (ticks - (before if before <= ticks else 0)) / TICK  # else a reused pid
        seen[pid] = ticks
    last.clear()
    last.update(seen)


def main() -> None:
    interval = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    last: dict[int, int] = {}
    totals: dict[str, float] = defaultdict(float)
    start = time.monotonic()
    sample(last, totals)
    totals.clear()  # what ran before the first sample is not this run's

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    while not stop:
        time.sleep(interval)
        sample(last, totals)
    wall = time.monotonic() - start
    total = sum(totals.values())
    print(f"cpu by process kind over {wall:.0f} s: {total:.0f} core-seconds ({total / wall:.2f} cores busy)")
    for kind, secs in sorted(totals.items(), key=lambda kv: -kv[1])[:40]:
        print(f"  {secs:8.0f} s  {100 * secs / max(total, 1e-9):5.1f} %  {kind}")


if __name__ == "__main__":
    main()
