"""`hpcrlhf serve-reward`: reward sources served over HTTP (aiohttp), for jobs elsewhere to ask with
`reward.sources=[{url: ..., token_file: ...}]` (the protocol: `hpcrlhf.rewards.remote`).

- `POST /score`: `{"prompts", "responses", "rows"}` in, `{"scores"}` out: the weighted sum of the
  served `reward.sources` for each response. Without the token (`Authorization: Bearer ...`):
  401. A body that is not such a request, or rows a rule cannot score (a missing field): 400 with
  the reason in `{"error": ...}`, which the asking job shows and stops on.
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
            results = await loop.run_in_executor(self.thread, self._scored, [responses for responses, _ in batch])
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


def run_server(cfg: ServeRewardConfig) -> int:
    """Load the sources, serve until SIGTERM or Ctrl-C; 0 then."""
    check_rules(cfg)
    out = ensure_folder(Path(cfg.output_dir))
    token, token_path = server_token(cfg, out)
    device = device_for(0)

    def load_rm(path: str, field: str) -> FrozenModel:
        pad = load_tokenizer(path, trust_remote_code=cfg.trust_remote_code, key=field).pad_token_id
        return FrozenModel(ValueModel(load_value_model(path, pad_token_id=pad, key=field,
                                                       trust_remote_code=cfg.trust_remote_code)), None, device)

    task = build_task(cfg.task, DataSourceConfig())
    rewards = RewardSet(cfg.reward, load_rm, None, task, device, cfg.trust_remote_code, cfg.rules)
    sources = [source_name(i, s) for i, s in enumerate(cfg.reward.sources)]

    def score(responses: Sequence[Response]) -> list[float]:
        return rewards.score(responses)[0].tolist()

    app = build_app(score, token, sources, cfg.max_batch, cfg.batch_wait_ms / 1000, cfg.max_request_mb << 20)
    return asyncio.run(_serve(app, cfg, out, token_path, sources))


async def _serve(app: web.Application, cfg: ServeRewardConfig, out: Path, token_path: Path | None,
                 sources: list[str]) -> int:
    """Listen, write server.json, wait for SIGTERM or Ctrl-C, then remove it and stop."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(f"port: cannot listen on {cfg.host}:{cfg.port} ({e.strerror}); use another port, or 0 for "
                          "a free one") from None
    port = site._server.sockets[0].getsockname()[1]  # the one chosen for port 0
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    url = f"http://{host}:{port}/score"
    info = out / "server.json"
    replace_file(info, json.dumps({"url": url, "token_file": str(token_path) if token_path else None,
                                   "pid": os.getpid()}, indent=1) + "\n")
    log.info(f"serve-reward: serving {', '.join(sources)} on {url} "
             + (f"(token in {token_path})" if token_path else "(no token)") + f"; {info} says where")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        info.unlink(missing_ok=True)
        await runner.cleanup()
    log.info("serve-reward: stopped")
    return 0
