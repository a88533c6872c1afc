"""The job's own reward servers on the two-node Ray cluster: started where the node map puts them (a
reward model's on its GPU, rules' on CPU cores of each node), listening on their node's address in
the job's port block, answering only with the job's token, scoring as the sources do in a job; a
server that cannot start or misses its deadline is named with its node; a dead one is named as such;
closing leaves nothing listening."""

from __future__ import annotations

import os
import signal
import socket
import stat
import time
from pathlib import Path

import pytest
import torch

from hpcrlhf.cluster.bootstrap import PORTS_PER_NODE, RayPorts
from hpcrlhf.cluster.reservation import reserve
from hpcrlhf.cluster.reward_servers import RewardServers
from hpcrlhf.cluster.worker_group import dead_worker_message, lost_worker_error, worker_with_id
from hpcrlhf.config.jobspec import resolve_recipe
from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.errors import HpcrlhfError, RewardServerError
from hpcrlhf.models.loading import load_tokenizer
from hpcrlhf.placement import build_node_map
from hpcrlhf.rewards.sources import RewardSet
from tests.rewards.test_server import post
from tests.test_rewards import _make_rm, _reference_reward, _responses

COLOCATED = "placement.colocate=[[actor, ref], [critic, reward_server]]"


def job(*overrides: str) -> PPOConfig:
    return load_config(PPOConfig, resolve_recipe("ppo-tiny-ray"), [COLOCATED, *overrides])


@pytest.mark.slow
def test_servers_start_where_the_map_says_and_score_with_the_jobs_token_only(ray_cluster, tiny_llama, tmp_path):
    rm = _make_rm(tiny_llama, tmp_path / "rm", seed=5, mean=0.1, std=2.0)
    cfg = job(f"reward.sources=[{{rule: task, servers: 2, weight: 2.0}}, {{model: {rm}, servers: 1, weight: 0.5}}]",
              f"critic.path={tiny_llama}")
    node_map = build_node_map(cfg)
    assert [(s.kind, s.node, str(s.device)) for s in node_map.reward_servers] == [
        ("rule", 0, "None"), ("rule", 1, "None"), ("model", 0, "node 0 gpu 1")]
    reservation = reserve(node_map)
    (tmp_path / "run").mkdir()  # the job's run folder
    servers = RewardServers(cfg, reservation, tmp_path / "run")
    try:
        servers.wait_healthy()
        # each on its node's address, in that node's share of the job's port block
        gcs = int(ray_cluster.address.rsplit(":", 1)[1])
        for plan, url in zip(node_map.reward_servers, servers.urls):
            host, port = url.removeprefix("http://").removesuffix("/score").rsplit(":", 1)
            assert host == ray_cluster.node_ips[plan.node], (plan, url)
            assert int(port) in RayPorts.from_base(gcs + plan.node * PORTS_PER_NODE).stores, (plan, url)
        token_file = tmp_path / "run" / "reward_servers" / "token"
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        assert token_file.read_text().strip() == servers.token
        responses = _responses(load_tokenizer(tiny_llama), n=5)
        body = {"prompts": [r.prompt for r in responses], "responses": [r.text for r in responses],
                "rows": [dict(r.row) for r in responses]}
        assert post(servers.urls[0], body, None)[0] == 401 and post(servers.urls[2], body, "wrong")[0] == 401
        assert post(servers.urls[1], body, servers.token) == (200, {"scores": [1.0, 0.0, 1.0, 0.0, 1.0]})
        # the job's scorers ask them with the token: each source keeps its name, the job applies the weights
        served = servers.served()
        assert sorted(served) == [0, 1] and len(served[0][0]) == 2 and served[1][0] == [servers.urls[2]]
        rewards = RewardSet(cfg.reward, None, None, None, "cpu", served=served)
        total, parts = rewards.score(responses)
        assert list(parts) == ["rule_task", "model1_rm"]
        assert parts["rule_task"].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
        tok = load_tokenizer(rm)  # a server scores the text it is sent: prompt + response + EOS
        expected = [_reference_reward(rm, tok(r.prompt + r.text)["input_ids"] + [tok.eos_token_id]) for r in responses]
        assert parts["model1_rm"].tolist() == pytest.approx(expected, abs=1e-5)
        assert torch.allclose(total, 2.0 * parts["rule_task"] + 0.5 * parts["model1_rm"])
        # where each really runs: the rule servers without a GPU, the model's on the map's GPU
        import ray

        seen = ray.get([w.whereabouts.remote() for w in servers.workers])
        assert [(w.node_ip, w.visible_devices) for w in seen] == [
            (ray_cluster.node_ips[0], ""), (ray_cluster.node_ips[1], ""), (ray_cluster.node_ips[0], "1")]
        # a server that dies: its source fails after the retries, and the run finds the dead actor behind
        # it (exit 4, requeued), named with where it ran
        os.kill(seen[1].pid, signal.SIGKILL)
        with pytest.raises(RewardServerError) as failed:
            for _ in range(20):  # until a batch goes to the dead one
                rewards.score(responses)
        deadline, cause = time.monotonic() + 60, None
        while cause is None and time.monotonic() < deadline:  # Ray learns of the death within seconds
            cause = lost_worker_error(failed.value, [servers])
        assert isinstance(cause, ray.exceptions.RayActorError), failed.value
        assert dead_worker_message(cause, [servers]).startswith("reward server 1 (rule_task, node 1 CPU cores) died")
        assert worker_with_id(cause.actor_id, [servers]) is servers.workers[1]  # as the run looks it up
        folders = [tmp_path / "run" / "reward_servers" / f"server{i}" for i in range(3)]
        assert (folders[0] / "server.json").exists()
    finally:
        servers.close()
        reservation.release()
    assert not (folders[0] / "server.json").exists()  # stopped: its file removed, nothing listens
    host, port = servers.urls[0].removeprefix("http://").removesuffix("/score").rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=5).close()


@pytest.mark.slow
def test_a_server_that_cannot_start_or_misses_its_deadline_is_named_with_its_node(ray_cluster, tiny_llama, tmp_path):
    broken = tmp_path / "broken-rm"  # a model's config (the planner sizes it), but no weights nor tokenizer
    broken.mkdir()
    (broken / "config.json").write_text((Path(tiny_llama) / "config.json").read_text())
    cfg = job(f"reward.sources=[{{rule: task}}, {{model: {broken}, servers: 1}}]", f"critic.path={tiny_llama}")
    reservation = reserve(build_node_map(cfg))
    (tmp_path / "run").mkdir()
    servers = RewardServers(cfg, reservation, tmp_path / "run")
    try:
        with pytest.raises(HpcrlhfError, match=r"^reward server 0 \(model1_broken-rm, node 0 gpu 1\) failed to start: ") as e:
            servers.wait_healthy()
        # the worker's own error, its source named by its place in the job's reward.sources
        assert f"ModelPathError: reward.sources[1].model: '{broken}' has no tokenizer files" in str(e.value)
    finally:
        servers.close()
        reservation.release()
    cfg = job("reward.sources=[{rule: task, servers: 1}]", "placement.reward_server.start_timeout_s=0.001")
    reservation = reserve(build_node_map(cfg))
    (tmp_path / "run2").mkdir()
    servers = RewardServers(cfg, reservation, tmp_path / "run2")
    try:
        with pytest.raises(HpcrlhfError, match=r"^reward server 0 \(rule_task, node 0 CPU cores\) did not start within "
                                               r"placement.reward_server.start_timeout_s=0.001 s"):
            servers.wait_healthy()
    finally:
        servers.close()
        reservation.release()
