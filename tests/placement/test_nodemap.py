"""The node map: deterministic first-fit placement, what the runtime reads from it, and every
reason a layout is rejected, each named with its field, value and fix."""

from __future__ import annotations

import json

import pytest

from hpcrlhf.placement import Device, NodeMap, render_text
from hpcrlhf.placement.memory import GIB, MemoryParts

from .helpers import config, find, plan, problems

D = Device
HYBRID_1X8 = ["engine.zero_stage=3", "placement.nodes=1", "placement.actor.gpus_per_node=8",
              "placement.critic.gpus_per_node=8", "placement.ref.gpus_per_node=8", "placement.reward.gpus_per_node=8",
              "placement.vllm.engines=4", "placement.vllm.tensor_parallel_size=2",
              "placement.vllm.gpu_memory_utilization=0.35", "placement.colocate=[[actor, critic, ref, reward, vllm]]"]
"""ppo-7b on one node of 8 GPUs with every role on every GPU (OpenRLHF's hybrid engine layout)."""
HYBRID_1X8_SLEEP = [*HYBRID_1X8, "placement.vllm.gpu_memory_utilization=0.9", "placement.vllm.sleep=true",
                    "placement.actor.sleep=true", "placement.critic.sleep=true"]
"""... with vLLM claiming 0.9 of each GPU: it fits only with the engines and trained roles taking turns."""


# ---------------------------------------------------------------- placement
def test_default_config_plans_on_one_gpu_with_everything_colocated():
    m = plan()
    assert (m.nodes, m.gpus_per_node) == (1, 1)
    assert m.colocated == (("actor", "critic", "ref"),)  # reward and vllm have no GPUs by default
    assert [o.label for o in m.devices[D(0, 0)]] == ["actor[0]", "critic[0]", "ref[0]"]
    assert m.role_ranks("reward") == [] and m.engines == () and m.vllm is None


def test_roles_take_disjoint_gpus_first_fit_in_role_order():
    m = plan("ppo-7b")
    assert m.role_ranks("actor") == [D(0, g) for g in range(4)]
    assert m.role_ranks("critic") == [D(0, g) for g in range(4, 8)]
    assert m.role_ranks("ref") == [D(1, 0), D(1, 1)] and m.role_ranks("reward") == [D(1, 2), D(1, 3)]
    assert m.engines == tuple((D(1, g),) for g in range(4, 8))
    assert all(len(occupants) == 1 for occupants in m.devices.values())


def test_multi_node_roles_rank_node_major_and_tp_groups_stay_on_one_node():
    m = plan("ppo-70b", "placement.actor.nodes=2", "placement.ref.nodes=2", "placement.actor.gpus_per_node=4",
             "placement.ref.gpus_per_node=4", "placement.vllm.engines=2", "placement.allow_idle_gpus=true")
    assert m.role_ranks("actor") == [D(0, g) for g in range(4)] + [D(1, g) for g in range(4)]
    assert m.role_ranks("ref") == m.role_ranks("actor")  # colocated: exactly the same GPUs, rank for rank
    assert m.role_ranks("critic") == [D(2, g) for g in range(8)] == m.role_ranks("reward")
    # the critic+reward unit skipped the half-full nodes 0 and 1; engines fill their free halves
    assert m.engines == (tuple(D(0, g) for g in range(4, 8)), tuple(D(1, g) for g in range(4, 8)))
    assert [o.label for o in m.devices[D(1, 5)]] == ["vllm1 tp1/4"]
    assert D(3, 0) not in m.devices and m.idle_nodes == 1  # node 3 idle: counted, not listed
    with pytest.raises(ValueError, match="unknown role 'policy'"):
        m.role_ranks("policy")


def test_vllm_colocated_with_training_roles_tiles_their_gpus_by_node():
    m = plan("ppo-7b", *HYBRID_1X8, nodes=1, gpus=8)
    assert m.colocated == (("actor", "critic", "ref", "reward", "vllm"),)
    assert m.engines == tuple((D(0, g), D(0, g + 1)) for g in range(0, 8, 2))
    assert [o.label for o in m.devices[D(0, 3)]] == ["actor[3]", "critic[3]", "ref[3]", "reward[3]", "vllm1 tp1/2"]
    assert m.memory(D(0, 3)) == sum((m.occupant_memory(o) for o in m.devices[D(0, 3)]), MemoryParts())


