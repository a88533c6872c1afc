"""`hpcrlhf sbatch`: rendered scripts pinned as golden files (slurm/examples/, which double as the
reference scripts users read), and the checks made before anything is written.

Run with HPCRLHF_UPDATE_GOLDEN=1 to rewrite the golden files after an intended change, then review
the diff.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrlhf.cli import main
from hpcrlhf.errors import ConfigError, PlacementError
from hpcrlhf.hpc.job import cluster_job
from hpcrlhf.cluster.local import LOCAL_PORT_BASE
from hpcrlhf.hpc.ray_slurm import PORT_SLOTS, job_ports
from hpcrlhf.hpc.sbatch import SlurmOptions, ray_token_env, render_sbatch
from hpcrlhf.hpc.submit import ClusterTask, executor
from tests.placement.test_golden import SCALE_70B_16X8
from tests.placement.test_nodemap import HYBRID_1X8

GOLDEN = Path(__file__).resolve().parents[2] / "slurm" / "examples"
CONTAINER = {"container": "/shared/images/hpcrlhf-gpu.sif", "cache_dir": "/shared/cache"}
SITE = {"partition": "gpu", "account": "alignment", "qos": "high", "time": "2-00:00:00", "cpus_per_gpu": 12}
ONE_NODE = ["placement.nodes=1", "placement.gpus_per_node=8"]
CASES = {  # name: (kind, recipe, overrides, slurm options)
    "1x8-mpi-sft": ("sft", None, ["model.path=/shared/models/llama-7b"], {"nodes": 1, "gpus_per_node": 8}),
    "1x8-ray-ppo-7b-hybrid": ("ppo", "ppo-7b", HYBRID_1X8 + ONE_NODE[1:], {}),
    "2x8-ray-ppo-7b": ("ppo", "ppo-7b", [], {}),
    "2x8-ray-ppo-7b-container": ("ppo", "ppo-7b", [], CONTAINER),
    "4x8-mpi-dpo-container": ("dpo", None, ["model.path=/shared/models/llama-13b"],
                              {"nodes": 4, "gpus_per_node": 8, **CONTAINER, **SITE}),
    "4x8-ray-ppo-13b": ("ppo", "ppo-13b", [], SITE),
    "16x8-ray-ppo-70b-container": ("ppo", "ppo-70b", ["placement.nodes=16"] + SCALE_70B_16X8,
                                   {**CONTAINER, **SITE, "max_requeues": 10}),
    "16x8-mpi-kto": ("kto", None, ["model.path=/shared/models/llama-70b"], {"nodes": 16, "gpus_per_node": 8}),
}


@pytest.fixture(autouse=True)
def images_exist(monkeypatch):
    """The goldens' image paths are a cluster's: only their text is tested here (the image checks:
    tests/hpc/test_container.py)."""
    monkeypatch.setattr("hpcrlhf.hpc.job.check_image", lambda path, python="python": [])


def render(name: str) -> str:
    kind, recipe, overrides, slurm = CASES[name]
    job = cluster_job(kind, recipe, overrides, f"/shared/runs/{name}", python="python", **slurm)
    return render_sbatch(job.argv, job.options)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_script_matches_golden(name):
    text = render(name)
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("HPCRLHF_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name}: rendered script changed (HPCRLHF_UPDATE_GOLDEN=1 rewrites it)"


def test_scripts_ask_for_the_shape_and_launch_what_the_launcher_needs():
    ray, mpi = render("16x8-ray-ppo-70b-container"), render("4x8-mpi-dpo-container")
    assert "#SBATCH --nodes=16\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=8" in ray
    assert "#SBATCH --nodes=4\n#SBATCH --ntasks-per-node=8\n#SBATCH --gpus-per-node=8" in mpi
    for text in (ray, mpi):
        assert "#SBATCH --signal=B:USR1@300" in text and "#SBATCH --requeue" in text
        assert "export HF_HUB_OFFLINE=1" in text and "pip install" not in text
        assert 'container=(apptainer exec "${nv[@]}" --bind /shared/runs/' in text
        assert '"${container[@]}" python -m hpcrlhf.hpc.allocation' in text
        assert text.index("hpcrlhf.hpc.allocation") < text.index("&\n")  # the fit check runs before anything starts
    assert "RAY_AUTH_MODE=token" in ray and "hpcrlhf.hpc.ray_slurm driver train ppo" in ray
    assert "srun --mpi=pmix" in mpi and "RAY" not in mpi
    assert "SLURM_RESTART_COUNT:-0}\" -lt 10" in ray


def test_scripts_never_hold_the_ray_token_of_the_submitting_shell(monkeypatch, tmp_path):
    """A RAY_AUTH_TOKEN exported when the job is written reaches the job through Slurm's environment:
    the sbatch script, submitit's script and its pickled task name it, never hold its value."""
    pytest.importorskip("submitit")
    secret = "sentinel-token-0123456789abcdef"
    monkeypatch.setenv("RAY_AUTH_TOKEN", secret)
    sbatch = render("2x8-ray-ppo-7b-container")
    o = SlurmOptions(2, 8, str(tmp_path / "run"))
    submitit_script = executor(o)._executor._make_submission_file_text("python -m submitit.core._submit", "0")
    for text in (sbatch, submitit_script):
        assert secret not in text
        assert ray_token_lines(text) == "\n".join(ray_token_env(o))
    assert secret.encode() not in pickle.dumps(ClusterTask(["train", "ppo"], "ray", 3))


