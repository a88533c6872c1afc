"""Reward servers (`reward.sources[i].url`) against a real HTTP server in this process: the protocol,
batching and concurrency, the token, every way a server can fail (each a clear error after the
retries, naming the URL and what came back, never a hang), and a PPO run whose reward comes from a
server equal to the same run with the rule in-process."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from collections.abc import Callable

import pytest

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import PPOConfig, RemoteRewardConfig, RewardSourceConfig
from hpcrlhf.errors import ConfigError, RewardServerError
from hpcrlhf.run.metrics import read_metrics
from hpcrlhf.rewards.remote import RemoteSource
from hpcrlhf.rewards.response import Response
from hpcrlhf.run.signals import STOP_SIGNALS, StopFlag, StopRequested
from tests.launch_helpers import run_cli

TOKEN = "s3cret-token-for-the-test"
FAST = RemoteRewardConfig(batch_size=3, concurrency=2, timeout_s=1.0, retries=2, backoff_s=0.05)
"""Three tries per request, 0.05 s then 0.1 s apart."""


def length_scores(request: dict) -> tuple[int, object]:
    """What a correct server answers: the length of each response plus the row's bonus."""
    return 200, {"scores": [len(r) + row.get("bonus", 0) for r, row in zip(request["responses"], request["rows"])]}


class Server:
    """An HTTP server on 127.0.0.1 answering with `answer(request) -> (status, JSON value or bytes)`;
    it records every request (its body and Authorization header) and how many were in flight at once."""

    def __init__(self, answer: Callable[[dict], tuple[int, object]] = length_scores, delay_s: float = 0.0):
        self.answer, self.delay_s = answer, delay_s
        self.requests: list[tuple[dict, str | None]] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append((request, self.headers.get("Authorization")))
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                counted = True
                try:
                    time.sleep(server.delay_s)
                    status, body = server.answer(request)
                    data = body if isinstance(body, bytes) else json.dumps(body).encode()
                    # answered: no longer in flight *before* the client can read the answer and send its
                    # next request (decremented after the write, this thread could still count one the
                    # client had finished with: 3 in flight at concurrency 2, seen once in CI)
                    counted = server.leave()
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                    pass
                finally:
                    if counted:
                        server.leave()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def leave(self) -> bool:
        """One request less in flight; False, so that the caller does not count it out twice."""
        with self.lock:
            self.in_flight -= 1
        return False

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    started: list[Server] = []

    def start(*args, **kwargs) -> Server:
        started.append(Server(*args, **kwargs))
        return started[-1]

    yield start
    for server in started:
        server.close()


def responses(n: int) -> list[Response]:
    return [Response(f"prompt {i}", "x" * i, (), {"bonus": 0.5, "id": i}, f"prompts.jsonl:{i + 1}") for i in range(n)]


def source(url: str, cfg: RemoteRewardConfig = FAST, **token) -> RemoteSource:
    return RemoteSource(RewardSourceConfig(url=url, **token), cfg, "reward.sources[1]")


def test_scores_come_back_in_order_in_batches_with_bounded_concurrency(serve):
    server = serve(delay_s=0.2)
    # a patient client: under load a 0.2 s answer can pass FAST's 1 s timeout, and the retry then sent
    # while the first request still sleeps in the server is a third in flight there (seen once in CI)
    patient = dataclasses.replace(FAST, timeout_s=60.0)
    assert source(server.url, patient).scores(responses(10)) == [i + 0.5 for i in range(10)]
    assert sorted(len(request["responses"]) for request, _ in server.requests) == [1, 3, 3, 3]
    assert server.most_in_flight == 2  # reward.remote.concurrency
    request = next(request for request, _ in server.requests if request["prompts"][0] == "prompt 0")
    assert request == {"prompts": ["prompt 0", "prompt 1", "prompt 2"], "responses": ["", "x", "xx"],
                       "rows": [{"bonus": 0.5, "id": 0}, {"bonus": 0.5, "id": 1}, {"bonus": 0.5, "id": 2}]}
    assert {auth for _, auth in server.requests} == {None}  # no token: no header


def test_the_token_goes_in_the_header_only(serve, tmp_path, monkeypatch):
    server = serve()
    monkeypatch.setenv("MY_REWARD_TOKEN", TOKEN)
    source(server.url, token_env="MY_REWARD_TOKEN").scores(responses(2))
    (tmp_path / "token").write_text(TOKEN + "\n")
    source(server.url, token_file=str(tmp_path / "token")).scores(responses(2))
    assert {auth for _, auth in server.requests} == {f"Bearer {TOKEN}"}
    assert TOKEN not in json.dumps([request for request, _ in server.requests])