def test_json_has_plain_types_and_round_trips():
    m = plan("ppo-70b")
    text = m.to_json()
    data = json.loads(text)
    assert json.dumps(data, indent=2, sort_keys=True) + "\n" == text  # stable: sorted keys, plain values

    def plain(v):
        return isinstance(v, (str, int, float, bool, type(None))) or (
            isinstance(v, list) and all(plain(x) for x in v)) or (
            isinstance(v, dict) and all(isinstance(k, str) and plain(x) for k, x in v.items()))
    assert plain(data)
    assert data["roles"]["actor"]["ranks"][0] == {"node": 0, "gpu": 0}
    assert data["vllm"]["engines"][3]["devices"] == [{"node": 3, "gpu": g} for g in range(4, 8)]
    assert data["devices"][0]["occupants"] == ["actor[0]", "ref[0]"]
    assert data["devices"][0]["memory"]["total"] == m.memory(D(0, 0)).total
    assert data["colocated"] == [["actor", "ref"], ["critic", "reward"]]


def test_cli_allocation_overrides_the_recipe_and_the_config_is_not_changed():
    cfg_shape = plan("ppo-7b", "placement.allow_idle_gpus=true", nodes=3, gpus=8)
    assert (cfg_shape.nodes, cfg_shape.gpus_per_node) == (3, 8)
    assert D(2, 0) not in cfg_shape.devices and cfg_shape.idle_nodes == 1  # node 2 idle


# ---------------------------------------------------------------- rejections
def test_more_gpus_asked_than_allocated():
    found = problems("ppo-7b", nodes=1, gpus=8)
    find(found, "placement = 1 node x 8 GPUs", "the roles ask for 16 GPUs", "actor 4", "critic 4", "ref 2",
         "reward 2", "vllm 4 (4 engines x TP 1)", "allocation has 8", "colocate roles", "--nodes 2")
    find(problems("ppo-7b", nodes=1, gpus=14), "placement = 1 node x 14 GPUs", "placement.vllm.engines=2")
    found = problems("ppo-7b", "placement.ref.gpus_per_node=4", "placement.reward.gpus_per_node=4",
                     "placement.vllm.engines=2")
    find(found, "placement = 2 nodes x 8 GPUs", "ask for 18 GPUs", "colocate [actor, ref] (saves 4 GPUs)",
         "colocate [critic, reward] (saves 4 GPUs)")


def test_role_larger_than_a_node_or_the_allocation():
    found = problems("ppo-7b", "placement.actor.gpus_per_node=16")
    find(found, "placement.actor.gpus_per_node = 16", "more than the 8 GPUs of a node",
         "nodes: 2, gpus_per_node: 8 for the same 16 GPUs")
    found = problems("ppo-7b", "placement.critic.nodes=3", "placement.critic.gpus_per_node=1")
    find(found, "placement.critic.nodes = 3", "more than the 2 nodes", "--nodes 3")


def test_tp_group_larger_than_a_node():
    found = problems("ppo-7b", "placement.vllm.engines=1", "placement.vllm.tensor_parallel_size=16")
    find(found, "placement.vllm.tensor_parallel_size = 16", "must sit on one node", "at most 8")


def test_tp_group_without_a_node_with_enough_free_gpus():
    # 2 x 4: actor+ref take node 0 gpus 0-2, the critic node 1 gpus 0-2: one free GPU per node
    found = problems(None, "rollout.backend=vllm", "placement.nodes=2", "placement.gpus_per_node=4",
                     "placement.actor.gpus_per_node=3", "placement.critic.gpus_per_node=3",
                     "placement.ref.gpus_per_node=3", "placement.colocate=[[actor, ref]]", "placement.vllm.engines=1",
                     "placement.vllm.tensor_parallel_size=2", "train.global_batch_size=96", "train.micro_batch_size=32",
                     "rollout.prompts_per_step=24")
    find(found, "placement.vllm.engines = 1", "need 2 free GPUs on one node", "cannot span nodes",
         "at most 1 are free", "TP size of at most 1")


