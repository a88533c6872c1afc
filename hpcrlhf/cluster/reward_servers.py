"""The job's own reward servers (`reward.sources[i].servers`) on Ray: started where the node map puts
them, checked before the first step, stopped with the job.

Each server is a Ray actor (`RewardServerWorker`) that loads its one source (a reward model on its
GPU, or a rule on its CPU cores) and serves it over `hpcrlhf serve-reward`'s protocol from a thread
of its own process, so the server lives and dies with the actor: a crash is an actor death Ray
reports (the run stops with exit 4, naming the server). It listens on its node's address, on a port
of the job's block (the node's HPCRLHF_STORE_PORTS share, as the rendezvous stores do), and asks
every request for the job's token: a new one per start, written 0600 to `<run>/reward_servers/token`
and handed to the servers and the scorers over Ray, never in config.yaml, a log or a script.

`RewardServers.start` spawns them all at once (their loading overlaps the roles' setup);
`wait_healthy` waits for each to listen and answer an empty request with the token, within
`placement.reward_server.start_timeout_s`, naming the server, its node and the end of its log when one
does not; `served()` is what `reward_set(served=...)` takes; `close()` stops them.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import replace
from pathlib import Path

from hpcrlhf.cluster.reservation import Reservation
from hpcrlhf.cluster.worker_group import RoleWorker, Workers, busy
from hpcrlhf.config.schema import PPOConfig, RewardConfig, ServeRewardConfig
from hpcrlhf.errors import HpcrlhfError
from hpcrlhf.logs import get_logger
from hpcrlhf.engines.store_ports import store_ports
from hpcrlhf.placement.servers import ServerPlan
from hpcrlhf.rewards.remote import RemoteSource
from hpcrlhf.run.files import ensure_folder, write_secret

log = get_logger()

ROLE = "reward_server"


def server_config(cfg: PPOConfig, plan: ServerPlan) -> ServeRewardConfig:
    """What server `plan` serves: its source alone, at weight 1 (the job applies the source's weight),
    with the job's reward, rule and task settings; a rule server checks answers in as many processes
    as it has CPU cores."""
    source = replace(cfg.reward.sources[plan.source], servers=0, weight=1.0)
    rules = replace(cfg.rules, workers=plan.cpus) if plan.kind == "rule" else cfg.rules
    return ServeRewardConfig(reward=replace(cfg.reward, sources=(source,)), rules=rules, task=cfg.task,
                             trust_remote_code=cfg.model.trust_remote_code)


def write_server_token(run_dir: Path) -> tuple[str, Path]:
    """A new token for this start of the job's servers, in a new 0600 file (the last start's removed)."""
    folder = ensure_folder(run_dir / "reward_servers")
    path = folder / "token"
    if path.is_file() and not path.is_symlink():
        path.unlink()
    token = secrets.token_urlsafe(32)
    write_secret(path, token + "\n")
    return token, path


class RewardServerWorker(RoleWorker):
    """One reward server of the job, in its Ray actor."""

    def __init__(self, role: str, rank: int, world_size: int, cfg: ServeRewardConfig, token: str, out: str,
                 source: int) -> None:
        super().__init__(role, rank, world_size)
        self.cfg, self.token, self.out, self.source = cfg, token, Path(out), source
        self.server = None

    def start(self) -> str:
        """Load the source, listen on this node's address (a port of the job's block), serve: its URL. A
        failure is raised as a RuntimeError of its text (Ray cannot carry every exception type back), in
        which the source is named by its place in the job's reward.sources, not the server's own list."""
        try:
            return self._start()
        except Exception as e:  # noqa: BLE001 -- told to the driver, which names the server
            text = f"{type(e).__name__}: {e}".replace("reward.sources[0]", f"reward.sources[{self.source}]")
            raise RuntimeError(text) from None

    def _start(self) -> str:
        from hpcrlhf.engines.rendezvous import listen  # torch: in the server's actor only
        from hpcrlhf.rewards.server import ServerThread, build_app, load_scoring  # aiohttp, models: likewise

        score, sources = load_scoring(self.cfg)

        @busy
        def timed(worker, responses):  # its scoring counts as the worker's busy time (pop_busy)
            return score(responses)

        app = build_app(lambda responses: timed(self, responses), self.token, sources, self.cfg.max_batch,
                        self.cfg.batch_wait_ms / 1000, self.cfg.max_request_mb << 20)
        out = ensure_folder(self.out / f"server{self.rank}")
        self.server = ServerThread(app, listen(self.node_ip(), store_ports()), out, None)
        return self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class RewardServers(Workers):
    """The job's reward servers, one Ray actor each, placed as `reservation.node_map.reward_servers` says."""

    role = ROLE

    def __init__(self, cfg: PPOConfig, reservation: Reservation, run_dir: Path):
        import ray

        super().__init__()
        self.plans = reservation.node_map.reward_servers
        self.reward: RewardConfig = cfg.reward
        self.timeout_s = cfg.placement.reward_server.start_timeout_s
        self.token, self.token_path = write_server_token(Path(run_dir))
        out = str(Path(run_dir) / "reward_servers")
        remote = ray.remote(RewardServerWorker)
        self.workers, self.urls = [], [None] * len(self.plans)
        for plan in self.plans:
            options = (reservation.actor_options([plan.device]) if plan.device is not None
                       else reservation.cpu_slot_options(plan.index))
            self.workers.append(remote.options(**options).remote(ROLE, plan.index, len(self.plans),
                                                                 server_config(cfg, plan), self.token, out,
                                                                 plan.source))
        self._started = {w.start.remote(): plan.index for w, plan in zip(self.workers, self.plans)}
        self.placements = [(p.device,) if p.device is not None else () for p in self.plans]

    def __len__(self) -> int:
        return len(self.workers)

    def name(self, index: int) -> str:
        """`reward server 1 (rule_task, node 1 CPU cores)`."""
        plan = self.plans[index]
        where = str(plan.device) if plan.device is not None else f"node {plan.node} CPU cores"
        return f"reward server {index} ({plan.name}, {where})"

    def wait_healthy(self) -> None:
        """Every server listening and answering an empty request with the token, within the deadline;
        HpcrlhfError naming the first that did not (its node and why)."""
        import ray

        deadline = time.monotonic() + self.timeout_s
        pending = list(self._started)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(self._started[ref] for ref in pending)
                raise HpcrlhfError(f"{self.name(late[0])} did not start within placement.reward_server.start_timeout_s="
                                   f"{self.timeout_s:g} s ({len(late)} server(s) still loading); its log is in the Ray "
                                   "session's logs of that node: raise the timeout, or check the source loads")
            index = self._started[ready[0]]
            try:
                self.urls[index] = ray.get(ready[0])
            except Exception as e:  # noqa: BLE001 -- the server's own error, named with its server
                raise HpcrlhfError(f"{self.name(index)} failed to start: {_cause(e)}") from None
        for source, (urls, token) in self.served().items():
            RemoteSource(self.reward.sources[source], self.reward.remote, f"reward.sources[{source}]",
                         (urls, token)).probe()
        log.info(f"reward servers healthy: {', '.join(f'{self.name(i)} on {u}' for i, u in enumerate(self.urls))}")

    def served(self) -> dict[int, tuple[list[str], str]]:
        """Source index -> (its servers' URLs, the token): `reward_set(served=...)`."""
        out: dict[int, tuple[list[str], str]] = {}
        for plan, url in zip(self.plans, self.urls):
            if url is not None:
                out.setdefault(plan.source, ([], self.token))[0].append(url)
        return out

    def placed_name(self, index: int) -> str:
        return self.name(index)

    def on_node(self, node: int) -> list[str]:
        return [self.name(p.index) for p in self.plans if p.node == node]

    def close(self) -> None:
        """Stop every server (each removes its server.json) and end its actor."""
        import ray

        stops = [w.stop.remote() for w in self.workers]
        ray.wait(stops, num_returns=len(stops), timeout=30)
        for w in self.workers:
            ray.kill(w)
        self.workers = []


def _cause(error: BaseException) -> str:
    """What a server's start raised (RayTaskError wraps the worker's RuntimeError of its text)."""
    cause = getattr(error, "cause", None) or error
    return str(cause) if isinstance(cause, RuntimeError) else f"{type(cause).__name__}: {cause}"