def ray_token_lines(script: str) -> str:
    """The lines of a rendered script that set up Ray's token."""
    lines = script.splitlines()
    start = lines.index("export RAY_AUTH_MODE=token")
    return "\n".join(lines[start : lines.index("fi", start) + 1])


def test_the_ray_token_is_in_no_file_that_something_planted_in_the_run_folder_could_expose(tmp_path):
    """Job ids are sequential, so a file named after the job in the run folder can be planted before
    the job runs: a link to a file of the user's (the token would land there) or an empty 0666 file
    (it would stay readable to all). The script's token lines run in real bash for such jobs: the token
    reaches the job's environment (srun hands it to every node), and nothing is written anywhere."""
    run, victim = tmp_path / "run", tmp_path / "victim"
    run.mkdir()
    victim.write_text("the user's own file\n")
    (run / ".ray-token-101").symlink_to(victim)
    (run / ".ray-token-102").touch()
    (run / ".ray-token-102").chmod(0o666)
    lines = ray_token_lines(render_sbatch(["train", "ppo", "--output-dir", str(run)], SlurmOptions(2, 8, str(run))))
    before = {p: (p.lstat().st_mode, p.read_bytes()) for p in (victim, run / ".ray-token-102")}
    shown = 'printf "%s\\n" "${RAY_AUTH_MODE-}" "${RAY_AUTH_TOKEN-}" "${RAY_AUTH_TOKEN_PATH-unset}"'
    tokens = set()
    for job, exported in (("101", {}), ("102", {"RAY_AUTH_TOKEN_PATH": str(run / ".ray-token-102")}),
                          ("103", {"RAY_AUTH_TOKEN": "the-users-own-token"})):
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SLURM_JOB_ID": job, **exported}
        done = subprocess.run(["bash", "-c", f"set -uo pipefail\n{lines}\n{shown}"], cwd=run, env=env,
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        mode, token, path = done.stdout.splitlines()
        assert mode == "token" and path == "unset"
        if job == "103":
            assert token == "the-users-own-token"
        else:
            assert len(token) == 64 and int(token, 16) >= 0
            tokens.add(token)
    assert len(tokens) == 2  # fresh each time
    assert {p: (p.lstat().st_mode, p.read_bytes()) for p in before} == before
    assert sorted(p.name for p in run.iterdir()) == [".ray-token-101", ".ray-token-102"]
    assert not any(t.encode() in p.read_bytes() for t in tokens for p in tmp_path.rglob("*") if p.is_file())


def test_submit_refuses_a_linked_submitit_folder_before_queueing(tmp_path):
    """submitit writes the job's pickle (code the job runs) into run_dir/submitit/ by path."""
    from hpcrlhf.errors import UnsafeFileError
    from hpcrlhf.hpc.submit import submit

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    (run / "submitit").symlink_to(elsewhere)
    with pytest.raises(UnsafeFileError, match="submitit is a symbolic link .*never writes through links"):
        submit(["train", "sft", "--output-dir", str(run)], SlurmOptions(1, 1, str(run), launcher="mpi"))
    assert list(elsewhere.iterdir()) == []


def test_a_shape_too_small_for_the_node_map_is_refused_before_writing(tmp_path, capsys):
    script = tmp_path / "job.sbatch"
    status = main(["sbatch", "ppo-7b", "--gpus-per-node", "4", "-o", str(tmp_path / "run"), "--script", str(script)])
    err = capsys.readouterr().err
    assert status == 2 and not script.exists()
    assert "needs 2 node(s) x 8 GPU(s)" in err and "--gpus-per-node 8" in err


def test_unknown_options_list_the_valid_ones(capsys):
    assert main(["sbatch", "ppo-7b", "--gpu-per-node", "8", "--partiton=gpu"]) == 2
    err = capsys.readouterr().err
    assert "unknown argument --gpu-per-node (did you mean --gpus-per-node?)" in err
    assert "unknown argument --partiton=gpu (did you mean --partition?)" in err
    assert "valid options:" in err and "--max-requeues" in err and "--container" in err


@pytest.mark.parametrize("field, value, named", [
    ("time", "tomorrow", "--time"), ("nodes", 0, "--nodes"), ("run_dir", "runs/x", "--output-dir"),
    ("signal_lead_s", 5, "--signal-lead-s"), ("max_requeues", -1, "--max-requeues"), ("launcher", "torchrun", "--launcher"),
])
def test_bad_options_name_the_option_and_the_fix(field, value, named):
    args = {"nodes": 1, "gpus_per_node": 8, "run_dir": "/shared/runs/x", field: value}
    with pytest.raises(ConfigError, match=named):
        SlurmOptions(**args)


@pytest.mark.parametrize("time, minutes", [("90", 90), ("1:30", 2), ("24:00:00", 1440), ("2-00:00:00", 2880),
                                           ("1-12", 2160), ("0:10:30", 11)])
def test_time_limits_in_minutes(time, minutes):
    assert SlurmOptions(1, 1, "/r", time=time, signal_lead_s=30).time_minutes == minutes


@pytest.mark.parametrize("command", ["sbatch", "submit"])
@pytest.mark.parametrize("time, lead, expected", [
    ("5", "600", "the stop signal would come 600 s before the end of --time 5 (300 s), at once; keep the lead at most "
                 "half the time limit: use --signal-lead-s 150 or less, or --time 20 (minutes) or more"),
    ("15", "600", "the stop signal would come 600 s before the end of --time 15 (900 s), after only 300 s of work; "
                  "keep the lead at most half the time limit: use --signal-lead-s 450 or less, or --time 20 (minutes) "
                  "or more"),
    ("0:50", None, "the stop signal would come 300 s before the end of --time 0:50 (50 s), at once; keep the lead at "
                   "most half the time limit: use --time 10 (minutes) or more"),  # the default lead: 300 s
])
def test_a_stop_signal_not_well_inside_the_time_limit_is_refused(command, time, lead, expected, tmp_path, capsys):
    """`--time 5 --signal-lead-s 600` asked Slurm to signal the job (checkpoint and stop) the moment it started."""
    extra = ["--script", str(tmp_path / "job.sbatch")] if command == "sbatch" else ["--no-follow"]
    lead_args = ["--signal-lead-s", lead] if lead else []
    status = main([command, "--kind", "sft", "-o", str(tmp_path / "run"), "--time", time, *lead_args, *extra])
    err = capsys.readouterr().err
    assert status == 2 and f"--signal-lead-s: {lead or 300} is invalid: {expected}" in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "job.sbatch").exists()