def test_role_that_no_longer_fits_after_the_roles_before_it():
    found = problems(None, "placement.nodes=2", "placement.gpus_per_node=4", "placement.actor.gpus_per_node=3",
                     "placement.critic.gpus_per_node=3", "placement.ref.gpus_per_node=2", "placement.colocate=[]",
                     "train.global_batch_size=96", "train.micro_batch_size=32", "rollout.prompts_per_step=24")
    find(found, "placement.ref = 1 node x 2 GPUs", "needs 2 free GPUs on each of 1 nodes",
         "free GPUs are node 0: 1, node 1: 1", "colocate it")


def test_colocated_roles_need_the_same_shape():
    found = problems("ppo-7b", "placement.colocate=[[actor, ref]]")
    find(found, "placement.colocate = ['actor', 'ref']", "same shape", "actor 1 node x 4 GPUs, ref 1 node x 2 GPUs",
         "same nodes and gpus_per_node")


def test_colocated_vllm_must_cover_its_group_exactly_and_stay_within_nodes():
    hybrid = HYBRID_1X8
    found = problems("ppo-7b", *hybrid, "placement.vllm.engines=2", nodes=1, gpus=8)
    find(found, "placement.vllm.engines = 2", "colocated with actor, which has 8 GPUs", "2 engines x TP 2 take 4",
         "placement.vllm.engines=4")
    found = problems(None, "rollout.backend=vllm", "placement.nodes=2", "placement.gpus_per_node=2",
                     "placement.actor.nodes=2", "placement.critic.nodes=2", "placement.ref.nodes=2",
                     "placement.actor.gpus_per_node=2", "placement.critic.gpus_per_node=2",
                     "placement.ref.gpus_per_node=2", "placement.vllm.engines=1",
                     "placement.vllm.tensor_parallel_size=4", "train.micro_batch_size=16")
    find(found, "placement.vllm.tensor_parallel_size = 4", "2 GPUs per node", "would span nodes", "dividing 2")


def test_batches_must_split_over_the_ranks():
    found = problems("ppo-7b", "train.micro_batch_size=3")
    find(found, "train.global_batch_size = 128", "micro_batch_size (3) x the actor's 4 ranks = 12",
         "use train.global_batch_size 120 or 132")
    find(found, "train.global_batch_size = 128", "the critic's 4 ranks")
    found = problems(None, "placement.gpus_per_node=3", "placement.actor.gpus_per_node=3",
                     "placement.critic.gpus_per_node=3", "placement.ref.gpus_per_node=3", "train.global_batch_size=96",
                     "train.micro_batch_size=32", "rollout.samples_per_prompt=3", "rollout.prompts_per_step=32")
    find(found, "rollout.prompts_per_step = 32", "does not split over the actor's 3 ranks", "e.g. 33")


def test_vllm_tp_must_divide_the_attention_heads():
    found = problems("ppo-7b", "model.path=Qwen/Qwen2.5-7B", "reward.sources=[{model: Qwen/Qwen2.5-7B}]",
                     "placement.vllm.engines=1", "placement.vllm.tensor_parallel_size=8",
                     "placement.allow_idle_gpus=true", nodes=3, gpus=8)
    find(found, "placement.vllm.tensor_parallel_size = 8", "28 attention heads of 'Qwen/Qwen2.5-7B'", "4 KV heads",
         "use tensor_parallel_size 1, 2, 4 or 28")


def test_rollout_must_split_over_the_engines():
    found = problems("ppo-7b", "placement.vllm.engines=3", "placement.allow_idle_gpus=true")
    find(found, "placement.vllm.engines = 3", "1024 sequences of a rollout", "do not split evenly over 3 engines",
         "use 1, 2 or 4 engines", "rollout.prompts_per_step 1152 (a multiple of 384)")


