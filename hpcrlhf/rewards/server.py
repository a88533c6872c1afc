"""`hpcrlhf serve-reward`: reward sources served over HTTP (aiohttp), for jobs elsewhere to ask with
`reward.sources=[{url: ..., token_file: ...}]` (the protocol: `hpcrlhf.rewards.remote`).

- `POST /score`: `{"prompts", "responses", "rows"}` in, `{"scores"}` out: the weighted sum of the
  served `reward.sources` for each response. Without the token (`Authorization: Bearer ...`):
  401. A body that is not such a request, or rows a rule cannot score (a missing field): 400 with
  the reason in `{"error": ...}`, which the asking job shows and stops on. A scorer that fails in
  another way (a bug, out of memory): 500 with the error, for each request of that batch; the server
  goes on serving.
- `GET /health`: `{"status": "ok", "sources": [...], "requests": N, "batches": M}`, no token
  needed (it tells nothing but that the server runs).

Requests that arrive together are scored in one batch (`Batcher`: up to `max_batch` responses,
waiting `batch_wait_ms` for more), one batch at a time in a thread of its own, so a reward model's
forward passes see large batches however small the requests. A batch that fails is scored again
request by request, so one bad request fails alone.

A reward model scores the text it is sent, prompt + response + its EOS, as a job scores with a
reward model of another vocabulary than the policy's (`RewardModelScorer`). On start the server
writes `<output_dir>/server.json` (`url`, `token_file`, `pid`), removed when it stops (SIGTERM,
Ctrl-C).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import secrets
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

from aiohttp import web

from hpcrlhf.config.schema import DataSourceConfig, ServeRewardConfig
from hpcrlhf.data.tasks import build_task
from hpcrlhf.engines.deepspeed_engine import FrozenModel
from hpcrlhf.engines.distributed import device_for
from hpcrlhf.errors import ConfigError, HpcrlhfError
from hpcrlhf.logs import get_logger
from hpcrlhf.models.loading import load_tokenizer
from hpcrlhf.models.value import ValueModel, load_value_model
from hpcrlhf.rewards.response import Response
from hpcrlhf.rewards.rules import check_rules
from hpcrlhf.config.schema import source_name
from hpcrlhf.rewards.sources import RewardSet
from hpcrlhf.run.files import ensure_folder, replace_file, write_secret

log = get_logger()

Score = Callable[[Sequence[Response]], list[float]]
"""The served sources: one score per response."""


class BadRequest(Exception):
    """A request that is no reward request (the message says why)."""


def responses_in(body: Any, first: int) -> list[Response]:
    """The responses of a request body; BadRequest says what is wrong. Each is numbered from `first`
    (`request 12, response 3`) for the errors of the rules."""
    if not isinstance(body, dict):
        raise BadRequest("the body is not a JSON object with prompts, responses and rows")
    lists = {key: body.get(key) for key in ("prompts", "responses", "rows")}
    missing = [key for key, value in lists.items() if not isinstance(value, list)]
    if missing:
        raise BadRequest(f"no list {', '.join(map(repr, missing))} in the request")
    if len({len(value) for value in lists.values()}) != 1:
        raise BadRequest(f"prompts, responses and rows differ in length: {[len(v) for v in lists.values()]}")
    for i, (prompt, response, row) in enumerate(zip(*lists.values())):
        if not (isinstance(prompt, str) and isinstance(response, str) and isinstance(row, dict)):
            raise BadRequest(f"entry {i}: a prompt and a response are texts, a row an object")
    return [Response(prompt, response, (), row, f"request {first}, response {i}")
            for i, (prompt, response, row) in enumerate(zip(*lists.values()))]


class Batcher:
    """Scores the responses of requests that arrive together in one call of `score`."""

    def __init__(self, score: Score, max_batch: int, wait_s: float):
        self.score, self.max_batch, self.wait_s = score, max_batch, wait_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcrlhf-score")
        self.requests = self.batches = 0

    async def submit(self, responses: list[Response]) -> list[float]:
        done = asyncio.get_running_loop().create_future()
        await self.queue.put((responses, done))
        return await done

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            size, deadline = len(batch[0][0]), loop.time() + self.wait_s
            while size < self.max_batch:
                try:
                    item = await asyncio.wait_for(self.queue.get(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    break
                batch.append(item)
                size += len(item[0])
            try:
                results = await loop.run_in_executor(self.thread, self._scored, [responses for responses, _ in batch])
            except Exception as e:  # noqa: BLE001 -- a fault of the scorer (a bug, out of memory): each request
                results = [e] * len(batch)  # of the batch answers 500 with it, and the server goes on
            self.requests, self.batches = self.requests + len(batch), self.batches + 1
            for (_, done), result in zip(batch, results):
                if not done.cancelled():  # the client may have left
                    (done.set_exception if isinstance(result, BaseException) else done.set_result)(result)

    def _scored(self, requests: list[list[Response]]) -> list[Any]:
        """Each request's scores, or the error scoring it raised."""
        try:
            scores = self.score([r for request in requests for r in request])
        except HpcrlhfError as e:
            return [e] if len(requests) == 1 else [self._alone(request) for request in requests]  # which one: each alone
        out, start = [], 0
        for request in requests:
            out.append(scores[start : start + len(request)])
            start += len(request)
        return out

    def _alone(self, request: list[Response]) -> Any:
        try:
            return self.score(request)
        except HpcrlhfError as e:
            return e


