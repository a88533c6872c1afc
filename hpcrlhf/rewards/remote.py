"""Reward servers: a `reward.sources[i].url` source, asked over HTTP (docs/rewards.md#reward-servers).

The protocol: `POST <url>` with the JSON body

    {"prompts": ["...", ...], "responses": ["...", ...], "rows": [{...}, ...]}

one entry per response (at most `reward.remote.batch_size`), each row the prompt's dataset row, and
the header `Authorization: Bearer <token>` when the source has a token (`token_file`, `token_env`).
The server answers status 200 with

    {"scores": [0.5, ...]}

one finite real number per response, in their order. Up to `reward.remote.concurrency` requests
are in flight at once; each may take `reward.remote.timeout_s`. A request that fails in a way a
later try may not -- no connection, no answer in time, status 429 or 5xx, an answer that is not
JSON, holds another number of scores, a NaN, Inf or anything but a number -- is tried again
`reward.remote.retries` times, after `backoff_s`, then twice that, ...; then the run fails with a
RewardServerError naming the URL and what came back. Any other status (401 and 403: the token;
404: the URL) fails at once. So a server never hangs the run and never gives it a wrong reward
silently. The token is read when the job starts and sent in the header only: never written to a
file, a log or an error.
"""

from __future__ import annotations

import json
import math
import os
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from hpcrlhf.config.schema import RemoteRewardConfig, RewardSourceConfig
from hpcrlhf.data.sources import brief
from hpcrlhf.errors import ConfigError, RewardServerError
from hpcrlhf.logs import get_logger
from hpcrlhf.rewards.response import Response
from hpcrlhf.rewards.workers import run_parallel
from hpcrlhf.run.signals import active_watchdog

log = get_logger()

RETRIED_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
"""HTTP statuses a later try may not get: the server busy, restarting, or behind a proxy that is."""


class Failed(Exception):
    """One try failed; `retry`: whether another may succeed. The message says what came back."""

    def __init__(self, what: str, retry: bool = True):
        super().__init__(what)
        self.retry = retry


