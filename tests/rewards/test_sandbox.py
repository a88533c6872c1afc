"""The sandbox that runs generated programs (`hpcrlhf.rewards.sandbox`), with hostile programs: each
ends within its limits, nothing it started or wrote is left behind, and the host is unaffected;
run as root and as an ordinary user; where the kernel gives no namespaces, it refuses and says why."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from hpcrlhf.rewards.sandbox import Limits, Sandbox, SandboxError
from tests.launch_helpers import ROOT
from tests.rewards.programs import PYTHON, TOKEN, processes_with_token, tagged

LIMITS = Limits(timeout_s=4.0, cpu_time_s=1, memory_mb=256, file_size_mb=2, processes=8)


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A sandbox whose host folders go to `tmp_path/host`, checked empty afterwards."""
    if not os.access(PYTHON, os.X_OK):
        pytest.skip(f"{PYTHON} is needed to run programs as nobody")
    host = tmp_path / "host"
    host.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(host))
    yield Sandbox(PYTHON, LIMITS)
    assert list(host.iterdir()) == []
    assert processes_with_token() == []


def run(sandbox: Sandbox, program: str, stdin: bytes = b""):
    start = time.monotonic()
    outcome = sandbox.run({"solution.py": program}, ["solution.py"], stdin)
    return outcome, time.monotonic() - start


CPU_LIMIT, TIMEOUT = 128 + 9, None
"""How a run past its limits ends: RLIMIT_CPU's hard limit (SIGKILL), or the wall-clock timeout."""
HOSTILE = {  # name: (program, how it may end: exit statuses)
    "infinite loop": (tagged("while True: pass"), {CPU_LIMIT}),
    "sleeps forever": (tagged("import time\ntime.sleep(3600)"), {TIMEOUT}),
    # its forks fail at the process limit and it goes on trying: the CPU limit or the timeout, whichever first
    "fork bomb": (tagged("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"),
                  {CPU_LIMIT, TIMEOUT}),
    "daemon": (tagged("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\nprint('parent done')"),
               {0}),
    "memory hog": ("x = bytearray(10 ** 10)", {1}),  # MemoryError under RLIMIT_AS
    "slow memory hog": ("chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 6))", {1}),
    "huge file": ("open('big', 'w').write('x' * (8 << 20))", {1}),  # RLIMIT_FSIZE: EFBIG (Python ignores SIGXFSZ)
    "huge output": ("while True:\n    print('x' * 4096)", {120}),  # the same, when Python flushes stdout at exit
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_program_ends_within_its_limits_and_leaves_nothing(name, sandbox):
    program, statuses = HOSTILE[name]
    outcome, took = run(sandbox, program)
    assert outcome.exit_status in statuses, (outcome, took)
    assert took < LIMITS.timeout_s + 2, took
    if outcome.exit_status is TIMEOUT:
        assert took >= LIMITS.timeout_s
    assert len(outcome.stdout) <= LIMITS.file_size_mb << 20
    assert processes_with_token() == []  # the daemon and the bomb's processes went with the run
    assert subprocess.run(["true"]).returncode == 0  # and this process can still start one


def test_the_process_count_is_the_runs_own(sandbox):
    program = textwrap.dedent("""
        import os, time
        made = 0
        for _ in range(20):
            try:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                made += 1
            except OSError:
                break
        print(made, flush=True)
        os._exit(0)
    """)
    outcome, _ = run(sandbox, program)
    assert outcome.exit_status == 0 and int(outcome.stdout) == LIMITS.processes - 1  # the program is one


def test_files_go_nowhere_but_the_runs_own_folder(sandbox, open_folder):
    places = [f"/tmp/{TOKEN}", f"/var/tmp/{TOKEN}", f"/dev/shm/{TOKEN}", str(open_folder / TOKEN),
              str(ROOT / TOKEN), os.path.expanduser(f"~/{TOKEN}")]
    program = textwrap.dedent(f"""
        import json, os
        results = {{}}
        for path in {places!r} + [os.path.join(os.environ["HOME"], "mine")]:
            try:
                with open(path, "w") as f:
                    f.write("left behind?")
                results[path] = "written"
            except OSError as e:
                results[path] = e.strerror
        results["folder"] = [os.getcwd(), os.environ["HOME"], os.environ["TMPDIR"], sorted(os.listdir("."))]
        print(json.dumps(results))
    """)
    outcome, _ = run(sandbox, program)
    results = json.loads(outcome.stdout)
    assert results.pop("folder") == ["/tmp", "/tmp", "/tmp", sorted(["solution.py", "mine", TOKEN])]
    # /tmp, /var/tmp and /dev/shm are the run's own folder; everything else is read-only (or not the user's)
    assert all(results[path] == "written" for path in places[:3])
    assert results[places[3]] == "Read-only file system" and not any(results[path] == "written" for path in places[3:])
    assert not any(os.path.exists(path) for path in places) and list(open_folder.iterdir()) == []


def test_no_network_not_even_the_hosts_loopback(sandbox):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(LIMITS.timeout_s + 2)
    accepted = []
    threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True).start()
    port = server.getsockname()[1]
    program = textwrap.dedent(f"""
        import socket
        for address in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("10.1.2.3", 80)]:
            try:
                socket.create_connection(address, timeout=1)
                print(address, "reached")
            except OSError as e:
                print(address, e.strerror)
    """)
    outcome, _ = run(sandbox, program)
    server.close()
    lines = outcome.stdout.decode().splitlines()
    assert len(lines) == 3 and not any("reached" in line for line in lines), lines
    assert "Connection refused" in lines[0] and "Network is unreachable" in lines[1], lines
    assert accepted in ([], [None])