def build_app(score: Score, token: str | None, sources: list[str], max_batch: int = 256, wait_s: float = 0.005,
              max_request_bytes: int = 64 << 20) -> web.Application:
    """The server's routes over `score` (see the module docstring); `token` None: none asked."""
    batcher = Batcher(score, max_batch, wait_s)
    counter = iter(range(1, 1 << 62))

    async def score_route(request: web.Request) -> web.Response:
        if token is not None and not _authorized(request.headers.get("Authorization", ""), token):
            return web.json_response({"error": "no valid token: send `Authorization: Bearer <token>` with the token "
                                               "of the server's token file"}, status=401)
        try:
            responses = responses_in(await request.json(loads=json.loads), next(counter))
        except (ValueError, UnicodeDecodeError):
            return web.json_response({"error": "the body is not JSON"}, status=400)
        except BadRequest as e:
            return web.json_response({"error": str(e)}, status=400)
        try:
            scores = await batcher.submit(responses)
        except HpcrlhfError as e:  # a row a rule cannot score: the asking job's data
            return web.json_response({"error": str(e)}, status=400)
        except Exception as e:  # noqa: BLE001 -- the server's own fault: said, never a hang
            log.warning(f"serve-reward: scoring failed: {type(e).__name__}: {e}")
            return web.json_response({"error": f"the reward server failed to score: {type(e).__name__}: {e}"},
                                     status=500)
        return web.json_response({"scores": scores})

    async def health_route(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sources": sources, "requests": batcher.requests,
                                  "batches": batcher.batches})

    async def start_batcher(app: web.Application):
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        batcher.thread.shutdown(wait=False, cancel_futures=True)

    app = web.Application(client_max_size=max_request_bytes)
    app.add_routes([web.post("/score", score_route), web.get("/health", health_route)])
    app.cleanup_ctx.append(start_batcher)
    return app


def _authorized(header: str, token: str) -> bool:
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def server_token(cfg: ServeRewardConfig, out: Path) -> tuple[str | None, Path | None]:
    """(token, its file): the token_file's, a new one written to `out/token`, or (None, None) with no_token."""
    if cfg.no_token:
        return None, None
    if cfg.token_file is not None:
        path = Path(cfg.token_file)
        try:
            token = path.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(f"token_file: cannot read {cfg.token_file!r} ({e.strerror}); give a file holding the "
                              "token, or leave token_file null for a new one") from None
        if not token:
            raise ConfigError(f"token_file: {cfg.token_file!r} is empty; put a token in it")
        return token, path.resolve()
    path = out / "token"
    if path.is_file() and not path.is_symlink():
        path.unlink()  # the last server's
    token = secrets.token_urlsafe(32)
    write_secret(path, token + "\n")
    return token, path.resolve()


def load_scoring(cfg: ServeRewardConfig) -> tuple[Score, list[str]]:
    """The served sources loaded (reward models on this process's device): (score, their metric names)."""
    check_rules(cfg)
    device = device_for(0)

    def load_rm(path: str, field: str) -> FrozenModel:
        pad = load_tokenizer(path, trust_remote_code=cfg.trust_remote_code, key=field).pad_token_id
        return FrozenModel(ValueModel(load_value_model(path, pad_token_id=pad, key=field,
                                                       trust_remote_code=cfg.trust_remote_code)), None, device)

    task = build_task(cfg.task, DataSourceConfig())
    rewards = RewardSet(cfg.reward, load_rm, None, task, device, cfg.trust_remote_code, cfg.rules)

    def score(responses: Sequence[Response]) -> list[float]:
        return rewards.score(responses)[0].tolist()

    return score, [source_name(i, s) for i, s in enumerate(cfg.reward.sources)]


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0: a free port) and listening; a ConfigError names the setting."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise ConfigError(f"port: cannot listen on {host}:{port} ({e.strerror}); use another port, or 0 for "
                          "a free one") from None


class ServerThread:
    """An app served on an already listening socket, on an event loop in a thread of its own: `start()`
    returns its URL once it answers and writes `<out>/server.json`; `stop()` removes the file and
    closes the socket. The program around it keeps its main thread (a Ray actor, signal handlers)."""

    def __init__(self, app: web.Application, sock: socket.socket, out: Path, token_path: Path | None):
        self.app, self.sock, self.info, self.token_path = app, sock, out / "server.json", token_path
        host, port = sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}/score"
        self._ready, self._failed = threading.Event(), None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="hpcrlhf-reward-server", daemon=True)

    def start(self, timeout_s: float = 60.0) -> str:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise HpcrlhfError(f"the reward server on {self.url} did not start within {timeout_s:g} s")
        if self._failed is not None:
            raise self._failed
        replace_file(self.info, json.dumps({"url": self.url, "token_file": str(self.token_path) if self.token_path
                                            else None, "pid": os.getpid()}, indent=1) + "\n")
        return self.url

    def stop(self, timeout_s: float = 30.0) -> None:
        self.info.unlink(missing_ok=True)
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout_s)
        self.sock.close()

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # noqa: BLE001 -- handed to start(), which raises it in its caller
            self._failed = e
            self._ready.set()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.SockSite(runner, self.sock).start()
            self._ready.set()
            await self._stop.wait()
        finally:
            await runner.cleanup()


def run_server(cfg: ServeRewardConfig) -> int:
    """Load the sources, serve until SIGTERM or Ctrl-C; 0 then."""
    out = ensure_folder(Path(cfg.output_dir))
    score, sources = load_scoring(cfg)
    token, token_path = server_token(cfg, out)
    app = build_app(score, token, sources, cfg.max_batch, cfg.batch_wait_ms / 1000, cfg.max_request_mb << 20)
    server = ServerThread(app, listening_socket(cfg.host, cfg.port), out, token_path)
    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        url = server.start()
        log.info(f"serve-reward: serving {', '.join(sources)} on {url} "
                 + (f"(token in {token_path})" if token_path else "(no token)") + f"; {server.info} says where")
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    log.info("serve-reward: stopped")
    return 0
