"""`hpcrlhf serve-reward` through the real CLI: a rule served on loopback with a token (requests
without it refused), batching of requests that arrive together, a bad row answered 400 and shown
by the asking job, a clean stop; and a PPO run whose reward model is served equal to the same run
with the reward model in the job."""

from __future__ import annotations

import json
import math
import os
import signal
import stat
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import RemoteRewardConfig, RewardSourceConfig, ServeRewardConfig
from hpcrlhf.errors import ConfigError, RewardServerError
from hpcrlhf.run.metrics import read_metrics
from hpcrlhf.rewards.remote import RemoteSource
from hpcrlhf.rewards.response import Response
from tests.launch_helpers import cli_command, cli_env, run_cli

RULES = '''\
def bonus(prompt, response, row):
    return len(response) + row["bonus"]
'''


def start_server(folder: Path, *settings: str, env: dict | None = None) -> tuple[subprocess.Popen, dict]:
    """`hpcrlhf serve-reward` on a free port, once its server.json is written: (process, server.json)."""
    proc = subprocess.Popen(cli_command(["serve-reward", "-o", str(folder), "--set", "port=0", *settings]),
                            env=cli_env(**(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (folder / "server.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"serve-reward did not start: {proc.communicate()[1][-3000:]}")
        time.sleep(0.1)
    return proc, json.loads((folder / "server.json").read_text())


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def post(url: str, body, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def rows(n: int) -> dict:
    return {"prompts": [f"p{i}" for i in range(n)], "responses": ["x" * i for i in range(n)],
            "rows": [{"bonus": 0.5} for _ in range(n)]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A user's rule served with the defaults (loopback, a new token), batching for 0.3 s."""
    folder = tmp_path_factory.mktemp("serve")
    (folder / "userrules.py").write_text(RULES)
    proc, info = start_server(folder / "server", "--set", "reward.sources=[{rule: 'userrules:bonus'}]",
                              "--set", "batch_wait_ms=300", env={"PYTHONPATH": str(folder)})
    yield info
    code, err = stop(proc)
    assert code == 0 and "serve-reward: stopped" in err, err[-3000:]
    assert not (folder / "server" / "server.json").exists()  # gone with the server
    token = Path(info["token_file"]).read_text().strip()
    assert token not in err  # said where the token is, never what


def test_it_serves_on_loopback_with_a_token_only_its_user_reads(served):
    assert served["url"].startswith("http://127.0.0.1:") and served["url"].endswith("/score")
    mode = os.stat(served["token_file"]).st_mode
    assert stat.S_IMODE(mode) == 0o600


def test_a_request_without_the_token_is_refused(served):
    assert post(served["url"], rows(2))[0] == 401
    assert post(served["url"], rows(2), token="not-the-token")[0] == 401
    token = Path(served["token_file"]).read_text().strip()
    assert post(served["url"], rows(3), token=token) == (200, {"scores": [0.5, 1.5, 2.5]})


def test_a_job_asks_it_with_the_token_file(served):
    source = RemoteSource(RewardSourceConfig(url=served["url"], token_file=served["token_file"]),
                          RemoteRewardConfig(batch_size=4), "reward.sources[0]")
    responses = [Response(f"p{i}", "y" * i, (), {"bonus": 1.0}) for i in range(10)]
    assert source.scores(responses) == [i + 1.0 for i in range(10)]


def test_requests_that_arrive_together_are_scored_in_one_batch(served):
    token = Path(served["token_file"]).read_text().strip()
    health = served["url"].replace("/score", "/health")
    before = json.loads(urllib.request.urlopen(health, timeout=10).read())
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(post(served["url"], rows(4), token))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [(200, {"scores": [0.5, 1.5, 2.5, 3.5]})] * 6
    after = json.loads(urllib.request.urlopen(health, timeout=10).read())
    assert after["requests"] - before["requests"] == 6 and after["batches"] - before["batches"] < 6, (before, after)
    assert after["sources"] == ["rule_userrules.bonus"]


def test_a_row_the_rule_cannot_score_fails_the_asking_job_with_the_reason(served):
    source = RemoteSource(RewardSourceConfig(url=served["url"], token_file=served["token_file"]), RemoteRewardConfig(),
                          "reward.sources[0]")
    with pytest.raises(RewardServerError) as e:
        source.scores([Response("p", "y", (), {"no_bonus": 1})])
    assert str(e.value).startswith(f"reward.sources[0].url '{served['url']}': the reward server answered status 400: "
                                   "reward.sources[0].rule 'userrules:bonus' raised KeyError: 'bonus'"), str(e.value)
    assert "on the response 'y' to prompt 'p' (request " in str(e.value), str(e.value)
    token = Path(served["token_file"]).read_text().strip()
    status, reply = post(served["url"], {"prompts": ["a"], "responses": ["b"]}, token)
    assert (status, reply) == (400, {"error": "no list 'rows' in the request"})


def test_a_server_thread_serves_on_a_given_socket_and_stops_cleanly(tmp_path):
    """What a job's own reward server runs: the app on a socket bound beforehand (to its node's address,
    in its port block), in a thread of the calling process."""
    import socket

    from hpcrlhf.rewards.server import ServerThread, build_app, listening_socket

    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    def length(responses):
        if any(r.text == "boom" for r in responses):
            raise MemoryError("out of memory")  # not a data problem: the server's own fault
        return [float(len(r.text)) for r in responses]

    app = build_app(length, "tok", ["rule_len"])
    server = ServerThread(app, sock, tmp_path, tmp_path / "token")
    url = server.start()
    assert url == f"http://127.0.0.1:{port}/score"
    info = json.loads((tmp_path / "server.json").read_text())
    assert info == {"url": url, "token_file": str(tmp_path / "token"), "pid": os.getpid()}
    assert post(url, rows(3), "tok") == (200, {"scores": [0.0, 1.0, 2.0]}) and post(url, rows(1))[0] == 401
    boom = {"prompts": ["p"], "responses": ["boom"], "rows": [{}]}
    assert post(url, boom, "tok") == (500, {"error": "the reward server failed to score: MemoryError: out of memory"})
    assert post(url, rows(2), "tok") == (200, {"scores": [0.0, 1.0]})  # and it goes on serving
    server.stop()
    assert not (tmp_path / "server.json").exists()
    with pytest.raises(OSError):  # nothing listens there any more
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert not any(t.name == "hpcrlhf-reward-server" for t in threading.enumerate())
    with pytest.raises(ConfigError, match=r"port: cannot listen on 127\.0\.0\.1:\d+ \(.*\); use another port"):
        busy = listening_socket("127.0.0.1", 0)
        try:
            listening_socket("127.0.0.1", busy.getsockname()[1])
        finally:
            busy.close()


@pytest.mark.parametrize("overrides, message", [
    (["no_token=true", "host=0.0.0.0"], "no_token: true with host '0.0.0.0': every host that reaches this address could"),
    (["port=70000"], "port: 70000 is invalid"),
    (["no_token=true", "token_file=/x"], "contradict each other"),
])
def test_bad_server_settings_fail_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ServeRewardConfig, overrides=overrides)


def _rm_of_its_own_vocabulary(base: str, folder: Path) -> str:
    """A reward model (random head, seeded) whose tokenizer has one token more than the policy's: a
    job then scores it on the text, as a server does."""
    import torch

    from hpcrlhf.models.loading import load_tokenizer
    from hpcrlhf.models.value import load_value_model

    torch.manual_seed(7)
    tokenizer = load_tokenizer(base)
    tokenizer.add_tokens(["<|rm|>"])
    model = load_value_model(base, pad_token_id=tokenizer.pad_token_id)
    model.resize_token_embeddings(len(tokenizer))
    model.config.reward_mean, model.config.reward_std = 0.1, 2.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_ppo_with_its_reward_model_served_equals_the_reward_model_in_the_job(tiny_llama, tmp_path):
    rm = _rm_of_its_own_vocabulary(tiny_llama, tmp_path / "rm")
    proc, info = start_server(tmp_path / "server", "--set", f"reward.sources=[{{model: '{rm}'}}]")
    common = ["--set", f"model.path={tiny_llama}", "--set", "train.max_steps=2", "--set", "rollout.prompts_per_step=4",
              "--set", "rollout.samples_per_prompt=2", "--set", "rollout.max_new_tokens=4", "--set", "eval.max_new_tokens=4",
              "--set", "ppo.advantage_estimator=grpo", "--set", "eval.every_steps=0", "--set", "eval.score_prompts=8",
              "--set", "log.backends=[]", "--set", "log.every_steps=1", "--set", "checkpoint.save_model=false",
              "--set", "optim.lr=1e-3"]
    try:
        run_cli(["train", "ppo", "-o", str(tmp_path / "served"), "--set",
                 f"reward.sources=[{{url: '{info['url']}', token_file: '{info['token_file']}'}}]", *common], timeout=300)
        run_cli(["train", "ppo", "-o", str(tmp_path / "in_job"), "--set", f"reward.sources=[{{model: '{rm}'}}]", *common],
                timeout=300)
    finally:
        assert stop(proc)[0] == 0
    served, in_job = read_metrics(tmp_path / "served"), read_metrics(tmp_path / "in_job")
    assert len(served) == len(in_job) >= 3
    for a, b in zip(served, in_job):
        for key in ("rollout/score", "train/policy_loss", "eval/reward", "rollout/response_length"):
            if key in b:
                assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (key, a[key], b[key])
        if "reward/model0_rm" in b:
            assert math.isclose(a["reward/server0_127.0.0.1"], b["reward/model0_rm"], rel_tol=1e-5, abs_tol=1e-6)