@pytest.mark.parametrize("token, message", [
    ({"token_env": "NO_SUCH_TOKEN_VARIABLE"}, "reward.sources[1].token_env: the environment variable NO_SUCH_TOKEN_VARIABLE "
                                              "is not set (or empty) where the job runs"),
    ({"token_file": "/nonexistent/token"}, "reward.sources[1].token_file: cannot read '/nonexistent/token'"),
])
def test_a_missing_token_fails_when_the_source_is_built(token, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        source("http://127.0.0.1:9/score", **token)


def test_a_jobs_replicas_share_the_batches_by_fewest_in_flight_and_a_failing_one_is_named(serve):
    """A source the job's own servers serve (`servers: 2`): their URLs and the job's token, the batches
    spread over the replicas, the scores in order; a failure names the replica that failed."""
    first, second = serve(delay_s=0.2), serve(delay_s=0.2)
    served = RemoteSource(RewardSourceConfig(rule="task", servers=2), FAST, "reward.sources[0]",
                          served=([first.url, second.url], TOKEN))
    assert served.scores(responses(12)) == [i + 0.5 for i in range(12)]
    assert len(first.requests) == len(second.requests) == 2  # 4 batches of 3, 2 at a time: one on each
    for _ in range(2):  # batches asked one at a time go round the replicas too
        served.scores(responses(3))
    assert len(first.requests) == len(second.requests) == 3
    assert {auth for _, auth in first.requests + second.requests} == {f"Bearer {TOKEN}"}
    served.probe()  # an empty request to each: both answer it
    assert first.requests[-1][0] == second.requests[-1][0] == {"prompts": [], "responses": [], "rows": []}
    second.answer = lambda request: (401, {"error": "no valid token"})
    with pytest.raises(RewardServerError) as e:
        served.probe()
    assert str(e.value).startswith(f"reward.sources[0] (the job's reward server '{second.url}'): the reward server "
                                   "answered status 401: no valid token (refused)"), str(e.value)


def test_a_reward_set_asks_the_jobs_servers_for_their_sources_and_loads_none_of_their_models(serve):
    import torch

    from hpcrlhf.config.schema import RewardConfig
    from hpcrlhf.rewards.sources import RewardSet

    replica = serve()
    cfg = RewardConfig(sources=(RewardSourceConfig(model="/nowhere/rm", servers=1, weight=2.0),
                                RewardSourceConfig(rule="userrules:never_loaded", servers=1, weight=0.5)),
                       remote=FAST)
    served = {0: ([replica.url], TOKEN), 1: ([replica.url], TOKEN)}
    rewards = RewardSet(cfg, lambda path, field: pytest.fail(f"loaded {path}"), None, None, "cpu", served=served)
    total, parts = rewards.score(responses(3))
    assert list(parts) == ["model0_rm", "rule_userrules.never_loaded"]  # the sources' own metric names
    assert torch.equal(parts["model0_rm"], torch.tensor([0.5, 1.5, 2.5])) and torch.equal(total, 2.5 * parts["model0_rm"])
    with pytest.raises(ValueError, match=r"reward.sources\[0, 1\] are served by the job's reward servers, but none"):
        RewardSet(cfg, None, None, None, "cpu")


def failing(body) -> Callable[[dict], tuple[int, object]]:
    return lambda request: (200, body(request) if callable(body) else body)


BAD_SERVERS = {  # how a server fails: (its answer, what the error says came back)
    "wrong number of scores": (failing(lambda r: {"scores": [1.0] * (len(r["responses"]) - 1)}), "2 scores for 3 responses"),
    "NaN": (failing(b'{"scores": [1.0, NaN, 2.0]}'), "score 1 is nan"),
    "Infinity": (failing(b'{"scores": [1.0, 2.0, Infinity]}'), "score 2 is inf"),
    "a string": (failing({"scores": [1.0, "2.0", 3.0]}), "score 1 is '2.0', not a number"),
    "not JSON": (failing(b"<html>Bad Gateway</html>"), "an answer that is not JSON: '<html>Bad Gateway</html>'"),
    "no scores": (failing({"rewards": [1, 2, 3]}), 'no list of scores (a JSON object with "scores" was expected)'),
    "status 503": (lambda r: (503, b"overloaded"), "status 503: 'overloaded'"),
    "slow": (None, "no answer within 1 s (reward.remote.timeout_s)"),
}


@pytest.mark.parametrize("name", BAD_SERVERS)
def test_a_bad_server_fails_after_the_retries_naming_the_url_and_what_came_back(name, serve, caplog):
    answer, what = BAD_SERVERS[name]
    server = serve(length_scores, delay_s=3.0) if answer is None else serve(answer)
    start = time.monotonic()
    with pytest.raises(RewardServerError) as e:
        source(server.url).scores(responses(3))
    took = time.monotonic() - start
    assert str(e.value).startswith(f"reward.sources[1].url '{server.url}': the reward server failed 3 time(s) in a row "
                                   "(1 try and reward.remote.retries=2), the last with " + what), str(e.value)
    assert len(server.requests) == 3
    assert took < 3 * FAST.timeout_s + 2, took  # never a hang
    assert caplog.text.count("trying again in") == 2


def test_a_server_that_is_down_fails_after_the_retries(serve):
    server = serve()
    server.close()
    with pytest.raises(RewardServerError, match=r"failed 3 time\(s\) in a row .* the last with no connection: "
                                                r"\[Errno 111\] Connection refused"):
        source(server.url).scores(responses(3))


def test_a_server_that_recovers_within_the_retries_gives_the_scores(serve, caplog):
    answers = iter([(503, b"restarting"), (502, b"")])
    server = serve(lambda request: next(answers, None) or length_scores(request))
    assert source(server.url).scores(responses(2)) == [0.5, 1.5]
    assert len(server.requests) == 3 and "try 1 of 3 failed (status 503: 'restarting'); trying again in 0.05 s" in caplog.text


@pytest.mark.parametrize("status, message", [
    (401, "status 401: 'no token' (refused); it sent no token: give the source one with token_file or token_env"),
    (404, "status 404: 'not here'; check the URL and that the server speaks the protocol of docs/rewards.md#reward-servers"),
])
def test_a_refusal_fails_at_once(status, message, serve):
    server = serve(lambda request: (status, {401: b"no token", 404: b"not here"}[status]))
    with pytest.raises(RewardServerError) as e:
        source(server.url).scores(responses(2))
    assert str(e.value) == f"reward.sources[1].url '{server.url}': the reward server answered {message}"
    assert len(server.requests) == 1


def test_a_wrong_token_is_not_shown(serve, monkeypatch):
    server = serve(lambda request: (401, b"bad token"))
    monkeypatch.setenv("MY_REWARD_TOKEN", TOKEN)
    with pytest.raises(RewardServerError, match="check the token in the source's token_file or token_env") as e:
        source(server.url, token_env="MY_REWARD_TOKEN").scores(responses(1))
    assert TOKEN not in str(e.value)


def test_a_stop_request_stops_waiting_for_the_server(serve):
    server = serve(length_scores, delay_s=0.8)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, *STOP_SIGNALS)}
    slow = RemoteSource(RewardSourceConfig(url=server.url), RemoteRewardConfig(timeout_s=30, batch_size=1), "reward.sources[0]")
    try:
        StopFlag().install()
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        with pytest.raises(StopRequested):
            slow.scores(responses(40))  # 40 requests of 0.8 s, 4 at a time: 8 s
        assert time.monotonic() - start < 1.5
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("overrides, message", [
    (["reward.sources=[{url: 'ftp://h/x'}]"], "reward.sources[0]: url: 'ftp://h/x' is invalid: use an http:// or https:// URL"),
    (["reward.sources=[{url: 'http://me:pw@h/x'}]"], "url: 'http://me:***@h/x' is invalid: put no credentials in the URL"),
    (["reward.sources=[{rule: task, token_env: T}]"], "token_env: 'T' is invalid: a token is for a reward server"),
    (["reward.sources=[{url: 'http://h/x', model: m}]"], "each source sets exactly one of `model` (a reward model folder), "
                                                         "`rule`"),
    (["reward.remote.retries=-1"], "reward.remote.retries: -1 is invalid"),
    (["reward.remote.timeout_s=0"], "reward.remote.timeout_s: 0.0 is invalid"),
])
def test_bad_server_settings_fail_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(PPOConfig, overrides=overrides)
    assert message in str(e.value), str(e.value)