@pytest.mark.parametrize("time, lead", [("1", 30), ("10", 300), ("2:00", 60), ("1-00:00:00", 3600)])
def test_a_lead_of_at_most_half_the_time_limit_is_accepted(time, lead):
    assert SlurmOptions(1, 1, "/r", time=time, signal_lead_s=lead).signal_lead_s == lead


@pytest.mark.parametrize("folder", ["2024-01-01", '"x"', "runs/a #1", "null"])
def test_the_job_runs_in_the_run_folder_given_taken_literally(folder, tmp_path, monkeypatch):
    """`-o 'runs/a #1'` made a job whose config wrote into runs/a (the rest read as a YAML comment)."""
    from hpcrlhf.config.jobspec import TrainJob

    monkeypatch.chdir(tmp_path)
    job = cluster_job("sft", None, [], folder, nodes=1, python="python")
    assert job.options.run_dir == str(tmp_path / folder)
    assert TrainJob.from_argv(job.argv).config().output_dir == str(tmp_path / folder)  # what the nodes run


def test_mpi_launcher_refuses_a_ray_ppo_recipe():
    with pytest.raises(ConfigError, match="--launcher ray"):
        cluster_job("ppo", "ppo-7b", [], "/shared/runs/x", launcher="mpi", python="python")


def test_the_node_map_must_fit_the_requested_shape():
    with pytest.raises(PlacementError, match="needs 4 node"):
        cluster_job("ppo", "ppo-13b", [], "/shared/runs/x", nodes=2, python="python")