def read_token(source: RewardSourceConfig, field: str) -> str | None:
    """The source's bearer token from its file or environment variable (None: it has neither); a
    ConfigError names the setting when the file or variable holds none."""
    if source.token_file is not None:
        try:
            token = Path(source.token_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(f"{field}.token_file: cannot read {source.token_file!r} ({e.strerror}); give a file "
                              "holding the reward server's token") from None
        if not token:
            raise ConfigError(f"{field}.token_file: {source.token_file!r} is empty; put the reward server's token in it")
        return token
    if source.token_env is not None:
        token = os.environ.get(source.token_env, "").strip()
        if not token:
            raise ConfigError(f"{field}.token_env: the environment variable {source.token_env} is not set (or empty) "
                              "where the job runs; export it with the reward server's token, or use token_file")
        return token
    return None


def scores_in(body: bytes, expected: int) -> list[float]:
    """The scores of a server's answer `body` to `expected` responses; Failed says what is wrong."""
    try:
        reply = json.loads(body)
    except ValueError:  # not JSON, or not UTF-8
        raise Failed(f"an answer that is not JSON: {brief(body.decode('utf-8', 'replace'))}") from None
    scores = reply.get("scores") if isinstance(reply, dict) else None
    if not isinstance(scores, list):
        raise Failed(f"no list of scores (a JSON object with \"scores\" was expected): {brief(reply)}")
    if len(scores) != expected:
        raise Failed(f"{len(scores)} scores for {expected} responses")
    for i, score in enumerate(scores):
        if isinstance(score, bool) or not isinstance(score, (int, float)):
            raise Failed(f"score {i} is {brief(score)}, not a number")
        if not math.isfinite(score):
            raise Failed(f"score {i} is {score}")
    return [float(score) for score in scores]


class RemoteSource:
    """A reward server as a reward source (the `hpcrlhf.rewards.response.Scorer` protocol): the
    source's `url`, or the replicas a job started for it (`served`: their URLs and token), each batch
    sent to the replica with the fewest batches in flight (the next in turn among equals) and retried
    there."""

    def __init__(self, source: RewardSourceConfig, cfg: RemoteRewardConfig, field: str,
                 served: tuple[Sequence[str], str] | None = None):
        self.cfg = cfg
        if served is None:
            self.urls, self.token = [source.url], read_token(source, field)
            self.labels = [f"{field}.url {source.url!r}"]
        else:
            self.urls, self.token = list(served[0]), served[1]
            self.labels = [f"{field} (the job's reward server {url!r})" for url in self.urls]
        self.in_flight = [0] * len(self.urls)
        self._turn = 0
        self._pick = threading.Lock()
        self.stopping = threading.Event()
        """Set when a run stops waiting (a stop request): retries wait no longer."""


    def scores(self, responses: Sequence[Response]) -> list[float]:
        size = self.cfg.batch_size
        batches = [responses[start : start + size] for start in range(0, len(responses), size)]
        self.stopping.clear()
        watchdog = active_watchdog()
        if watchdog is not None:  # a hung reward phase names the server(s)
            watchdog.waiting_for(*self.labels)
        answers = run_parallel(self._ask, batches, self.cfg.concurrency, self.stopping.set)
        return [score for answer in answers for score in answer]

    def probe(self) -> None:
        """One empty request to each replica, no retry: RewardServerError unless every one answers it
        (so it listens, speaks the protocol and takes the token)."""
        for k in range(len(self.urls)):
            try:
                self._post([], k)
            except Failed as e:
                raise RewardServerError(f"{self.labels[k]}: the reward server answered {e}") from None

    def _ask(self, batch: Sequence[Response]) -> list[float]:
        """The scores of one batch, tried up to 1 + retries times on the replica with the fewest batches
        in flight; RewardServerError after the last."""
        with self._pick:  # ties go round the replicas: batches asked one after another spread too
            n = len(self.urls)
            k = min(range(n), key=lambda i: (self.in_flight[i], (i - self._turn) % n))
            self.in_flight[k] += 1
            self._turn = (k + 1) % n
        try:
            return self._tries(batch, k)
        finally:
            with self._pick:
                self.in_flight[k] -= 1

    def _tries(self, batch: Sequence[Response], k: int) -> list[float]:
        tries, delay, label = self.cfg.retries + 1, self.cfg.backoff_s, self.labels[k]
        for attempt in range(1, tries + 1):
            try:
                return self._post(batch, k)
            except Failed as e:
                if not e.retry or attempt == tries or self.stopping.is_set():
                    raise RewardServerError(self._failure(e, attempt, label)) from None
                log.warning(f"{label}: try {attempt} of {tries} failed ({e}); trying again in {delay:g} s")
            if self.stopping.wait(delay):
                raise RewardServerError(f"{label}: stopped while waiting to try again")
            delay *= 2
        raise AssertionError("unreachable")

    def _failure(self, e: Failed, attempt: int, label: str) -> str:
        if not e.retry:
            return f"{label}: the reward server answered {e}"
        return (f"{label}: the reward server failed {attempt} time(s) in a row (1 try and reward.remote.retries="
                f"{self.cfg.retries}), the last with {e}; check that it runs and answers the protocol of "
                "docs/rewards.md#reward-servers, or raise reward.remote.timeout_s / retries")

    def _post(self, batch: Sequence[Response], k: int = 0) -> list[float]:
        body = json.dumps({"prompts": [r.prompt for r in batch], "responses": [r.text for r in batch],
                           "rows": [dict(r.row) for r in batch]}).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.urls[k], data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as reply:
                answer = reply.read()
        except urllib.error.HTTPError as e:
            raise self._status(e.code, _body(e)) from None
        except (TimeoutError, OSError) as e:  # URLError is an OSError; a timeout while reading is TimeoutError
            raise Failed(_unreachable(e, self.cfg.timeout_s)) from None
        return scores_in(answer, len(batch))

    def _status(self, status: int, body: str) -> Failed:
        what = f"status {status}" + (f": {_said(body)}" if body else "")
        if status in RETRIED_STATUSES:
            return Failed(what)
        if status == 400:  # it read the request and says what is wrong with it (a row a rule cannot score)
            return Failed(what, retry=False)
        if status in (401, 403):
            fix = ("check the token in the source's token_file or token_env" if self.token is not None else
                   "it sent no token: give the source one with token_file or token_env")
            return Failed(f"{what} (refused); {fix}", retry=False)
        return Failed(f"{what}; check the URL and that the server speaks the protocol of docs/rewards.md#reward-servers",
                      retry=False)


def _said(body: str) -> str:
    """What a server said: the text of its `{"error": ...}` (hpcrlhf serve-reward's), else the body, briefly."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    return error[:2000] if isinstance(error, str) else brief(body)


def _body(e: urllib.error.HTTPError) -> str:
    try:
        return e.read(2000).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _unreachable(e: BaseException, timeout_s: float) -> str:
    reason: Any = getattr(e, "reason", e)
    if isinstance(reason, TimeoutError) or "timed out" in str(reason):
        return f"no answer within {timeout_s:g} s (reward.remote.timeout_s)"
    return f"no connection: {reason}"