RULES = '''\
def short(prompt, response, row):
    return -float(len(response)) + (0.5 if row["answer"] in response else 0.0)
'''


@pytest.mark.slow
def test_ppo_with_the_rule_on_a_server_equals_the_rule_in_process(serve, tmp_path):
    """Same seed, same prompts: the reward the server computes is the rule's, so every metric of
    every step is the same; the token reaches the server and no file of the run."""
    import importlib
    import sys

    (tmp_path / "serverrules.py").write_text(RULES)
    rows = [{"prompt": f"Say the word {w}:", "response": w, "answer": w} for w in ("red", "blue", "green", "gold") * 2]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sys.path.insert(0, str(tmp_path))
    try:
        rule = importlib.import_module("serverrules").short
    finally:
        sys.path.remove(str(tmp_path))
    server = serve(lambda request: (200, {"scores": [rule(p, r, row) for p, r, row in
                                                     zip(request["prompts"], request["responses"], request["rows"])]}))
    (tmp_path / "token").write_text(TOKEN)
    common = ["--set", f"data.train_path={prompts}", "--set", f"data.eval_path={prompts}", "--set", "train.max_steps=2",
              "--set", "rollout.prompts_per_step=4", "--set", "rollout.samples_per_prompt=2", "--set",
              "rollout.max_new_tokens=3", "--set", "eval.max_new_tokens=3", "--set", "ppo.advantage_estimator=grpo",
              "--set", "eval.every_steps=0", "--set", "log.backends=[]", "--set", "log.every_steps=1",
              "--set", "checkpoint.save_model=false", "--set", "optim.lr=1e-3"]
    local, remote = tmp_path / "local", tmp_path / "remote"
    run_cli(["train", "ppo", "-o", str(local), "--set", "reward.sources=[{rule: 'serverrules:short'}]", *common],
            env={"PYTHONPATH": str(tmp_path)}, timeout=300)
    run_cli(["train", "ppo", "-o", str(remote), "--set",
             f"reward.sources=[{{url: '{server.url}', token_file: '{tmp_path / 'token'}'}}]", *common], timeout=300)
    assert server.requests and {auth for _, auth in server.requests} == {f"Bearer {TOKEN}"}
    local_rows, remote_rows = read_metrics(local), read_metrics(remote)
    assert len(local_rows) == len(remote_rows) >= 3
    for a, b in zip(local_rows, remote_rows):
        assert a.keys() - {"reward/rule_serverrules.short"} == b.keys() - {"reward/server0_127.0.0.1"}
        for key in ("rollout/score", "train/policy_loss", "eval/reward", "rollout/response_length"):
            if key in a:
                assert math.isclose(a[key], b[key], rel_tol=1e-6, abs_tol=1e-9), (key, a[key], b[key])
        if "reward/rule_serverrules.short" in a:
            assert a["reward/rule_serverrules.short"] == b["reward/server0_127.0.0.1"]
    assert not any(TOKEN in path.read_text(errors="replace") for path in Path(remote).rglob("*") if path.is_file()
                   and path.stat().st_size < 10_000_000)