def test_rule_servers_must_fit_the_requested_cpus_before_the_job_is_queued():
    served = ["reward.sources=[{rule: task, servers: 4}]", "placement.reward_server.cpus=3"]
    with pytest.raises(PlacementError, match=r"--cpus-per-gpu x --gpus-per-node = 4: node 0's CPU work \(reward_server0: 3, "
                                             r"reward_server2: 3\) claims 6 CPU cores, more than its 4; fix: nodes with more "
                                             r"CPU cores \(Slurm: --cpus-per-gpu\); fewer rule servers"):
        cluster_job("ppo", "ppo-tiny-ray", served, "/shared/runs/x", python="python", cpus_per_gpu=1)
    cluster_job("ppo", "ppo-tiny-ray", served, "/shared/runs/x", python="python", cpus_per_gpu=2)  # 8 a node: fits
    cluster_job("ppo", "ppo-tiny-ray", served, "/shared/runs/x", python="python")  # unknown: the job checks it


RAY_AGENT = ["agent={environment: 'hpcrlhf.agents.calculator:Calculator', env_workers: 6, max_tokens: 128}", "reward.sources=[{env: true}]",
             "ppo.advantage_estimator=grpo", "placement.critic.gpus_per_node=0", "placement.colocate=[[actor, ref, vllm]]"]


def test_agent_environments_must_fit_the_cpus_and_ask_slurm_for_what_the_map_was_checked_against():
    """The agent's environment threads run beside each vLLM engine (ppo-tiny-ray-colocated: one engine on node 0):
    agent.env_workers of them count as cores of that node, against --cpus-per-gpu x --gpus-per-node or
    placement.cpus_per_node -- which, when set, becomes the job's --cpus-per-gpu."""
    with pytest.raises(PlacementError, match=r"node 0's CPU work \(environments \(1 engine x 6 threads\): 6\) claims 6 CPU "
                                             r"cores, more than its 4; fix: .*fewer environment threads per engine "
                                             r"\(agent.env_workers\)"):
        cluster_job("ppo", "ppo-tiny-ray-colocated", RAY_AGENT, "/shared/runs/x", python="python", cpus_per_gpu=2)
    with pytest.raises(PlacementError, match=r"placement.cpus_per_node = 5: node 0's CPU work"):
        cluster_job("ppo", "ppo-tiny-ray-colocated", [*RAY_AGENT, "placement.cpus_per_node=5"], "/shared/runs/x",
                    python="python")
    job = cluster_job("ppo", "ppo-tiny-ray-colocated", [*RAY_AGENT, "placement.cpus_per_node=7"], "/shared/runs/x",
                      python="python")
    assert "#SBATCH --cpus-per-gpu=4" in render_sbatch(job.argv, job.options)  # 7 cores over 2 GPUs, rounded up
    job = cluster_job("ppo", "ppo-tiny-ray-colocated", [*RAY_AGENT, "placement.cpus_per_node=7"], "/shared/runs/x",
                      python="python", cpus_per_gpu=3)  # the user's own: 6 a node, enough
    assert "#SBATCH --cpus-per-gpu=3" in render_sbatch(job.argv, job.options)


def test_ray_ports_differ_between_nodes_and_neighbouring_jobs():
    blocks = [job_ports(job, node).gcs for job in (41, 42) for node in range(2)]
    assert job_ports(42).gcs == job_ports(42 + PORT_SLOTS).gcs  # the check at start-up names a clash
    ranges = sorted((b, b + 119) for b in {job_ports(41).gcs, job_ports(41, 1).gcs})
    assert ranges[0][1] < ranges[1][0] and len(set(blocks)) == 3  # job 41 node 1 == job 42 node 0
    assert all(20000 <= job_ports(j, 15).max_worker < LOCAL_PORT_BASE for j in range(PORT_SLOTS))


