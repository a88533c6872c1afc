"""Names that are no local path and no hub repository this process can get fail at once, naming both
readings: the hub off (HF_HUB_OFFLINE), out of reach, or without the repository -- instead of ~55 s
(a model) or ~29 s (a dataset) of hub retries and an OSError. The hub is played by a local HTTP
server (or a closed port), never the network."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from hpcrlhf import hub
from hpcrlhf.engines.distributed import free_port
from tests.launch_helpers import run_cli

ONLINE = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The hub's repository API: `org/there` exists, `org/gated` is gated, nothing else does."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path.startswith(("/api/models/org/there", "/api/datasets/org/there")):
            self._reply(200, {"id": "org/there", "sha": "0" * 40, "private": False})
        elif self.path.startswith("/api/models/org/gated"):
            self._reply(403, {"error": "gated"}, {"X-Error-Code": "GatedRepo"})
        else:
            self._reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})

    def _reply(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def online(monkeypatch):
    """The hub switched on for this process, with a fresh probe cache; yields a setter of its endpoint."""
    import huggingface_hub.constants as constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read when huggingface_hub was imported
    hub._probe.cache_clear()
    yield lambda url: monkeypatch.setattr(constants, "ENDPOINT", url)
    hub._probe.cache_clear()


@pytest.fixture
def fake_hub(online):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    online(f"http://127.0.0.1:{server.server_address[1]}")
    yield
    server.shutdown()


@pytest.mark.parametrize("name, ok", [("gpt2", True), ("org/name", True), ("org/my-model.v2", True),
                                      ("models/nope", True), ("./models/nope", False), ("/abs/model", False),
                                      ("a/b/c", False), ("org/na me", False), ("x..y", False), ("", False)])
def test_what_can_be_a_hub_id(name, ok):
    assert hub.is_hub_id(name) is ok


@pytest.mark.parametrize("env, kind, said", [
    ({"HF_HUB_OFFLINE": "1"}, "model", "HF_HUB_OFFLINE=1"),
    ({"HF_HUB_OFFLINE": "true"}, "model", "HF_HUB_OFFLINE=true"),  # huggingface_hub's rule: 1/ON/YES/TRUE
    ({"HF_HUB_OFFLINE": "0"}, "model", None),
    ({"TRANSFORMERS_OFFLINE": "yes"}, "model", "TRANSFORMERS_OFFLINE=yes"),
    ({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "0"}, "dataset", None),  # datasets' own setting decides
    ({"HF_DATASETS_OFFLINE": "1"}, "dataset", "HF_DATASETS_OFFLINE=1"),
    ({}, "model", None),
])
def test_offline_setting_reads_the_environment_as_huggingface_does(monkeypatch, env, kind, said):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert hub.offline_setting(kind) == said


def test_an_unreachable_hub_is_said_at_once(online):
    online(f"http://127.0.0.1:{free_port()}")  # nothing listens: connection refused
    start = time.monotonic()
    why = hub.hub_problem("models/nope", "model")
    assert time.monotonic() - start < hub.PROBE_TIMEOUT_S
    assert why.startswith("the hub (http://127.0.0.1:") and "cannot be reached" in why, why
    assert "refused" in why.lower(), why


def test_the_hubs_answer_decides(fake_hub):
    assert hub.hub_problem("org/there", "model") is None
    assert hub.hub_problem("org/there", "dataset") is None
    assert hub.hub_problem("org/gated", "model") is None  # there; loading it needs a token with access
    assert "has no model of that name that your token can see" in hub.hub_problem("org/missing", "model")
    assert "has no dataset of that name" in hub.hub_problem("org/missing", "dataset")


def test_offline_names_the_setting(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.hub_problem("org/never-cached", "model") == ("the hub is off (HF_HUB_OFFLINE=1) and the local hub "
                                                             "cache lacks it")


def _unreachable_env() -> dict[str, str]:
    return {**ONLINE, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}


def test_cli_relative_model_path_that_does_not_exist_fails_at_once_without_the_hub(tmp_path):
    """`models/nope` (no such folder) on a machine whose hub does not answer: both readings named,
    at once (it took ~55 s of hub retries and ended in an OSError traceback)."""
    start = time.monotonic()
    proc = run_cli(["train", "sft", "-o", str(tmp_path / "run"), "--set", "model.path=models/nope"], check=False,
                   timeout=120, env=_unreachable_env())
    took = time.monotonic() - start
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "model.path: 'models/nope' is neither a local folder (nothing at " in proc.stderr, proc.stderr[-2000:]
    assert "nor a hub model: the hub (http://127.0.0.1:" in proc.stderr and "cannot be reached" in proc.stderr
    assert "give the path of a model folder" in proc.stderr
    assert took < 40, took


@pytest.mark.parametrize("path", ["./models/nope", "a/b/c"])
def test_cli_a_path_that_cannot_be_a_hub_id_is_a_missing_path(tmp_path, path):
    proc = run_cli(["train", "sft", "-o", str(tmp_path / "run"), "--set", f"model.path={path}"], check=False,
                   timeout=120, env=_unreachable_env())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"model.path: '{path}' does not exist (nothing at " in proc.stderr, proc.stderr[-2000:]


def test_cli_hub_style_data_name_fails_at_once_without_the_hub(tmp_path):
    """A data.train_path that is no file and a hub dataset name, hub unreachable: at once (was ~29 s)."""
    start = time.monotonic()
    proc = run_cli(["train", "sft", "-o", str(tmp_path / "run"), "--set", "data.train_path=org/nope",
                    "--set", "task.name=null"], check=False, timeout=120, env=_unreachable_env())
    took = time.monotonic() - start
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "data 'org/nope' is neither a local file or folder (nothing at " in proc.stderr, proc.stderr[-2000:]
    assert "nor a hub dataset: the hub (http://127.0.0.1:" in proc.stderr and "cannot be reached" in proc.stderr
    assert took < 40, took