@pytest.mark.slow
def test_a_reward_server_that_stops_answering_ends_the_run_with_4_naming_it(serve, tmp_path):
    """Issue 41's watchdog: the server holds step 3's request (its 4th: after the evaluation before training
    and steps 1-2) far longer than the run's deadline for scoring (20 x its median + 3 s: well before the whole
    step's), under a 1-hour reward.remote.timeout_s. The run names the server, checkpoints steps 1-2 (nothing
    of step 3 was applied) and exits 4 without waiting for the request; once the server answers again, the
    same command resumes from step 2 to the end."""
    released, asked = threading.Event(), []

    def answer(request: dict) -> tuple[int, object]:
        asked.append(len(request["responses"]))
        if len(asked) == 4:
            released.wait(600)
        return length_scores(request)

    server = serve(answer)
    out = tmp_path / "run"
    args = ["train", "ppo", "-o", str(out), "--set", "train.max_steps=4", "--set", "rollout.prompts_per_step=4",
            "--set", "rollout.samples_per_prompt=2", "--set", "rollout.max_new_tokens=3", "--set", "eval.max_new_tokens=3",
            "--set", "ppo.advantage_estimator=grpo", "--set", "eval.every_steps=0", "--set", "eval.score_prompts=8",
            "--set", "task.eval_size=16", "--set", "log.backends=[]", "--set", "log.every_steps=1",
            "--set", "checkpoint.save_model=false", "--set", "checkpoint.every_steps=1",
            "--set", "reward.remote.timeout_s=3600", "--set", f"reward.sources=[{{url: '{server.url}'}}]",
            "--set", "watchdog.floor_s=3", "--set", "watchdog.factor=20", "--set", "watchdog.first_s=120",
            "--set", "watchdog.grace_s=30"]
    started = time.monotonic()
    try:
        proc = run_cli(args, check=False, timeout=300)
    finally:
        released.set()
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert time.monotonic() - started < 120  # the deadline (seconds), not the request's hour
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("hpcrlhf: error: step 3 hung: reward did not finish within "), error
    assert f"; still waiting for reward.sources[0].url '{server.url}'" in error, error
    assert error.endswith("; checkpointed at step 2; rerun the same command to resume from its checkpoint step_000002")
    rerun = run_cli(args, timeout=300)
    assert "resumed from" in rerun.stderr and "step_000002" in rerun.stderr
    steps = [m["step"] for m in read_metrics(out) if "reward/server0_127.0.0.1" in m]
    assert steps == [1, 2, 3, 4], steps