# ---------------------------------------------------------------- what goes into the script
def sbatch_arguments(line: str) -> list[str]:
    """The arguments sbatch reads from one `#SBATCH` line, as Slurm's `_get_argument` (src/sbatch/opt.c)
    does: whitespace splits; single or double quotes group (and concatenate); a backslash escapes
    the next character, also inside quotes; an unquoted `#` ends the line."""
    args, i, text = [], 0, line.removeprefix("#SBATCH")
    while i < len(text):
        while i < len(text) and text[i].isspace():
            i += 1
        arg, quote, escape, started = "", "", False, i < len(text) and text[i] != "#"
        while i < len(text) and (quote or not text[i].isspace()):
            c = text[i]
            i += 1
            if escape:
                escape = False
            elif c == "\\":
                escape = True
                continue
            elif quote:
                if c == quote:
                    quote = ""
                    continue
            elif c in "\"'":
                quote = c
                continue
            elif c == "#":
                i = len(text)
                break
            arg += c
        assert not quote, f"sbatch: unmatched {quote} in {line!r}"
        if started and arg:
            args.append(arg)
    return args


INJECTED = "x\n#SBATCH --wrap=touch /tmp/pwned"


@pytest.mark.parametrize("field, value, named, fix", [
    ("job_name", INJECTED, "--job-name", "letters, digits, _ . + -"),
    ("partition", "gpu\necho pwned", "--partition", "names, comma-separated"),
    ("account", "my account", "--account", "no spaces"),
    ("qos", "high;rm -rf ~", "--qos", "letters, digits"),
    ("job_name", "ppo-hetjob-1", "--job-name", "heterogeneous job component"),
    ("run_dir", "/shared/runs/100%", "--output-dir", "file-name pattern (%j)"),
    ("run_dir", "/shared/runs/a\\b", "--output-dir", "as an escape"),
    ("run_dir", "/shared/runs/a\nb", "--output-dir", "control characters"),
    ("run_dir", "/shared/PackJob", "--output-dir", "heterogeneous job component"),
    ("cache_dir", "cache", "--cache-dir", "absolute path"),
    ("time", "400-00:00:00", "--time", "from 1 minute to 365 days"),
    ("time", "0", "--time", "from 1 minute"),
    ("time", "24:00:00\n#SBATCH --x", "--time", "Slurm's format"),
    ("nodes", 10**8, "--nodes", "use 1 to 100,000"),
    ("gpus_per_node", 1000, "--gpus-per-node", "use 1 to 64"),
])
def test_options_slurm_cannot_take_are_refused_naming_option_value_and_fix(field, value, named, fix):
    args = {"nodes": 1, "gpus_per_node": 8, "run_dir": "/shared/runs/x", field: value}
    with pytest.raises(ConfigError) as info:
        SlurmOptions(**args)
    assert str(info.value).startswith(f"{named}: {value!r} is invalid: ") and fix in str(info.value)


@pytest.mark.parametrize("field, value", [("run_dir", "/shared/runs/a:b"), ("cache_dir", "/shared/c,d"),
                                          ("binds", ("/data/x,y",))])
def test_container_binds_refuse_what_apptainer_would_split(field, value):
    args = {"nodes": 1, "gpus_per_node": 1, "run_dir": "/shared/runs/x", "container": "/i.sif", field: value}
    with pytest.raises(ConfigError, match="splits"):
        SlurmOptions(**args)


@pytest.mark.parametrize("command", ["sbatch", "submit"])
def test_a_value_that_would_add_script_lines_fails_before_anything_is_written_or_queued(command, tmp_path, capsys):
    script, run = tmp_path / "job.sbatch", tmp_path / "run"
    extra = ["--script", str(script)] if command == "sbatch" else ["--no-follow"]
    status = main([command, "--kind", "sft", "--launcher", "mpi", "-o", str(run), "--job-name", INJECTED, *extra])
    err = capsys.readouterr().err
    assert status == 2 and not script.exists() and not run.exists(), err
    assert f"hpcrlhf: error: --job-name: {INJECTED!r} is invalid: use a Slurm job name" in err


