"""The job's own reward servers in the node map (`reward.sources[i].servers`): reward-model servers
on GPUs (of their own, first fit after the engines, or sharing a colocation group's GPUs in turn),
rule servers on CPU cores of the nodes the roles use, shown in the plan's text and JSON, and every
layout they cannot have named with its field, value and fix."""

from __future__ import annotations

import json

import pytest

from hpcrlhf.errors import ConfigError
from hpcrlhf.placement import Device, render_text
from hpcrlhf.placement.memory import weight_bytes
from hpcrlhf.placement.roles import role_models, uses

from .helpers import config, find, plan, problems

D = Device
RM = "builtin:tiny-llama"
RULES_SERVED = "reward.sources=[{rule: task, servers: 3}, {rule: format, weight: 0.5}]"
MODELS_SERVED = f"reward.sources=[{{rule: task}}, {{model: '{RM}', servers: 3}}]"


def test_rule_servers_take_cpu_cores_round_robin_over_the_nodes_the_roles_use():
    m = plan("ppo-tiny-ray", RULES_SERVED, "placement.reward_server.cpus=2")
    servers = m.reward_servers
    assert [(s.index, s.source, s.replica, s.kind, s.node, s.device, s.cpus) for s in servers] == [
        (0, 0, 0, "rule", 0, None, 2), (1, 0, 1, "rule", 1, None, 2), (2, 0, 2, "rule", 0, None, 2)]
    assert {s.name for s in servers} == {"rule_task"}  # the source's metric name: reward/rule_task as in the job
    assert all(o.role != "reward_server" for occupants in m.devices.values() for o in occupants)  # no GPU taken
    text = render_text(m)
    assert "  cpu    reward_server0 + reward_server2  4 CPU cores" in text
    assert "  cpu    reward_server1                   2 CPU cores" in text
    assert "reward_server1  reward.sources[0] rule_task  node 1 CPU slot  2 CPU cores" in text
    doc = json.loads(m.to_json())
    assert doc["reward_servers"][1] == {"server": 1, "source": 0, "name": "rule_task", "replica": 1, "kind": "rule",
                                        "node": 1, "device": None, "cpus": 2, "model": None, "params": 0, "memory": None}
    # the format rule is scored in the job: no server, and the plan without servers has none
    assert json.loads(plan("ppo-tiny-ray").to_json())["reward_servers"] == []


def test_model_servers_take_free_gpus_first_fit_after_the_engines():
    m = plan("ppo-tiny-ray", MODELS_SERVED.replace("servers: 3", "servers: 4"), nodes=2, gpus=6)
    # first fit: the engines fill node 0 first, then each server takes node 1's lowest free GPU
    assert m.engines == ((D(0, 2), D(0, 3)), (D(0, 4), D(0, 5)))
    assert [s.device for s in m.reward_servers] == [D(1, 2), D(1, 3), D(1, 4), D(1, 5)]
    assert [o.label for o in m.devices[D(1, 3)]] == ["reward_server1"]
    assert "reward_server" not in {r for g in m.colocated for r in g}
    # each holds its reward model (a value model) in the job's precision, and nothing else
    cfg = config("ppo-tiny-ray", MODELS_SERVED)
    params = m.roles["critic"].params  # the critic: the same tiny llama as a value model
    assert all(s.params == params and s.model == RM and s.cpus == 0 for s in m.reward_servers)
    assert m.memory(D(1, 4)).total == m.memory(D(1, 4)).weights == params * weight_bytes(cfg.engine.precision)


def test_colocated_model_servers_share_their_groups_gpus_in_turn_and_their_memory_adds_up():
    m = plan("ppo-tiny-ray", MODELS_SERVED, "placement.colocate=[[actor, ref], [critic, reward_server]]")
    assert m.role_ranks("critic") == [D(0, 1), D(1, 1)]
    assert [s.device for s in m.reward_servers] == [D(0, 1), D(1, 1), D(0, 1)]  # server k on the group's k-th GPU
    assert [o.label for o in m.devices[D(0, 1)]] == ["critic[0]", "reward_server0", "reward_server2"]
    assert ("critic", "reward_server") in m.colocated
    one = m.reward_servers[0].memory.weights
    assert m.memory(D(0, 1)).weights == m.memory(D(1, 1)).weights + one  # two servers on node 0's GPU, one on node 1's
    assert m.memory(D(1, 1)).weights == m.roles["critic"].memory.weights + one
    doc = json.loads(m.to_json())
    assert doc["reward_servers"][2]["device"] == {"node": 0, "gpu": 1} and doc["reward_servers"][2]["kind"] == "model"
    assert [d["occupants"] for d in doc["devices"] if (d["node"], d["gpu"]) == (1, 1)] == [["critic[1]", "reward_server1"]]
    assert "reward_server  3 servers" in render_text(m) and "3 on GPUs, 0 on CPU cores" in render_text(m)


def test_served_reward_models_are_the_servers_models_not_the_reward_roles():
    cfg = config("ppo-tiny-ray", f"reward.sources=[{{model: '{RM}', servers: 1}}, {{model: other/rm}}]")
    assert role_models(cfg)["reward"] == [("reward.sources[1].model", "other/rm")]
    assert role_models(cfg)["reward_server"] == [("reward.sources[0].model", RM)]
    assert uses(cfg)["reward"] == (True, "reward.sources has 1 reward model(s) scored in the job (1 served by the "
                                         "job's reward servers)")
    # every reward model served: GPUs given to the reward role would idle
    found = problems("ppo-tiny-ray", f"reward.sources=[{{model: '{RM}', servers: 1}}]",
                     "placement.reward={nodes: 1, gpus_per_node: 1}", "placement.colocate=[[actor, ref]]", nodes=2, gpus=5)
    find(found, "placement.reward = 1 node x 1 GPU", "0 reward model(s) scored in the job (1 served", "never used")


def test_servers_that_do_not_fit_are_named_with_the_fix():
    found = problems("ppo-tiny-ray", MODELS_SERVED)  # 8 GPUs taken by the roles and engines
    find(found, "placement = 2 nodes x 4 GPUs", "reward_server 3", "colocate the reward servers", "--nodes 3")
    # one server over a GPU's memory: the fix names the servers
    found = problems("ppo-tiny-ray", MODELS_SERVED, "placement.colocate=[[actor, ref], [critic, reward_server]]",
                     "placement.gpu_memory_gb=0.004")
    find(found, "placement.gpu_memory_gb", "reward_server0", "fewer reward servers on these GPUs")


def test_more_servers_on_a_node_than_its_ports_is_a_problem():
    assert len(plan("ppo-tiny-ray", "reward.sources=[{rule: task, servers: 20}]").reward_servers) == 20  # 10 a node
    found = problems("ppo-tiny-ray", "reward.sources=[{rule: task, servers: 21}]")
    find(found, "reward.sources[].servers = 21 servers", "node 0 would run 11 reward servers",
         "at most 10 (its share of the job's port block)", "use at most 20 servers on these 2 nodes")


@pytest.mark.parametrize("overrides, needles", [
    (["placement.colocate=[[vllm, reward_server]]"],
     ["placement.colocate[0]", "['vllm', 'reward_server']", "add one (e.g. [critic, reward_server])"]),
    (["placement.reward_server.cpus=0"], ["placement.reward_server.cpus", "at least 1 CPU"]),
])
def test_bad_server_placement_fails_when_the_config_loads(overrides, needles):
    with pytest.raises(ConfigError) as info:
        config("ppo-tiny-ray", *overrides)
    for needle in needles:
        assert needle in str(info.value)