def test_gpu_over_its_memory_names_device_occupants_and_fixes():
    found = problems("ppo-7b", "engine.zero_stage=0")
    actor = find(found, "placement.gpu_memory_gb = 80.0", "node 0 gpu 0 (and 3 more GPUs with the same roles) needs "
                 "102.4 GiB, more than its 80.0 GiB", "actor[0] weights 12.6 + gradients 12.6 + optimizer 75.3 + "
                 "activations 2.0 GiB", "placement.actor.zero_stage=3")
    assert "offload_optimizer" not in actor  # needs ZeRO: not offered at stage 0
    find(found, "placement.gpu_memory_gb", "node 0 gpu 4", "critic[0]", "placement.critic.zero_stage=3")
    # colocation: the vLLM claim on top of training roles
    found = problems("ppo-7b", *HYBRID_1X8, "placement.vllm.gpu_memory_utilization=0.9", nodes=1, gpus=8)
    find(found, "placement.gpu_memory_gb = 80.0", "node 0 gpu 0 (and 7 more GPUs", "actor[0] weights 1.6",
         "critic[0] weights 1.5", "reward[0] weights 1.5 GiB",
         "vllm0 tp0/2 weights 6.3 + kv_cache 65.7 GiB", "colocate fewer roles",
         "fix: a lower placement.vllm.gpu_memory_utilization (vLLM claims 0.9 x 80.0 GiB here)")
    found = problems("ppo-7b", "engine.gradient_checkpointing=false")
    find(found, "placement.gpu_memory_gb", "activations 114.0", "engine.gradient_checkpointing=true")


def test_sleep_fits_a_colocated_layout_by_phase_and_names_the_phase_over_memory():
    from hpcrlhf.placement.memory import activation_bytes
    from hpcrlhf.placement.roles import sequence_tokens
    from hpcrlhf.placement.shapes import shape_of

    found = problems("ppo-7b", *HYBRID_1X8, "placement.vllm.gpu_memory_utilization=0.9", nodes=1, gpus=8)
    find(found, "placement.gpu_memory_gb", "placement.vllm.sleep=true", "placement.actor.sleep=true",
         "placement.critic.sleep=true")  # offered as a fix
    m = plan("ppo-7b", *HYBRID_1X8_SLEEP, nodes=1, gpus=8)
    gpu = next(iter(m.devices))
    # by hand: ZeRO-3 over 8 ranks in bf16 (weights 2P, gradients 2P, optimizer 12P, all / 8); vLLM TP 2
    # claims 0.9 x 80 GiB per GPU (its weights 2P/2, the rest KV cache)
    actor, critic, ref, reward = (m.roles[r].params for r in ("actor", "critic", "ref", "reward"))
    cfg = config("ppo-7b", *HYBRID_1X8_SLEEP)
    acts = activation_bytes(shape_of("meta-llama/Llama-2-7b-hf"), tokens=sequence_tokens(cfg),
                            micro_batch=cfg.train.micro_batch_for(8), checkpointing=True)
    frozen = 2 * ref // 8 + 2 * reward // 8
    trained = 16 * actor // 8 + 16 * critic // 8  # not exact to the byte: each part is rounded down alone
    claim, vllm_weights = int(0.9 * 80 * GIB), 2 * actor // 2
    phases = {k: v.total for k, v in m.phase_memory(gpu).items()}
    assert phases["generate"] == frozen + claim  # the trained roles asleep
    assert phases["train"] == pytest.approx(frozen + trained + 2 * acts, abs=8)  # vLLM asleep
    assert phases["weight_sync"] == pytest.approx(frozen + trained + vllm_weights, abs=8)  # KV cache still asleep
    assert m.peak(gpu)[0] == "generate" and phases["generate"] < 80 * GIB < m.memory(gpu).total
    assert "memory by phase (sleep: actor, critic, vllm)" in render_text(m)
    # still too big: the phase that does not fit is named
    found = problems("ppo-7b", *HYBRID_1X8_SLEEP, "placement.vllm.gpu_memory_utilization=0.99", nodes=1, gpus=8)
    find(found, "placement.gpu_memory_gb = 80.0", "GiB while vLLM generates, more than its 80.0 GiB",
         "actor[0] 0.0 GiB", "vllm0 tp0/2 weights 6.3 + kv_cache")


def test_vllm_claim_too_small_for_its_weights_or_one_sequence():
    found = problems("ppo-70b", "placement.vllm.gpu_memory_utilization=0.3")
    find(found, "placement.vllm.gpu_memory_utilization = 0.3", "each engine GPU gets 24.0 GiB", "weights takes 32.1",
         "KV cache for 0 tokens, less than one sequence", "= 2048)", "raise gpu_memory_utilization")


