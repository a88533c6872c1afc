"""AgentRunner: a job's agent section loaded and checked, and prompt rows run as groups of trajectories
on the tiny llama (Hugging Face generate), in `generate`'s shape."""

from __future__ import annotations

import pytest

from hpcrlhf.agents.runner import AgentRunner
from hpcrlhf.agents.scheduler import mixed_seed
from hpcrlhf.config.schema.agent import AgentConfig
from hpcrlhf.engines.rollout.contract import SamplingParams
from hpcrlhf.engines.rollout.hf import HFRollout
from hpcrlhf.errors import AgentEnvError, ConfigError
from hpcrlhf.models.loading import load_causal_lm, load_tokenizer
from tests.engines.test_rollout import agent_eos_prone

COUNTDOWN = AgentConfig(environment="tests.agents.envs:Countdown", environment_args={"turns": 2}, max_tokens=64)
ROWS = [{"id": "a"}, {"id": "b"}, {"id": "c"}]


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return load_tokenizer(tiny_llama)


@pytest.fixture(scope="module")
def engine(tiny_llama, tok):
    model = load_causal_lm(tiny_llama, attn_implementation="sdpa")
    model.load_state_dict(agent_eos_prone(model, tok))  # turns end early: several fit in a trajectory
    return HFRollout(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, device="cpu")


def run(runner, engine, env_seed=11, seed=5, rows=ROWS, **origins):
    return runner.run(engine, rows, SamplingParams(n=2, max_new_tokens=10, seed=seed), env_seed, **origins)


def test_rows_run_as_groups_of_trajectories_in_generates_shape(tok, engine):
    runner = AgentRunner(COUNTDOWN, tok, chat=True)
    try:
        groups, stats = run(runner, engine)
        again, _ = run(runner, engine)
        other, _ = run(runner, engine, env_seed=12)
    finally:
        runner.close()
    assert (runner.schedule(synchronous=True), runner.schedule(synchronous=False)) == ("turn", "trajectory")
    assert [len(g) for g in groups] == [2, 2, 2] and ROWS[0] == {"id": "a"}  # reset got a copy of the row
    assert stats.env_calls == sum(1 + g.episode.turns + 1 for group in groups for g in group)  # reset, turns, finish
    for i, group in enumerate(groups):
        # one environment seed per row: both samples of a group meet the same instance of the task
        env_seed = mixed_seed(11, i)
        assert group[0].prompt_ids == group[1].prompt_ids
        assert f"start {env_seed % 10}" in tok.decode(group[0].prompt_ids)
        for g in group:
            record = g.episode
            assert record.status in ("done", "max_tokens", "max_turns") and 1 <= record.turns <= 2
            assert len(g.action_mask) == len(g.response_ids) == len(g.logprobs) and g.action_mask[0]
            model = [lp for lp, a in zip(g.logprobs, g.action_mask) if a]
            assert all(lp <= 0 for lp in model) and all(lp == 0 for lp, a in zip(g.logprobs, g.action_mask) if not a)
            assert g.finished == (record.status == "done")
            if record.turns == 2:  # the environment's "again" sits between the model's turns, masked
                assert not all(g.action_mask)
    assert any(g.episode.turns == 2 for group in groups for g in group)  # multi-turn: masked "again"s inside
    # the same seeds sample the same tokens; another environment seed starts other tasks
    assert [[g.response_ids for g in group] for group in again] == [[g.response_ids for g in group] for group in groups]
    seeds = [(mixed_seed(11, i) % 10, mixed_seed(12, i) % 10) for i in range(3)]
    changed = [a != b for a, b in seeds]
    assert [o[0].prompt_ids != g[0].prompt_ids for o, g in zip(other, groups)] == changed


def test_a_prompt_longer_than_data_max_length_fails_the_batch_naming_its_row(tok, engine):
    runner = AgentRunner(COUNTDOWN, tok, chat=True, max_prompt_tokens=5)
    try:
        with pytest.raises(AgentEnvError, match=r"\(row rows.jsonl:1, seed \d+\)\.reset: its first messages render to "
                                                r"\d+ tokens, more than data.max_length \(5\)"):
            run(runner, engine, origins=["rows.jsonl:1", "rows.jsonl:2", "rows.jsonl:3"])
    finally:
        runner.close()


def test_what_the_agent_section_names_is_checked_when_the_runner_is_built(tok):
    with pytest.raises(ConfigError, match="agent.environment 'tests.agents.envs:Nowhere'"):
        AgentRunner(AgentConfig(environment="tests.agents.envs:Nowhere"), tok, chat=True)
    with pytest.raises(ConfigError, match=r"agent.tools\[0\] 'tests.agents.envs:nothing'"):
        AgentRunner(AgentConfig(tools=("tests.agents.envs:nothing",)), tok, chat=True)
    with pytest.raises(ConfigError, match="set data.apply_chat_template=true"):
        AgentRunner(AgentConfig(environment="tests.agents.envs:Calculator"), tok, chat=False)  # its tools need a template