def _accept(server: socket.socket):
    try:
        return server.accept()
    except OSError:
        return None


def test_nothing_of_the_job_reaches_the_program(sandbox, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    outcome, _ = run(sandbox, "import os, sys\nprint(sorted(os.environ), os.getuid(), sys.flags.isolated)")
    names, uid, isolated = outcome.stdout.decode().rsplit(" ", 2)
    assert "HF_TOKEN" not in names and int(isolated) == 1, outcome.stdout
    assert int(uid) != 0


def test_stdin_larger_than_a_pipe_is_read_whole(sandbox):
    data = b"7\n" * 100_000
    outcome, _ = run(sandbox, "import sys\nprint(sum(map(int, sys.stdin.read().split())))", data)
    assert outcome.stdout == b"700000\n"


def test_kill_all_ends_runs_under_way(sandbox):
    done = []
    thread = threading.Thread(target=lambda: done.append(run(sandbox, tagged("import time\ntime.sleep(3600)"))))
    thread.start()
    deadline = time.monotonic() + 3
    while not processes_with_token() and time.monotonic() < deadline:
        time.sleep(0.05)
    sandbox.kill_all()
    thread.join()
    outcome, took = done[0]
    assert outcome.exit_status is not None and outcome.exit_status != 0 and took < LIMITS.timeout_s, (outcome, took)
    with pytest.raises(SandboxError, match="closed"):
        sandbox.run({"solution.py": "print(1)"}, ["solution.py"])
    sandbox.reopen()


AS_USER = textwrap.dedent("""
    import json, os, sys, tempfile
    from hpcrlhf.rewards.sandbox import Limits, Sandbox
    tempfile.tempdir = sys.argv[1]
    sandbox = Sandbox(sys.executable, Limits(4.0, 1, 256, 2, 8))
    out = {}
    for name, program in json.loads(sys.argv[2]).items():
        outcome = sandbox.run({"solution.py": program}, ["solution.py"])
        out[name] = [outcome.exit_status, outcome.stdout.decode()[-300:], outcome.isolation]
    print(json.dumps(out))
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="the tests above run as an ordinary user already")
def test_as_an_ordinary_user_the_run_gets_its_own_namespaces(open_folder):
    """Not root: no user to drop to; the run's user namespace (the user mapped to itself) brings the
    network, PID, mount and IPC namespaces."""
    if not shutil.which("setpriv") or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("setpriv and /usr/bin/python3 are needed to run as the user nobody")
    host = tempfile.mkdtemp(dir="/tmp")  # for the sandbox's folders: one the user nobody may write
    os.chmod(host, 0o777)
    def reported(statement: str) -> str:  # the statement, and the error it meets printed
        return f"try:\n    {statement}\nexcept OSError as e:\n    print(e.strerror)"

    programs = {"bomb": HOSTILE["fork bomb"][0], "daemon": HOSTILE["daemon"][0], "writes": f"open('/var/tmp/{TOKEN}', 'w')",
                "outside": reported(f"open({str(open_folder / TOKEN)!r}, 'w')"),
                "net": "import socket\n" + reported("socket.create_connection(('1.1.1.1', 53), 1)"),
                "ok": "import os\nprint(os.getuid(), os.getcwd())"}
    try:
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
                               AS_USER, host, json.dumps(programs)], env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert os.listdir(host) == []
    finally:
        shutil.rmtree(host)
    got = json.loads(proc.stdout)
    assert got["ok"][:2] == [0, "65534 /tmp\n"]
    assert got["ok"][2] == {"network": "private", "pids": True, "filesystem": "read-only but /tmp", "user": "self",
                            "processes": "per run"}
    assert got["bomb"][0] in HOSTILE["fork bomb"][1] and got["daemon"][0] == 0 and got["writes"][0] == 0
    assert got["outside"][:2] == [0, "Read-only file system\n"] and got["net"][:2] == [0, "Network is unreachable\n"], got
    assert processes_with_token() == [] and list(open_folder.iterdir()) == [] and not os.path.exists(f"/var/tmp/{TOKEN}")


NO_USER_NAMESPACES = textwrap.dedent("""
    import json, os, sys
    from hpcrlhf.namespaces import CLONE_NEWUSER, unshare
    uid, gid = os.getuid(), os.getgid()
    unshare(CLONE_NEWUSER)  # a user namespace of our own (as 1000), in which no further one may be made
    open("/proc/self/uid_map", "w").write(f"1000 {uid} 1")
    open("/proc/self/setgroups", "w").write("deny")
    open("/proc/self/gid_map", "w").write(f"1000 {gid} 1")
    open("/proc/sys/user/max_user_namespaces", "w").write("0")
    from hpcrlhf.rewards.sandbox import Limits, Sandbox, SandboxError
    for allow in (False, True):
        try:
            outcome = Sandbox(sys.executable, Limits(4.0, 1, 256, 2, 8), allow).run({"solution.py": "print('ran')"},
                                                                                     ["solution.py"])
            print(json.dumps([outcome.exit_status, outcome.stdout.decode(), outcome.isolation]))
        except SandboxError as e:
            print(json.dumps(str(e)))
    from hpcrlhf.config.schema import RulesConfig
    from hpcrlhf.errors import ConfigError
    from hpcrlhf.rewards.builtin import build_builtin
    try:
        build_builtin("code", RulesConfig(), "reward.sources[0].rule 'code'")
    except ConfigError as e:
        print(json.dumps(str(e)))
""")


def test_without_user_namespaces_it_refuses_and_says_why_unless_allowed():
    """The `code` rule then fails as the job starts, naming the setting that would let it run."""
    proc = subprocess.run([sys.executable, "-c", NO_USER_NAMESPACES], env={"PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=60)
    if proc.returncode != 0 and "unshare" in proc.stderr:
        pytest.skip(f"no user namespace to simulate the refusal in: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr
    refused, allowed, rule = map(json.loads, proc.stdout.splitlines())
    why = ("a run cannot get a network namespace of its own: the kernel allows no more user namespaces here (sysctl "
           "user.max_user_namespaces is 0 or reached)")
    assert refused == why
    assert rule == (f"rules.code.allow_host_network: {why}; set rules.code.allow_host_network=true to run programs on the "
                    "host's network and filesystem, or run the job where unprivileged user namespaces are allowed "
                    "(reward.sources[0].rule 'code')")
    status, stdout, isolation = allowed
    assert (status, stdout) == (0, "ran\n")
    assert isolation["network"] == "host" and isolation["filesystem"] == "host" and not isolation["pids"]