@pytest.mark.parametrize("overrides, start, needles", [
    (["placement.actor.gpus_per_node=0", "placement.allow_idle_gpus=true"], "placement.actor = 1 node x 0 GPUs",
     ["the policy is always trained, which needs the actor role", "placement.actor.gpus_per_node to 1 or more"]),
    (["placement.critic.gpus_per_node=0", "placement.allow_idle_gpus=true"], "placement.critic = 1 node x 0 GPUs",
     ["ppo.advantage_estimator is 'gae'", "needs the critic role, but it has no GPUs",
      "set placement.critic.nodes and gpus_per_node", "critic-free ppo.advantage_estimator"]),
    (["placement.ref.nodes=0", "placement.allow_idle_gpus=true"], "placement.ref = 0 nodes x 2 GPUs",
     ["ppo.init_kl_coef is 0.01", "needs the ref role", "ppo.init_kl_coef=0 and ppo.kl_loss_coef=0"]),
    (["placement.reward.gpus_per_node=0", "placement.allow_idle_gpus=true"], "placement.reward",
     ["reward.sources has 1 reward model(s)", "needs the reward role", "set placement.reward.nodes"]),
    (["ppo.advantage_estimator=grpo", "rollout.samples_per_prompt=4", "rollout.prompts_per_step=256"],
     "placement.critic = 1 node x 4 GPUs", ["'grpo', so the critic role is never used",
                                                 "set placement.critic.gpus_per_node=0"]),
    (["reward.sources=[{rule: task}]"], "placement.reward = 1 node x 2 GPUs",
     ["0 reward model(s), so the reward role is never used", "placement.reward.gpus_per_node=0"]),
    (["ppo.init_kl_coef=0"], "placement.ref", ["kl_loss_coef 0.0, so the ref role is never used"]),
    (["placement.vllm.engines=0", "placement.allow_idle_gpus=true"], "placement.vllm.engines = 0",
     ["rollout.backend is 'vllm'", "set placement.vllm.engines", "or rollout.backend=hf"]),
    (["rollout.backend=hf", "placement.runtime=local"], "placement.vllm.engines = 4",
     ["rollout.backend is 'hf', so the vllm role is never used", "placement.vllm.engines=0, or rollout.backend=vllm"]),
])
def test_roles_needed_without_gpus_and_gpus_for_unused_roles(overrides, start, needles):
    find(problems("ppo-7b", *overrides), start, *needles)


def test_idle_gpus_suggest_engines_that_would_fit():
    found = problems("ppo-7b", nodes=3, gpus=8)
    find(found, "placement = 3 nodes x 8 GPUs", "8 of 24 GPUs would idle (node 2 gpus 0-7)",
         "placement.vllm.engines=8 (4 more engine(s) of TP 1)", "--nodes 2", "placement.allow_idle_gpus=true")
    found = problems("ppo-13b", "placement.ref.gpus_per_node=3")
    find(found, "placement = 4 nodes x 8 GPUs", "1 of 32 GPUs would idle (node 2 gpu 7)", "allow_idle_gpus=true")


def test_inherited_offload_needs_the_roles_zero_stage():
    found = problems("ppo-70b", "placement.actor.zero_stage=0")
    find(found, "placement.actor.zero_stage = 0", "optimizer offload (from engine.offload_optimizer) needs ZeRO",
         "set placement.actor.zero_stage to 1, 2 or 3, or placement.actor.offload_optimizer=false")
    found = problems("ppo-7b", "placement.ref.offload_params=true")
    find(found, "placement.ref.zero_stage = 2", "parameter offload needs parameter sharding",
         "placement.ref.zero_stage=3")


def test_an_allocation_needs_nodes_and_gpus():
    find(problems("ppo-7b", nodes=0), "placement.nodes = 0", "at least one")


def test_every_problem_is_listed_at_once():
    found = problems("ppo-7b", "train.micro_batch_size=3", "placement.vllm.tensor_parallel_size=16",
                     "placement.critic.gpus_per_node=0", "model.path=acme/x", nodes=1, gpus=8)
    keys = {p.partition(" = ")[0] for p in found}
    assert {"placement.critic", "model.path", "train.global_batch_size",
            "placement.vllm.tensor_parallel_size"} <= keys, found


def test_node_map_is_a_frozen_value():
    m = plan()
    assert isinstance(m, NodeMap)
    with pytest.raises(AttributeError):
        m.nodes = 2
    assert m.gpu_memory == 80 * GIB
