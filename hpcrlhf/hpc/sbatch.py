"""`hpcrlhf sbatch`: one complete, readable sbatch script for an hpcrlhf job.

`render_sbatch(args, options)` is a pure function of the job's `hpcrlhf` arguments and the Slurm
options (golden files pin its output). The script:

1. asks for the allocation (#SBATCH: nodes, GPUs per node, time, partition/account/qos, output
   into the run folder, `--signal=B:USR1@<lead>` so a time limit warns the batch shell first,
   `--requeue`);
2. sets the environment of offline compute nodes (HF offline, caches on shared storage; nothing
   is installed at job time);
3. checks that the job fits the allocation it got (node map vs nodes x GPUs) before anything
   starts: a wrong shape ends the job in seconds with the reason in its log;
4. launches: `ray` -- one Ray node per allocated node (`srun`; head on the first, ports from the
   job id, token authentication with the token in the job's environment only, dashboard off) and
   the driver on the first node, which waits until every node has joined (naming missing ones) and
   trains; `mpi` -- one rank per GPU with `srun --mpi=pmix python -m hpcrlhf.hpc.mpi`;
5. forwards USR1/TERM to the driver (it checkpoints after its current step and exits 3), tears Ray
   down, and requeues itself when stopped on request, or when the run lost a worker or node (exit
   4; under `mpi`, also a rank srun reports killed by a signal or lost with its node), while
   `SLURM_RESTART_COUNT` < max_requeues.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, fields
from typing import Literal
from collections.abc import Sequence

from hpcrlhf import __version__
from hpcrlhf.errors import ConfigError
from hpcrlhf.placement.layout import MAX_GPUS_PER_NODE, MAX_NODES

LAUNCHERS = ("ray", "mpi")
SLURM_NAME = re.compile(r"[A-Za-z0-9_.+-]{1,128}", re.ASCII)
"""A job name, partition, account or QOS as written into `#SBATCH` lines: letters, digits, `_ . + -`, at
most 128 characters (a conservative subset of what Slurm accepts: no spaces, quotes, `#` or newlines,
which would end or add lines)."""
MAX_TIME_DAYS = 365
"""The longest --time accepted (Slurm takes more, but no partition allows it; a larger value is a typo)."""
HET_WORDS = ("hetjob", "packjob")
"""sbatch starts a new heterogeneous job component at any `#SBATCH` line containing one of these words
(any case, even inside a value), and blanks `packjob` out of the line."""
HET_WHY = (f"sbatch reads {' or '.join(HET_WORDS)} anywhere in an #SBATCH line as the start of a heterogeneous job "
           "component")


def _has_control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def _has_het_word(text: str) -> bool:
    return any(word in text.lower() for word in HET_WORDS)


def path_problem(path: str, *, in_sbatch_line: bool = False, bound: bool = False) -> str | None:
    """Why `path` cannot be written into the job (None: it can). Every path is shell-quoted (`shlex.quote`)
    wherever the script uses it; what quoting cannot carry is refused: control characters (a newline
    ends a script line) and, for a path in an `#SBATCH` line (the run folder, in `--output`), what sbatch's
    own parser and file-name patterns would change: a backslash (an escape there, and it turns off
    `%j`), `%` (a pattern, like `%j`) and the words that start a heterogeneous job component. sbatch
    reads quoted values there as a shell does (single or double quotes, concatenated)."""
    if not path.startswith("/"):
        return "give an absolute path on shared storage"
    if _has_control(path):
        return "a path with control characters (a newline, a tab) cannot be written into the script; rename the folder"
    if in_sbatch_line:
        if "\\" in path or "%" in path:
            return ("Slurm reads `\\` and `%` in an #SBATCH --output path as an escape and a file-name pattern (%j); "
                    "use a folder without them")
        if _has_het_word(path):
            return f"{HET_WHY}; use a folder without those words"
    if bound and ("," in path or ":" in path):
        return "Apptainer's --bind splits paths at `,` and `:`; use a folder without them"
    return None


@dataclass(frozen=True)
class SlurmOptions:
    """How a job is asked of Slurm (`hpcrlhf sbatch` and `hpcrlhf submit` share these)."""

    nodes: int
    gpus_per_node: int
    run_dir: str
    """The job's run folder (Slurm log, metrics, checkpoints): an absolute path on shared storage."""
    launcher: Literal["ray", "mpi"] = "ray"
    time: str = "24:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    job_name: str = "hpcrlhf"
    cpus_per_gpu: int | None = None
    container: str | None = None
    """An Apptainer image (.sif) every step runs in."""
    binds: tuple[str, ...] = ()
    """Folders bound into the container besides the run folder and caches (`SRC` or `SRC:DST`):
    the recipe's local model/data folders (added by `cluster_job`) and `--bind` ones."""
    cache_dir: str | None = None
    """Shared folder for HF_HOME and HPCRLHF_CACHE (default: $HOME/.cache)."""
    python: str = "python"
    """The Python (with hpcrlhf installed) on the compute nodes, or inside the container."""
    signal_lead_s: int = 300
    """Seconds between the time-limit signal and the kill: room to finish a step and checkpoint."""
    max_requeues: int = 3

    def __post_init__(self) -> None:
        def require(ok: bool, name: str, value: object, fix: str) -> None:
            if not ok:
                raise ConfigError(f"--{name.replace('_', '-')}: {value!r} is invalid: {fix}")

        require(1 <= self.nodes <= MAX_NODES, "nodes", self.nodes, f"use 1 to {MAX_NODES:,}")
        require(1 <= self.gpus_per_node <= MAX_GPUS_PER_NODE, "gpus_per_node", self.gpus_per_node,
                f"use 1 to {MAX_GPUS_PER_NODE}")
        for name, option in (("run_dir", "output_dir"), ("cache_dir", "cache_dir"), ("container", "container")):
            path = getattr(self, name)
            problem = None if path is None else path_problem(path, in_sbatch_line=name == "run_dir",
                                                             bound=bool(self.container) and name != "container")
            require(problem is None, option, path, problem or "")
        require(self.launcher in LAUNCHERS, "launcher", self.launcher, f"use one of {', '.join(LAUNCHERS)}")
        require(isinstance(self.time, str) and bool(re.fullmatch(r"([0-9]{1,6}-)?[0-9]{1,9}(:[0-9]{2}){0,2}", self.time))
                and 1 <= self.time_minutes <= MAX_TIME_DAYS * 1440, "time", self.time,
                f"use Slurm's format, e.g. 24:00:00, 2-00:00:00 or 90 (minutes), from 1 minute to {MAX_TIME_DAYS} days")
        for name in ("job_name", "partition", "account", "qos"):
            value, names = getattr(self, name), "names, comma-separated" if name == "partition" else "name"
            parts = value.split(",") if name == "partition" and isinstance(value, str) else [value]
            require(value is None or all(isinstance(v, str) and SLURM_NAME.fullmatch(v) for v in parts), name, value,
                    f"use a Slurm {name.replace('_', ' ')}: {names} of letters, digits, _ . + - (at most 128 "
                    "characters; no spaces, quotes or newlines)")
            require(value is None or not _has_het_word(value), name, value, f"{HET_WHY}; choose another name")
        require(30 <= self.signal_lead_s <= 3600, "signal_lead_s", self.signal_lead_s,
                "give the job 30-3600 s between the signal and the time limit to checkpoint")
        lead, limit_s = self.signal_lead_s, self.time_seconds
        shorter = f"--signal-lead-s {limit_s // 2} or less, or " if limit_s // 2 >= 30 else ""
        require(lead <= limit_s // 2, "signal_lead_s", lead,
                f"the stop signal would come {lead} s before the end of --time {self.time} ({limit_s} s), "
                f"{'at once' if lead >= limit_s else f'after only {limit_s - lead} s of work'}; keep the lead at most "
                f"half the time limit: use {shorter}--time {-(-2 * lead // 60)} (minutes) or more")
        require(self.max_requeues >= 0, "max_requeues", self.max_requeues, "use 0 (never) or more")
        require(self.cpus_per_gpu is None or self.cpus_per_gpu >= 1, "cpus_per_gpu", self.cpus_per_gpu, "use 1 or more")
        require(not self.binds or bool(self.container), "bind", list(self.binds),
                "bind folders only together with --container IMAGE.sif")
        for bind in self.binds:
            require(all(part.startswith("/") for part in bind.split(":")[:2]) and bind.count(":") <= 2, "bind", bind,
                    "use SRC or SRC:DST (absolute paths), optionally with :ro")
            require("," not in bind and not _has_control(bind), "bind", bind,
                    "use paths without commas (Apptainer splits --bind at them) or control characters")
        require(not _has_control(self.python), "python", self.python, "name a Python without control characters")

    @property
    def tasks_per_node(self) -> int:
        return 1 if self.launcher == "ray" else self.gpus_per_node

    @property
    def time_seconds(self) -> int:
        """`time` in seconds (Slurm's formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S)."""
        days, _, rest = self.time.rpartition("-")
        parts = [int(p) for p in rest.split(":")]
        if days:
            h, m, s = (parts + [0, 0])[:3]
            return ((int(days) * 24 + h) * 60 + m) * 60 + s
        if len(parts) == 3:
            return (parts[0] * 60 + parts[1]) * 60 + parts[2]
        return parts[0] * 60 + (parts[1] if len(parts) == 2 else 0)

    @property
    def time_minutes(self) -> int:
        """`time` in minutes, a started minute counting whole."""
        return -(-self.time_seconds // 60)


def option_names() -> list[str]:
    return [f.name for f in fields(SlurmOptions)]


def _q(text: str) -> str:
    return shlex.quote(text)


def _dq(text: str) -> str:
    """`text` for inside a double-quoted shell string (a message naming a path)."""
    return re.sub(r'([\\"$`])', r"\\\1", text)


def _header(o: SlurmOptions) -> list[str]:
    """The #SBATCH lines. Values are quoted as a shell would (sbatch's parser reads single and double
    quotes the same way); SlurmOptions has refused what no quoting carries (see `path_problem`)."""
    lines = [f"--job-name={_q(o.job_name)}", f"--nodes={o.nodes}", f"--ntasks-per-node={o.tasks_per_node}",
             f"--gpus-per-node={o.gpus_per_node}", f"--time={o.time}", f"--output={_q(o.run_dir + '/slurm-%j.out')}",
             "--open-mode=append", f"--signal=B:USR1@{o.signal_lead_s}", "--requeue"]
    if o.cpus_per_gpu:
        lines.append(f"--cpus-per-gpu={o.cpus_per_gpu}")
    lines += [f"--{k}={_q(v)}" for k, v in (("partition", o.partition), ("account", o.account), ("qos", o.qos)) if v]
    return [f"#SBATCH {line}" for line in lines]


CONTAINER_ENV = {"PYTHONNOUSERSITE": "1", "PYTHONPATH": "", "PYTHONSAFEPATH": "1"}
"""Set inside the container: the host's user site-packages, PYTHONPATH and the submission folder
(Apptainer binds it as the working directory; `python -m` would import a checkout there first)
must not shadow the image's packages. Everything else is inherited (Slurm's and PMIx's per-task
variables, CUDA's device list, HF_*/HPCRLHF_* settings, Ray's token)."""


def exec_prefix(o: SlurmOptions) -> str:
    """How each step starts Python: directly, or inside the Apptainer image (`container_setup`)."""
    return f'"${{container[@]}}" {_q(o.python)}' if o.container else _q(o.python)


def container_setup(o: SlurmOptions) -> list[str]:
    """Shell lines (after `offline_env`): the image checked on the node, then `container`, the
    command prefix every step runs under."""
    if not o.container:
        return []
    binds = ",".join([_q(o.run_dir), '"$HF_HOME"', '"$HPCRLHF_CACHE"', *(_q(b) for b in o.binds)])
    env = ",".join(f"{k}={v}" for k, v in CONTAINER_ENV.items())
    probe = "import hpcrlhf"
    return ["# Every step runs inside the Apptainer image: --nv where the node has NVIDIA GPUs; bound: the run folder,",
            "# the caches and the recipe's local model/data folders; the host's Python settings are kept out.",
            f"image={_q(o.container)}",
            'if [ ! -r "$image" ]; then',
            '  echo "hpcrlhf: container image $image is missing or unreadable on $(hostname): put it on shared storage" \\',
            '       "readable by the job, or build one with apptainer/build.sh" >&2',
            "  exit 2",
            "fi",
            'mkdir -p "$HF_HOME" "$HPCRLHF_CACHE"',
            "nv=(); [ -e /dev/nvidiactl ] && nv=(--nv)",
            f'container=(apptainer exec "${{nv[@]}}" --bind {binds} --env {env} "$image")',
            f'if ! "${{container[@]}}" {_q(o.python)} -c {_q(probe)}; then',
            f'  echo "hpcrlhf: $image cannot run {_dq(o.python)} -c \'{probe}\': the image has no hpcrlhf; build it with" \\',
            '       "apptainer/build.sh, or name the image\'s Python with --python" >&2',
            "  exit 2",
            "fi"]


def offline_env(o: SlurmOptions) -> list[str]:
    """Shell lines: the environment of offline compute nodes."""
    cache = _q(o.cache_dir) if o.cache_dir else "$HOME/.cache"  # ${X:-word} removes the quotes
    return ["# Offline compute nodes: models, data and caches come from shared storage; nothing is installed here.",
            "export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1",
            f"export HF_HOME=${{HF_HOME:-{cache}/huggingface}} HPCRLHF_CACHE=${{HPCRLHF_CACHE:-{cache}/hpcrlhf}}",
            "export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false"]


def ray_token_env(o: SlurmOptions) -> list[str]:
    """Shell lines: Ray token authentication. The token is $RAY_AUTH_TOKEN when the user exported one,
    else a fresh random one made here, and it lives in the job's environment only: srun hands it to
    every node's task, and /proc shows a process's environment to its user alone. It is never written
    to a file: one in the run folder, named after the (sequential, so predictable) job id, could have
    been created there beforehand by anyone who can write the folder, readable to all or as a link
    sending the token elsewhere."""
    return ["export RAY_AUTH_MODE=token",
            "unset RAY_AUTH_TOKEN_PATH",
            "if [ -z \"${RAY_AUTH_TOKEN:-}\" ]; then",
            "  RAY_AUTH_TOKEN=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n')",
            "  [ ${#RAY_AUTH_TOKEN} -eq 64 ] || { echo \"hpcrlhf: no Ray token: cannot read /dev/urandom\" >&2; exit 2; }",
            "  export RAY_AUTH_TOKEN",
            "fi"]


NODES_GONE_GRACE_S = 45
"""Seconds a Ray driver has to end by itself once the Ray nodes' step has ended (Ray's health checks declare a
dead node within 10-30 s, and the driver then names it and exits 4) before the script stops it."""


def render_sbatch(args: Sequence[str], o: SlurmOptions) -> str:
    """The sbatch script running `hpcrlhf <args>` with options `o`."""
    py = exec_prefix(o)
    job = " ".join(_q(a) for a in args)
    shown = job.replace("\r", "\\r").replace("\n", "\\n")  # a newline would end the comment: a command, or the header
    out = ["#!/bin/bash", f"# Written by hpcrlhf {__version__}: hpcrlhf {shown}", *_header(o), "",
           "set -uo pipefail", "",
           *offline_env(o), "",
           *(container_setup(o) + [""] if o.container else []),
           "# The job must fit the allocation Slurm gave it (node map vs nodes x GPUs): fail now, not mid-start.",
           f"{py} -m hpcrlhf.hpc.allocation {o.launcher} {job} || exit 2", ""]
    if o.launcher == "ray":
        out += ["# Ray over the allocation: a node per host (head on the first; ports from the job id, so jobs",
                "# sharing a host never collide), token authentication (the token in the job's environment only,",
                "# never in a file), dashboard off.",
                *ray_token_env(o),
                f"srun --overlap --ntasks-per-node=1 --kill-on-bad-exit=1 {py} -m hpcrlhf.hpc.ray_slurm node &",
                "nodes_pid=$!", "",
                "# The driver, on this (the first) node: waits until every node has joined, then trains.",
                f"{py} -m hpcrlhf.hpc.ray_slurm driver {job} &"]
    else:
        out += ["# One MPI rank per GPU; ranks find each other through PMIx and train over NCCL (gloo on CPU). srun's",
                "# own lines are also kept aside: they tell a lost rank from a failed one (below).",
                'srun_log=$(mktemp); exec 3> >(tee >(grep --line-buffered "^srun: " > "$srun_log") >&2); tee_pid=$!',
                f"srun --mpi=pmix --kill-on-bad-exit=1 {py} -m hpcrlhf.hpc.mpi {job} 2>&3 &"]
    out += ["driver_pid=$!", "",
            "# Time limit (USR1, from --signal) or preemption (TERM): the driver finishes its step, checkpoints and",
            "# exits 3.",
            "stop_requested=0",
            "trap 'stop_requested=1; kill -USR1 $driver_pid 2>/dev/null' USR1 TERM"]
    if o.launcher == "ray":
        out += ["# The Ray nodes' step ends only when the script ends it: if it ends first (a node's Ray processes died;",
                f"# srun ended the other nodes), the driver gets {NODES_GONE_GRACE_S} s to notice and exit by itself (naming what",
                "# died), then is stopped -- TERM, KILL 30 s later -- rather than left waiting on a cluster that is gone",
                "# with the allocation held; the job counts as lost (4).",
                "nodes_ended=0",
                "while kill -0 $driver_pid 2>/dev/null; do",
                "  if ! kill -0 $nodes_pid 2>/dev/null; then",
                "    wait $nodes_pid; nodes_status=$?; nodes_ended=1",
                "    echo \"hpcrlhf: the Ray nodes' step ended (status $nodes_status) while the driver was running\"",
                f"    for _ in $(seq {NODES_GONE_GRACE_S}); do kill -0 $driver_pid 2>/dev/null || break; sleep 1; done",
                "    if kill -0 $driver_pid 2>/dev/null; then",
                f"      echo \"hpcrlhf: the driver still runs {NODES_GONE_GRACE_S} s later: stopping it\"",
                "      kill -TERM $driver_pid 2>/dev/null",
                "      for _ in $(seq 30); do kill -0 $driver_pid 2>/dev/null || break; sleep 1; done",
                "      kill -KILL $driver_pid 2>/dev/null",
                "    fi",
                "    break",
                "  fi",
                "  sleep 2 & wait $!  # (a wait the USR1/TERM trap interrupts at once)",
                "done"]
    out += ["wait $driver_pid; status=$?",
            "while kill -0 $driver_pid 2>/dev/null; do wait $driver_pid; status=$?; done", ""]
    if o.launcher == "ray":
        out += ["if [ $nodes_ended -eq 1 ] && [ $status -ne 0 ] && [ $status -ne 3 ]; then",
                "  echo \"hpcrlhf: a Ray node was lost (driver status $status, taken as 4)\"",
                "  status=4",
                "fi",
                "kill $nodes_pid 2>/dev/null; wait $nodes_pid 2>/dev/null", ""]
    else:
        out += ["# srun ends every rank once one fails (143 when it had to TERMinate them) and names first the task that",
                "# ended the step: one SIGKILLed (by the admin, a node health check, a test) or lost with its node is a",
                "# lost worker, as exit 4 of a Ray job; any other failure (a traceback, out of memory) stays a failure.",
                "exec 3>&-; wait $tee_pid 2>/dev/null",
                "first=$(grep -m1 -E 'task [0-9]+: |Node failure' \"$srun_log\"); rm -f \"$srun_log\"",
                "if [ $status -ne 0 ] && [ $status -ne 3 ]; then",
                "  case \"$first\" in",
                "    *\": Killed\"|*\"Node failure\"*)",
                "      echo \"hpcrlhf: ${first#srun: error: }: a rank was lost (srun status $status, taken as 4)\"",
                "      status=4;;",
                "    *\"Exited with exit code 4\")  # a rank's watchdog ended a hang, or it lost a worker",
                "      echo \"hpcrlhf: ${first#srun: error: }: a rank hung or lost a worker (srun status $status, taken as 4)\"",
                "      status=4;;",
                "  esac",
                "fi", ""]
    out += ["# Exit 3: stopped on request after checkpointing. After a stop request any failure also requeues (srun",
            "# may report a rank it ended after another exited 3). Exit 4: a worker or a whole node was lost; Slurm",
            "# starts the requeued job once the lost node is back or on other nodes (never on one it marked down).",
            "# Either way the job resumes from its last checkpoint.",
            "stopped=$(( status == 3 || (stop_requested == 1 && status != 0) )); resume=$(( stopped || status == 4 ))",
            f"if [ $resume -eq 1 ] && [ \"${{SLURM_RESTART_COUNT:-0}}\" -lt {o.max_requeues} ]; then",
            "  if [ $stopped -eq 1 ]; then",
            "    echo \"hpcrlhf: checkpointed on request (status $status); requeueing job $SLURM_JOB_ID\"",
            "  else",
            "    echo \"hpcrlhf: lost a worker or node (status 4); requeueing job $SLURM_JOB_ID to resume\"",
            "  fi",
            "  scontrol requeue $SLURM_JOB_ID",
            "elif [ $resume -eq 1 ]; then",
            f"  echo \"hpcrlhf: not requeued: already requeued {o.max_requeues} time(s) (--max-requeues)\"",
            "fi",
            "exit $status", ""]
    return "\n".join(out)
