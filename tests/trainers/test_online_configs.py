"""Online-job settings are checked before anything starts: each mistake names the field, the
value and the fix. Also the derived numbers of a PPO plan."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import PPOConfig, RSConfig, TrainConfig
from hpcrlhf.errors import ConfigError
from hpcrlhf.trainers.batches import PPOPlan


@pytest.mark.parametrize("overrides, message", [
    (["ppo.advantage_estimator=grpo", "rollout.samples_per_prompt=1"], "rollout.samples_per_prompt: 1 gives grpo no group"),
    (["train.global_batch_size=48"], "train.global_batch_size: 48 does not divide the 128 sequences"),
    (["reference.precompute=true"], "reference.precompute: true needs the training sequences in advance"),
    (["reference.offload=true"], "set engine.zero_stage=3"),
    (["ppo.dual_clip=0.5"], "ppo.dual_clip: 0.5 is invalid: use c > 1"),
    (["ppo.clip_eps=1.5"], "ppo.clip_eps"),
    (["rollout.temperature=0"], "rollout.temperature: 0"),
    (["ppo.advantage_estimator=ppo"],
     "'ppo' is not one of 'gae', 'grpo', 'dr_grpo', 'rloo', 'reinforce++', 'reinforce_baseline'"),
    (["reward.sources=[]"], "reward.sources: [] is invalid: give at least one"),
    (["reward.sources=[{model: a, rule: task}]"], "exactly one of `model`"),
    (["ppo.tis_cap=0.5"], "ppo.tis_cap: 0.5 is invalid: use null"),
    (["ppo.is_mode=mask"], "ppo.is_mode: 'mask' is invalid: it drops tokens whose weight pi_old/pi_rollout lies "
     "outside [ppo.is_floor, ppo.tis_cap], but ppo.tis_cap is null (no correction): set ppo.tis_cap=2"),
    (["ppo.is_mode=clip", "ppo.tis_cap=2"], "'clip' is not one of 'truncate', 'mask', 'seq_mask'"),
    (["ppo.is_floor=1.5", "ppo.tis_cap=2"], "ppo.is_floor: 1.5 is invalid: use a value in (0, 1]"),
    (["ppo.is_floor=0.5"], "ppo.is_floor: 0.5 is invalid: it bounds the importance weights from below, but "
     "ppo.tis_cap is null"),
    (["rollout.max_staleness=2"], "rollout.max_staleness: 2 trains on samples up to 2 updates old without "
     "correcting their per-token ratios: set ppo.tis_cap=2"),
    (["rollout.max_staleness=-1"], "rollout.max_staleness: -1 is invalid"),
    (["rollout.length_key=length"], "rollout.length_key: 'length' is invalid: fixed per-prompt lengths are set per "
     "request in a vLLM engine: set rollout.backend=vllm, or rollout.length_key=null"),
    (["rollout.backend=vllm", "rollout.length_key=length", "agent={environment: 'tests.agents.envs:Countdown'}",
      "agent.max_tokens=64"], "rollout.length_key: 'length' is invalid: it is a benchmark setting that fixes every "
     "response's length; an agent's turns end where the model ends them"),
    (["rollout.backend=vllm", "rollout.partial=true"], "rollout.partial: True is invalid: it continues generations "
     "across weight syncs, but rollout.max_staleness is 0 (nothing is under way at a sync): set "
     "rollout.max_staleness=1 or more, or rollout.partial=false"),
    (["rollout.partial=true", "rollout.max_staleness=1"], "rollout.partial: True is invalid: it pauses generations "
     "inside a vLLM engine; rollout.backend hf generates each batch in one call of the training process, which "
     "cannot be paused: set rollout.backend=vllm, or rollout.partial=false"),
    (["rollout.backend=vllm", "rollout.partial=true", "rollout.max_staleness=1"], "rollout.partial: True is invalid: "
     "a paused sample goes on under newer weights than its first tokens', which the per-token ratios must correct: "
     "set ppo.tis_cap=2"),
    (["rollout.backend=vllm", "rollout.stream_order=arrival"], "rollout.stream_order: 'arrival' is invalid: it takes "
     "each step's groups as the engine ends them, but rollout.max_staleness is 0 (each step generates its own batch): "
     "set rollout.max_staleness=1 or more, or rollout.stream_order=plan"),
    (["rollout.stream_order=arrival", "rollout.max_staleness=1"], "rollout.stream_order: 'arrival' is invalid: "
     "rollout.backend hf generates each batch in one call of the training process, in plan order: set "
     "rollout.backend=vllm, or rollout.stream_order=plan"),
    (["rollout.stream_order=fifo"], "'fifo' is not one of 'plan', 'arrival'"),
    (["rollout.backend=vllm", "rollout.max_staleness=1", "rollout.stale_groups=keep"], "rollout.stale_groups: "
     "'keep' is invalid: plan order trains each step's planned prompts and drops none: it applies to "
     "rollout.stream_order=arrival; set that, or rollout.stale_groups=drop"),
    (["rollout.min_engine_step_s=0.02"], "rollout.min_engine_step_s: 0.02 is invalid: it slows the steps of the vLLM "
     "engine loop; rollout.backend hf has none: set rollout.backend=vllm, or rollout.min_engine_step_s=0"),
    (["rollout.backend=vllm", "rollout.max_staleness=1", "rollout.min_engine_step_s=-1"],
     "rollout.min_engine_step_s: -1.0 is invalid: use 0 (off) or a floor in seconds"),
    (["rollout.backend=vllm", "rollout.max_staleness=1", "rollout.min_engine_step_s=0.02", "placement.runtime=ray"],
     "rollout.min_engine_step_s: 0.02 is invalid: on Ray the engine actors run on engine loops with rollout.partial "
     "or rollout.stream_order arrival only"),
    (["rollout.backend=vllm", "placement.vllm.sleep=true", "rollout.max_staleness=1"],
     "placement.vllm.sleep: true swaps GPU memory between generation and training, but rollout.max_staleness 1 runs "
     "them at the same time: use rollout.max_staleness=0 with sleep, or placement.vllm.sleep=false"),
    (["rollout.backend=vllm", "placement.vllm.sleep=true", "rollout.min_engine_step_s=0.02"],
     "placement.vllm.sleep: true swaps GPU memory between generation and training, but rollout.min_engine_step_s "
     "runs the engine on an engine loop, which never sleeps"),
    (["placement.actor.sleep=true"], "placement.actor.sleep: true swaps GPU memory between vLLM generation and "
     "training, but rollout.backend is 'hf' (the actor generates itself): set placement.actor.sleep=false, or "
     "rollout.backend=vllm"),
    (["rollout.backend=vllm", "placement.ref.sleep=true"], "placement.ref.sleep: true, but only trained roles "
     "(actor, critic) sleep; a frozen role keeps its weights in CPU memory with placement.ref.offload_params=true"),
    (["rollout.backend=vllm", "engine.zero_stage=3", "engine.offload_params=true", "placement.critic.sleep=true"],
     "placement.critic.sleep: true moves the role's states off the GPU while vLLM generates, but its weights are "
     "kept in CPU memory already (engine.offload_params): set engine.offload_params=false, or placement.critic.sleep=false"),
])
def test_bad_ppo_settings_fail_with_the_field_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(PPOConfig, None, overrides)


@pytest.mark.parametrize("overrides, message", [
    (["train.max_steps=10"], "rs.iterations x rs.steps_per_iteration"),
    (["rs.mode=dpo", "rollout.samples_per_prompt=1"], "pairs a prompt's best and worst"),
    (["rs.iterations=0"], "rs.iterations: 0 is invalid"),
    (["rollout.max_staleness=1"], "rollout.max_staleness: 1 is invalid: rejection sampling generates each round"),
    (["rollout.backend=vllm", "rollout.max_staleness=1", "rollout.partial=true"],
     "rollout.partial: True is invalid: ppo only; rejection sampling"),
    (["rollout.backend=vllm", "rollout.length_key=length"], "rollout.length_key: 'length' is invalid: ppo only"),
    (["rollout.backend=vllm", "rollout.min_engine_step_s=0.02"], "rollout.min_engine_step_s: 0.02 is invalid: ppo only"),
    (["rollout.backend=vllm", "rollout.stream_order=arrival", "rollout.max_staleness=1"],
     "rollout.stream_order: 'arrival' is invalid: ppo only"),
])
def test_bad_rs_settings(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(RSConfig, None, overrides)


@pytest.mark.parametrize("override", ["rollout.max_staleness=1", "rollout.length_key=length"])
def test_generate_refuses_the_ppo_only_rollout_settings(override):
    from hpcrlhf.config.schema import GenerateConfig

    with pytest.raises(ConfigError, match=f"rollout.{override.split('=')[0].split('.')[1]}: .* a ppo setting; generate "
                                          "answers each prompt once with the model as it is: drop it"):
        load_config(GenerateConfig, None, ["model.path=m", "rollout.backend=vllm",
                                           override])


def test_ppo_plan_numbers():
    plan = PPOPlan.build(TrainConfig(max_steps=10, global_batch_size=64, micro_batch_size=16), prompts_per_step=32,
                         samples_per_prompt=4, ppo_epochs=2, num_prompts=1000, data_parallel_size=2)
    assert (plan.prompts_per_rank, plan.sequences_per_rank, plan.minibatch_rows_per_rank) == (16, 64, 32)
    assert (plan.micro_batch_rows, plan.grad_accum_steps, plan.minibatches_per_epoch) == (16, 2, 2)
    assert (plan.updates_per_step, plan.steps_per_epoch, plan.total_steps) == (4, 31, 10)
    # every rank gets its own prompts; together they are one global batch without repeats
    rows = [plan.prompts_for_step(1000, 3, 0, r) for r in (0, 1)]
    assert len(set(rows[0]) | set(rows[1])) == 32
    assert plan.prompts_for_step(1000, 3, 0, 0) == rows[0]  # a pure function of the step


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts_per_step=3, data_parallel_size=2), "rollout.prompts_per_step: 3 does not split over 2 ranks"),
    (dict(num_prompts=16), "rollout.prompts_per_step: 32 is more than the 16 prompts"),
    (dict(data_parallel_size=8), "train.global_batch_size: 64 sequences per optimizer step is not a multiple"),
])
def test_ppo_plan_rejects_impossible_shapes(kwargs, message):
    args = dict(prompts_per_step=32, samples_per_prompt=4, ppo_epochs=1, num_prompts=1000, data_parallel_size=1) | kwargs
    with pytest.raises(ConfigError, match=message):
        PPOPlan.build(TrainConfig(global_batch_size=64, micro_batch_size=16), **args)


def test_rollouts_are_generated_ahead_only_within_the_run():
    from hpcrlhf.trainers.ppo.staleness import ahead_steps

    def launches(k: int, total: int = 5, launched: set[int] | None = None) -> list[list[int]]:
        """What each step launches ahead, given what the steps before it launched."""
        launched, out = set(launched or ()), []
        for step in range(total):
            out.append(ahead_steps(step, total, k, launched))
            launched.update(out[-1])
        return out

    # 5 steps: step i's rollout (0-based) is launched during step i - k (step 0 launches 1..k), never past the last
    assert launches(1) == [[1], [2], [3], [4], []]
    assert launches(2) == [[1, 2], [3], [4], [], []]
    assert launches(4) == [[1, 2, 3, 4], [], [], [], []]
    assert launches(2, launched={1, 2})[:2] == [[], [3]]  # resumed with steps 1 and 2 kept by the checkpoint
    assert not any(launches(0))  # synchronous
    launched_at = {0: 0, **{t: i for i, ts in enumerate(launches(2)) for t in ts}}  # plan order: lag min(s, k)
    assert [s - launched_at[s] for s in range(5)] == [0, 1, 2, 2, 2]


def test_several_ranks_share_rank_0s_engine_loop():
    """With rollout.max_staleness >= 1 rank 0 drives an engine loop for every local rank: the other ranks hold
    none, but know their launches are under way (`Rank0Rollout.streaming`, `streams`); synchronous: no loop."""
    import torch

    from hpcrlhf.engines.rollout.loop import StreamingRollout, engine_loop, streams
    from hpcrlhf.engines.rollout.shared import Rank0Rollout
    from hpcrlhf.trainers.online import rollout_engines

    env = SimpleNamespace(world_size=2, is_main=False, rank=1)
    engine = SimpleNamespace(zero_stage=2, module=torch.nn.Linear(1, 1), device=torch.device("cpu"))
    models = SimpleNamespace(env=env, pad_id=0, tokenizer=SimpleNamespace(eos_token_id=1))
    for sets, streaming in ((["rollout.partial=true", "rollout.max_staleness=2", "ppo.tis_cap=2"], True),
                            (["rollout.max_staleness=1"], True), ([], False)):
        cfg = load_config(PPOConfig, None, ["rollout.backend=vllm", *sets])
        rollout, _ = rollout_engines(engine, models, cfg)
        assert isinstance(rollout, Rank0Rollout) and rollout.engine is None and streams(rollout) == streaming, sets
        assert engine_loop(rollout) is None  # rank 0's loop logs the engine's figures
    loop_of_rank0 = StreamingRollout.__new__(StreamingRollout)  # no engine: only its loop is asked for
    loop_of_rank0.loop = "rank 0's loop"
    assert engine_loop(loop_of_rank0) == engine_loop(Rank0Rollout(loop_of_rank0, env, streaming=True)) == "rank 0's loop"
