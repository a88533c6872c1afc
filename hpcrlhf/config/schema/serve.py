"""`hpcrlhf serve-reward`: reward sources served over HTTP to jobs elsewhere (`ServeRewardConfig`).

The same `reward` and `rules` sections a job's reward takes, plus where and how the server listens:
loopback and a token by default (docs/rewards.md#serving-rewards-hpcrlhf-serve-reward).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from hpcrlhf.config.schema.checks import PathText, require, require_finite
from hpcrlhf.config.schema.online import RewardConfig, require_in_job
from hpcrlhf.config.schema.rules import RulesConfig
from hpcrlhf.config.schema.sections import TaskConfig
from hpcrlhf.errors import ConfigError

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address or name (`127.0.0.1`, `::1`, `localhost`)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServeRewardConfig:
    """Serve reward sources (reward models, built-in rules, `package.module:function`s) over the
    reward-server protocol of docs/rewards.md#reward-servers."""

    reward: RewardConfig = field(default_factory=RewardConfig)
    """What scores a response: `reward.sources` (reward models and rules, weighted and summed, as in
    a job; servers too). The shaping (`reward.clip`, `running_norm`, the penalties) is the asking
    job's, not applied here."""
    rules: RulesConfig = field(default_factory=RulesConfig)
    """Settings of the built-in rules that `reward.sources` names."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The bundled task, for the `task` and `task_partial` rules."""
    trust_remote_code: bool = False
    """Let transformers run code shipped inside a reward model folder."""
    host: str = LOOPBACK
    """The address to listen on. The default, loopback, is reachable from this machine only; give
    an address of another interface (or 0.0.0.0, every interface) to serve jobs on other nodes."""
    port: int = 8000
    """The port to listen on; 0: a free one (written to `<output_dir>/server.json`)."""
    token_file: PathText | None = None
    """A file holding the token requests must bring (`Authorization: Bearer ...`); null: a new
    random token, written to `<output_dir>/token` (readable by you only)."""
    no_token: bool = False
    """Serve without a token: any process that can connect is answered (loopback only)."""
    output_dir: PathText = "runs/serve-reward"
    """Where the server writes `server.json` (its URL and the token's file, for the jobs that ask
    it) and, with token_file null, `token`."""
    max_batch: int = 256
    """Responses scored at once: requests that arrive together are scored in one batch (a reward
    model's forward passes then take `reward.batch_size` of them at a time)."""
    batch_wait_ms: float = 5.0
    """How long a request waits for others to join its batch, in milliseconds."""
    max_request_mb: int = 64
    """Largest request body, in MiB (a batch of long responses with their rows)."""

    def __post_init__(self) -> None:
        require_finite(self, "serve-reward")
        require_in_job(self.reward, "serve-reward (a server serves its sources itself)")
        require(bool(self.host), "host", self.host, "give an address, e.g. 127.0.0.1")
        require(0 <= self.port <= 65535, "port", self.port, "use 0 (any free port) to 65535")
        require(self.max_batch >= 1, "max_batch", self.max_batch, "use at least 1")
        require(self.batch_wait_ms >= 0, "batch_wait_ms", self.batch_wait_ms, "use 0 or more milliseconds")
        require(self.max_request_mb >= 1, "max_request_mb", self.max_request_mb, "use at least 1")
        if self.no_token and self.token_file is not None:
            raise ConfigError(f"no_token: true and token_file {self.token_file!r} contradict each other; drop one")
        if self.no_token and not is_loopback(self.host):
            raise ConfigError(f"no_token: true with host {self.host!r}: every host that reaches this address could ask "
                              "the server; serve other interfaces with a token (leave no_token false), or use host "
                              f"{LOOPBACK}")
