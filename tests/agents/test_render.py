"""Token-in/token-out: an observation's tokens are the chat template's difference, so prompt + the
model's tokens + observations add up to the template's whole render, whatever tokens the model
sampled; templates that rewrite history or ignore tools are refused at the start."""

from __future__ import annotations

import copy

import pytest

from hpcrlhf.agents.render import ChatRenderer
from hpcrlhf.data.sft import encode_prompts
from hpcrlhf.errors import ConfigError
from hpcrlhf.models.loading import load_tokenizer


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def schema():
    from transformers.utils import get_json_schema

    return get_json_schema(multiply)


# ChatML-style, as Qwen2.5's (tools in a system block, results as user turns), with the bundled EOS
CHATML = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}{% for t in tools %}{{ t['function']['name'] + '\\n' }}"
    "{% endfor %}{{ eos_token + '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ eos_token + '\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}{{ '\\n<tool_call>\\n{\"name\": \"' + c['function']['name'] + '\"}\\n</tool_call>' }}"
    "{% endfor %}{{ eos_token + '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# drops the tool calls of every assistant turn but the last: history rewritten
FORGETFUL = CHATML.replace("{% for c in m['tool_calls'] or [] %}", "{% for c in (m['tool_calls'] or []) if loop.last %}")
# the bundled template before it knew tools: ignores tools=
NO_TOOLS = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def bundled(tiny_llama):
    return load_tokenizer(tiny_llama)


def with_template(tokenizer, template):
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


@pytest.mark.parametrize("template", [None, CHATML], ids=["bundled", "chatml"])
def test_prompt_model_tokens_and_observations_add_up_to_the_whole_render(bundled, template):
    tok = bundled if template is None else with_template(bundled, template)
    r = ChatRenderer(tok, [schema()])
    r.check()
    first = [{"role": "user", "content": "37*59="}]
    assert r.prompt(first) == tok(tok.apply_chat_template(first, tools=[schema()], tokenize=False,
                                                          add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    call = '<tool_call>{"name":"multiply","arguments":{"a":37,"b":59}}</tool_call>'
    results = [{"role": "tool", "name": "multiply", "content": "2183"}]
    answer, thanks = "= 2183", [{"role": "user", "content": "Thanks!"}]
    # the model's turns as sampled: each digit its own token, EOS appended (not the text's canonical encoding)
    sampled = [[t for ch in text for t in tok(ch, add_special_tokens=False)["input_ids"]] + [tok.eos_token_id]
               for text in (call, answer)]
    ids = r.prompt(first) + sampled[0] + r.observation(results) + sampled[1] + r.observation(thanks)
    observation = tok.decode(r.observation(results))
    if template is None:
        assert observation == "\n<|user|>\n<tool_response>2183</tool_response><|eos|>\n<|assistant|>\n"
    else:
        assert observation == "\n<|im_start|>user\n<tool_response>\n2183\n</tool_response><|eos|>\n<|im_start|>assistant\n"
    # the model's tokens stay exactly where they were sampled; everything else is the template's
    start = len(r.prompt(first))
    assert ids[start:start + len(sampled[0])] == sampled[0]
    text = tok.decode(ids)
    whole = tok.apply_chat_template(first + [{"role": "assistant", "content": call}] + results
                                    + [{"role": "assistant", "content": answer}] + thanks,
                                    tools=[schema()], tokenize=False, add_generation_prompt=True)
    assert text == whole


def test_templates_that_rewrite_history_or_hide_tools_are_refused(bundled):
    with pytest.raises(ConfigError, match="renders the conversation before new messages differently once they are added"):
        ChatRenderer(with_template(bundled, FORGETFUL), [schema()]).observation(
            [{"role": "tool", "name": "multiply", "content": "1"}])
    with pytest.raises(ConfigError, match="does not show the tools \\(multiply\\) to the model: it ignores tools="):
        ChatRenderer(with_template(bundled, NO_TOOLS), [schema()]).check()
    with pytest.raises(ConfigError, match="has no chat template; set data.apply_chat_template=false"):
        ChatRenderer(with_template(bundled, None))
    with pytest.raises(ConfigError, match="agent.tools: tool schemas reach the model through a chat template"):
        ChatRenderer(bundled, [schema()], chat=False)


def test_without_a_template_prompts_are_encoded_as_every_job_does_and_observations_appended(bundled):
    r = ChatRenderer(bundled, chat=False)
    r.check()
    assert r.prompt([{"role": "user", "content": "12+34="}]) == encode_prompts(bundled, ["12+34="])[0]
    assert r.observation([{"role": "user", "content": " Try again: "}]) == bundled(" Try again: ",
                                                                                    add_special_tokens=False)["input_ids"]


def test_a_conversation_tokenizes_as_a_trajectory_with_the_assistants_turns_marked(bundled):
    """What SFT on conversations trains on: the assistant turns (their text and EOS), in the tokens a
    rollout of the same conversation would hold."""
    r = ChatRenderer(bundled, [schema()])
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 37, "b": 59}}}
    messages = [{"role": "user", "content": "37*59="}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "multiply", "content": "2183"}, {"role": "assistant", "content": "= 2183"},
                {"role": "user", "content": "left out: nothing follows it"}]
    ids, mask = r.conversation(messages)
    whole = bundled.apply_chat_template(messages[:4], tools=[schema()], tokenize=False)
    assert bundled.decode(ids) + "\n" == whole
    spans, current = [], []  # the runs of marked tokens
    for t, m in zip(ids, mask):
        if m:
            current.append(t)
        elif current:
            spans.append(current)
            current = []
    spans.append(current)
    assert [bundled.decode(s) for s in spans] == [
        '<tool_call>{"name":"multiply","arguments":{"a":37,"b":59}}</tool_call><|eos|>', "= 2183<|eos|>"]
    raw_ids, raw_mask = ChatRenderer(bundled, chat=False).conversation(
        [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "46"}])
    assert raw_ids == encode_prompts(bundled, ["12+34="])[0] + bundled("46", add_special_tokens=False)["input_ids"] + [
        bundled.eos_token_id]
    assert raw_mask == [False] * (len(raw_ids) - 3) + [True] * 3
    with pytest.raises(ValueError, match="starts with a user"):
        r.conversation([{"role": "assistant", "content": "hi"}])