def test_paths_are_quoted_in_sbatch_lines_and_shell_lines(tmp_path):
    """An --output-dir with spaces, quotes and `$(...)`: sbatch reads the whole path from its #SBATCH line,
    and bash runs the script's lines with the same paths, nothing expanded."""
    odd = "/shared/my runs/it's \"$(touch pwned)\" #1"
    job = cluster_job("sft", None, [], odd, nodes=1, python="/opt/my py/bin/python", cache_dir=odd + "/cache")
    text = render_sbatch(job.argv, job.options)
    header = [sbatch_arguments(line) for line in text.splitlines() if line.startswith("#SBATCH")]
    assert all(len(args) == 1 for args in header)
    assert ["--output=" + odd + "/slurm-%j.out"] in header
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # the whole script parses
    env_lines = "\n".join(line for line in text.splitlines() if line.startswith("export HF_HOME="))
    shown = subprocess.run(["bash", "-c", f"unset HF_HOME; {env_lines}; printf %s \"$HF_HOME\""], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout
    assert shown == odd + "/cache/huggingface" and not (tmp_path / "pwned").exists()
    assert "'/opt/my py/bin/python' -m hpcrlhf.hpc.allocation mpi train sft" in text


def test_a_newline_in_a_job_argument_cannot_end_the_comment_that_shows_it():
    job = cluster_job("sft", None, [], "/shared/runs/x", nodes=1, python="python")
    text = render_sbatch(job.argv[:-2] + ["--set", "model.path=/m\ntouch /tmp/pwned"] + job.argv[-2:], job.options)
    comment = next(line for line in text.splitlines() if line.startswith("# Written by"))
    assert "model.path=/m\\ntouch /tmp/pwned" in comment
    assert text.splitlines()[2].startswith("#SBATCH")  # the header still follows the comment


def test_a_relative_cache_dir_is_written_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = cluster_job("sft", None, [], "/shared/runs/x", nodes=1, python="python", cache_dir="cache")
    assert job.options.cache_dir == str(tmp_path / "cache")


# ---------------------------------------------------------------- rules in the recipe: code, checked before queueing
def rules_module(tmp_path, monkeypatch, body: str | None) -> str:
    """A `--set` naming `my_rules:score` as the second reward source, `my_rules` holding `body` (None:
    there is no such module)."""
    monkeypatch.delitem(sys.modules, "my_rules", raising=False)
    if body is not None:
        (tmp_path / "my_rules.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp_path))
    return "reward.sources=[{rule: task}, {rule: 'my_rules:score', weight: 0.5}]"


@pytest.mark.parametrize("command", ["sbatch", "submit"])
@pytest.mark.parametrize("body, why", [
    (None, "No module named 'my_rules'"),
    ("raise RuntimeError('this module needs a GPU')\n", "RuntimeError: this module needs a GPU"),
    ("def other(prompt, response, row):\n    return 1.0\n", "'score'"),
])
def test_a_rule_that_cannot_be_imported_fails_before_anything_is_written_or_queued(command, body, why, tmp_path,
                                                                                   monkeypatch, capsys):
    rule = rules_module(tmp_path, monkeypatch, body)
    script, run = tmp_path / "job.sbatch", tmp_path / "run"
    extra = ["--script", str(script)] if command == "sbatch" else ["--no-follow"]
    status = main([command, "--kind", "ppo", "--set", rule, "-o", str(run), *extra])
    err = capsys.readouterr().err
    assert status == 2 and not script.exists() and not run.exists(), err
    assert "hpcrlhf: error: reward.sources[1].rule: rule 'my_rules:score' cannot be imported" in err and why in err


def test_importable_rules_pass_and_a_container_job_notes_where_they_are_checked(tmp_path, monkeypatch):
    rule = rules_module(tmp_path, monkeypatch, "def score(prompt, response, row):\n    return 1.0\n")
    assert cluster_job("ppo", None, [rule], "/shared/runs/x", python=None).notes == ()
    job = cluster_job("ppo", None, [rule], "/shared/runs/x", **CONTAINER)
    assert any("reward.sources[1].rule 'my_rules:score' not imported here: the job runs them in the image's python"
               in note for note in job.notes)


def test_a_tracker_package_missing_here_fails_before_queueing_and_a_container_job_notes_it(tmp_path, monkeypatch,
                                                                                            capsys):
    import hpcrlhf.run.trackers as trackers

    monkeypatch.setitem(trackers.MODULES, "wandb", "hpcrlhf_no_such_module")  # as if wandb were not installed
    script, run = tmp_path / "job.sbatch", tmp_path / "run"
    status = main(["sbatch", "--kind", "sft", "--set", "log.backends=[tensorboard,wandb]", "-o", str(run),
                   "--script", str(script)])
    err = capsys.readouterr().err
    assert status == 2 and not script.exists() and not run.exists(), err
    assert "log.backends: 'wandb' needs the hpcrlhf_no_such_module package" in err and "hpcrlhf[track]" in err, err
    assert "(checked before queueing the job, with this Python)" in err
    job = cluster_job("sft", None, ["log.backends=[wandb]"], "/shared/runs/x", **CONTAINER)
    assert any("log.backends ['wandb']: the packages (hpcrlhf_no_such_module) are not looked up here: the job needs "
               "them in the image's python" in note for note in job.notes), job.notes
    assert cluster_job("sft", None, ["log.backends=[tensorboard]"], "/shared/runs/x", **CONTAINER).notes == \
        cluster_job("sft", None, [], "/shared/runs/x", **CONTAINER).notes


AGENT_CODE = {  # module body -> what the error says of it (the environment, tool or parser it names)
    "environment": (None, "agent.environment 'my_agent:Game' cannot be imported", "No module named 'my_agent'"),
    "raises": ("raise RuntimeError('needs the game server')\n", "agent.environment 'my_agent:Game' cannot be imported",
               "RuntimeError: needs the game server"),
    "no class": ("def Game():\n    pass\n", "agent.environment 'my_agent:Game' is no class", "name the environment"),
    "tool": ("class Game:\n    def reset(self, row, seed):\n        return 'go'\ndef look(where):\n    return where\n",
             "agent.tools[0] 'my_agent:look'", "type hint"),
}


def agent_module(tmp_path, monkeypatch, body: str | None) -> list[str]:
    """`--set`s naming `my_agent:Game` as the agent-tiny recipe's environment and `my_agent:look` as a
    tool, `my_agent` holding `body` (None: there is no such module)."""
    monkeypatch.delitem(sys.modules, "my_agent", raising=False)
    if body is not None:
        (tmp_path / "my_agent.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp_path))
    return ["agent.environment=my_agent:Game", "agent.tools=[my_agent:look]"]


@pytest.mark.parametrize("case", list(AGENT_CODE))
def test_an_agents_code_that_cannot_be_loaded_fails_before_anything_is_written(case, tmp_path, monkeypatch, capsys):
    body, what, why = AGENT_CODE[case]
    script, run = tmp_path / "job.sbatch", tmp_path / "run"
    sets = [x for s in agent_module(tmp_path, monkeypatch, body) for x in ("--set", s)]
    status = main(["sbatch", "agent-tiny", *sets, "-o", str(run), "--script", str(script)])
    err = capsys.readouterr().err
    assert status == 2 and not script.exists() and not run.exists(), err
    assert what in err and why in err and "(checked before queueing the job, with this Python)" in err, err


def test_an_agents_importable_code_passes_and_a_container_job_notes_where_it_is_loaded(tmp_path, monkeypatch):
    good = ("class Game:\n    def reset(self, row, seed):\n        return 'go'\n"
            "def look(where: str) -> str:\n    \"\"\"Look.\n\n    Args:\n        where: Where.\n    \"\"\"\n    return where\n")
    sets = agent_module(tmp_path, monkeypatch, good)
    assert cluster_job("ppo", "agent-tiny", sets, "/shared/runs/x", python=None).notes == ()
    job = cluster_job("ppo", "agent-tiny", sets, "/shared/runs/x", **CONTAINER)
    assert any("agent.environment 'my_agent:Game', agent.tools[0] 'my_agent:look' not imported here" in note
               for note in job.notes), job.notes


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_submit_polls_every_positive_number_of_seconds(value, capsys):
    """`--poll-s nan` reached time.sleep (ValueError traceback); 0 polled Slurm in a busy loop."""
    with pytest.raises(SystemExit) as e:
        main(["submit", "--kind", "sft", "--poll-s", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --poll-s: {value} is not a number of seconds: use a finite number above 0" in err
