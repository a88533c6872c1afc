"""The bundled calculator task and its environment: rows, the score, the tool's schema, and that its
SFT conversations are the very tokens a rollout of the same episode holds."""

from __future__ import annotations

import pytest
from transformers.utils import get_json_schema

from hpcrlhf.agents.calculator import Calculator
from hpcrlhf.agents.environments import load_environment
from hpcrlhf.agents.episode import Episode, EpisodeLimits, Setup
from hpcrlhf.agents.parsers import hermes
from hpcrlhf.agents.pool import EnvPool
from hpcrlhf.agents.render import ChatRenderer
from hpcrlhf.agents.scheduler import run_episodes
from hpcrlhf.data.tasks import MULTIPLY_TOOL, CalculatorTask
from hpcrlhf.errors import ConfigError
from hpcrlhf.models.loading import load_tokenizer
from tests.agents.test_scheduler import ScriptedEngine


def test_rows_scores_and_the_tools_schema():
    task = CalculatorTask()
    rows = task.sft_rows("train", 400)
    assert rows[:50] == task.sft_rows("train", 50)  # a prefix: growing the data reshuffles nothing
    tool = [r for r in rows if len(r["messages"]) == 4]
    assert 0.2 < len(tool) / len(rows) < 0.4 and all(r["tools"] == [MULTIPLY_TOOL] for r in rows)
    a, b = map(int, tool[0]["messages"][0]["content"][:-1].split("*"))
    assert 10 <= min(a, b) and max(a, b) <= 99
    assert tool[0]["messages"][1]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": a, "b": b}}
    assert [m["content"] for m in tool[0]["messages"][2:]] == [str(a * b), f"= {a * b}"]
    train = {r["prompt"] for r in task.prompt_rows("train", 2000)}
    assert not train & {r["prompt"] for r in task.prompt_rows("eval", 200)}  # held-out problems
    assert [task.score("37*59=", x) for x in ("= 2183", "2183<|eos|>", " =2183", "= 2184", "= ", "")] == [1, 1, 1, 0, 0, 0]
    assert task.partial_score("37*59=", "= 2180") == 0.75
    assert get_json_schema(Calculator.multiply) == MULTIPLY_TOOL  # what SFT shows is the environment's tool
    with pytest.raises(ConfigError, match="calculator has no preference rows"):
        task.preference_rows("train", 4)


def test_the_environment_judges_the_answer():
    env = Calculator()
    assert env.reset({"prompt": "37*59="}, 0) == "37*59=" and env.multiply(37, 59) == 2183
    assert (env.step("= 2183").reward, env.step("= 2183").info) == (1.0, {"success": True})
    assert env.step("= 2000").reward == 0.0 and env.step("= 2000").done


def test_sft_conversations_are_the_tokens_a_rollout_of_the_same_episode_holds(tiny_llama):
    """The model saying what an SFT row's assistant says, turn by turn, against the environment: the
    trajectory's tokens and model-token mask equal the row's tokens and target mask."""
    tok = load_tokenizer(tiny_llama)
    rows = [r for r in CalculatorTask().sft_rows("train", 40)][:6]
    renderer = ChatRenderer(tok, [MULTIPLY_TOOL])
    pool = EnvPool(2)
    try:
        setup = Setup(load_environment("hpcrlhf.agents.calculator:Calculator", {}), (), renderer, hermes, tok,
                      EpisodeLimits(max_tokens=160), pool)
        episodes = [Episode(str(i), {"prompt": r["messages"][0]["content"]}, i, setup) for i, r in enumerate(rows)]
        said = {str(i): [m for m in r["messages"] if m["role"] == "assistant"] for i, r in enumerate(rows)}

        def say(key, turn):
            m = said[key][turn]
            text = tok.apply_chat_template([{"role": "user", "content": "x"}, m], tools=[MULTIPLY_TOOL], tokenize=False)
            opened = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[MULTIPLY_TOOL], tokenize=False,
                                             add_generation_prompt=True)
            return text[len(opened):text.rindex(tok.eos_token)], 1, True

        run_episodes(ScriptedEngine(tok, say), episodes, pool, max_new_tokens=64, seed=1)
    finally:
        pool.close()
    for ep, row in zip(episodes, rows):
        ids, mask = renderer.conversation(row["messages"])
        assert ep.prompt_ids + ep.ids == ids and [False] * len(ep.prompt_ids) + ep.action == mask
        assert ep.record.status == "done" and ep.record.reward == 1.0
