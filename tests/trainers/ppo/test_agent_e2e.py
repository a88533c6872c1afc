"""PPO with multi-turn rollouts (the `agent` section) end to end through the real CLI: trajectories
whose tools misbehave in every way train without a crash, each mistake counted; the model's tokens
alone are learned from (the engine's log-probs equal the trainer's on them)."""

from __future__ import annotations

import json

import pytest

from hpcrlhf.run.metrics import read_metrics
from tests.engines.test_rollout import eos_prone
from tests.launch_helpers import run_cli

QUIET = ["--set", "log.tensorboard=false", "--set", "eval.every_steps=0", "--set", "log.every_steps=1"]


def train_rows(out) -> list[dict]:
    return [m for m in read_metrics(out) if "rollout/score" in m]


def short_turned(family: str, prompts: list[str], folder) -> str:
    """The untrained tiny model of `family` made to end its turns early (EOS likely after these user
    prompts), saved with its tokenizer: several turns fit in a trajectory."""
    from hpcrlhf.agents.render import ChatRenderer
    from hpcrlhf.models.loading import load_causal_lm, load_tokenizer
    from hpcrlhf.models.tiny import build_tiny_model_dir

    base = str(build_tiny_model_dir(family))
    tokenizer, model = load_tokenizer(base), load_causal_lm(base, attn_implementation="sdpa")
    renderer = ChatRenderer(tokenizer)
    rendered = [renderer.prompt([{"role": "user", "content": p}]) for p in prompts]
    model.load_state_dict(eos_prone(model, rendered, tokenizer.eos_token_id, alpha=0.1))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_a_second_family_trains_through_tools_that_fail_in_every_way(tmp_path):
    """Tiny qwen2 (untrained), GAE, the hf backend, a user's environment (tests.agents.envs:Calculator)
    and a parser that turns each model turn into a call by its length (tests.agents.envs:by_length):
    malformed calls, an unknown tool, bad arguments, a tool that raises and one that hangs past
    agent.step_timeout_s are answered to the model or end their trajectory -- never the run -- and
    each is counted; the environment's tokens are no targets, so the engine's log-probs of the
    model's tokens equal the trainer's."""
    problems = [{"prompt": f"What is {a} times {a + 3}?", "answer": str(a * (a + 3))} for a in range(1, 65)]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(p) + "\n" for p in problems))
    model = short_turned("qwen2", [p["prompt"] for p in problems[:10]], tmp_path / "model")
    out = tmp_path / "run"
    run_cli(["train", "ppo", "-o", str(out), "--set", f"model.path={model}", "--set", f"data.train_path={rows}",
             "--set", "data.apply_chat_template=true", "--set", "task.name=null", "--set", "train.max_steps=3",
             "--set", "ppo.advantage_estimator=gae", "--set", "rollout.prompts_per_step=8",
             "--set", "rollout.samples_per_prompt=2", "--set", "rollout.max_new_tokens=24",
             "--set", "agent={environment: 'tests.agents.envs:Calculator', tool_parser: 'tests.agents.envs:by_length', "
                      "max_turns: 4, max_tokens: 160, step_timeout_s: 0.5, max_failed_share: 1.0}",
             "--set", "reward.sources=[{env: true}]", *QUIET])
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    totals = {key: sum(r.get(key, 0.0) for r in rows) for key in rows[-1].keys() | rows[0].keys()}
    for kind in ("malformed", "unknown", "bad_arguments", "raised"):
        assert totals[f"agent/tool_errors/{kind}"] > 0, sorted(totals)
    assert totals["agent/timeouts"] > 0 and totals["agent/tool_calls/multiply"] > 0
    assert totals["agent/env_tokens"] > 0 and all(1 <= r["agent/turns"] <= 4 for r in rows)
    assert all(r["reward/env"] == r["agent/episode_reward"] for r in rows)
    # the environment's answers sit between the model's turns, masked: the model's tokens line up
    assert max(r["rollout/logprob_max_diff"] for r in rows) < 1e-4
    assert rows[-1]["train/value_loss"] > 0 and "timing/train_critic" in rows[-1]
