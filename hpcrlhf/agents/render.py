"""Token-in/token-out: turning an environment's messages into the tokens appended to a trajectory.

The model's own tokens are appended exactly as sampled, never decoded and encoded again: a sampled
token sequence is often not the tokenizer's encoding of its own text ("12" sampled as "1", "2"),
and the PPO ratio and log-probs refer to the sampled tokens. So only what the environment adds is
tokenized, and it is appended after them.

With a chat template (`data.apply_chat_template: true`) an observation's tokens are the template's
*difference*: render a fixed conversation (user "x", assistant "y") without and with the new
messages, and tokenize what the second adds after the first's last EOS. The transcript is never
rendered again as a whole, so a template that rewrites history (drops earlier reasoning, adds a
default system prompt, re-serializes tool calls) cannot change tokens the model already saw.
The EOS that ended the model's turn is the model's; what the template writes after it ("\\n") is
the observation's. `check()` refuses, at the start of a run, a template whose pieces do not add up
to its whole render (it depends on what came before in a way the difference cannot follow).

Without a chat template (`data.apply_chat_template: false`), the prompt is encoded as every job
encodes prompts, and an observation's text is tokenized and appended directly; tools need a
template (that is how their schemas reach the model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpcrlhf.data.sft import TokenizedSample, Truncation
from hpcrlhf.errors import ConfigError

_DUMMY = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class ChatRenderer:
    """Prompts and observations of one job as token ids (see the module docstring)."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict] = (), chat: bool = True) -> None:
        self.tokenizer, self.tools, self.chat = tokenizer, list(tools), chat
        name = getattr(tokenizer, "name_or_path", "") or "the model"
        if chat and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"data.apply_chat_template: true, but the tokenizer of {name} has no chat template; set "
                              "data.apply_chat_template=false for a base model, or use a chat model")
        if self.tools and not chat:
            raise ConfigError("agent.tools: tool schemas reach the model through a chat template: set "
                              "data.apply_chat_template=true (and use a model whose tokenizer has one)")
        self.eos = tokenizer.eos_token
        if chat and not self.eos:
            raise ConfigError(f"the tokenizer of {name} has no EOS token: a turn's end cannot be found")

    def _render(self, messages: list[dict], generation: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools or None, tokenize=False,
                                                  add_generation_prompt=generation)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: list[dict]) -> list[int]:
        """The first turn's tokens: the conversation so far with the assistant's turn opened."""
        if not self.chat:
            text = "".join(m["content"] for m in messages)
            return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        return self._ids(self._render(messages, True))

    def observation(self, messages: list[dict]) -> list[int]:
        """The tokens `messages` (the environment's answer: user, tool or system messages) add after a
        model turn that ended with EOS, the next assistant turn opened."""
        if not self.chat:
            return self._ids("".join(m["content"] for m in messages))
        return self._ids(self.observation_text(messages))

    def observation_text(self, messages: list[dict]) -> str:
        before = _DUMMY
        if any(m["role"] == "tool" for m in messages):  # some templates head tool results by the call before them
            calls = [{"type": "function", "function": {"name": m.get("name", "tool"), "arguments": {}}}
                     for m in messages if m["role"] == "tool"]
            before = [_DUMMY[0], {**_DUMMY[1], "tool_calls": calls}]
        base = self._render(before, False)
        if self.eos not in base:
            raise ConfigError(f"the chat template of {self._name()} writes no EOS ({self.eos!r}) after an assistant "
                              "turn: the tokens after a model turn cannot be told apart; use another model, or "
                              "data.apply_chat_template=false")
        cut = base[:base.rindex(self.eos) + len(self.eos)]
        full = self._render(before + list(messages), True)
        if not full.startswith(cut):
            at = next(i for i, (a, b) in enumerate(zip(cut, full)) if a != b) if len(full) >= len(cut) else len(full)
            raise ConfigError(f"the chat template of {self._name()} renders the conversation before new messages "
                              f"differently once they are added (from character {at}: {cut[at:at + 40]!r} vs "
                              f"{full[at:at + 40]!r}); it rewrites history, which multi-turn rollouts cannot follow")
        return full[len(cut):]

    def conversation(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        """A whole conversation's tokens as a trajectory holds them, and which are the assistant's
        (True: what SFT on conversations trains on, as a rollout trains on the model's tokens). The
        assistant turns are the template's text of each, up to and with its EOS, tokenized as the
        model would write it; everything else is the prompt (before the first assistant turn) and the
        observations after each. The conversation must start with a non-assistant message; a final
        non-assistant message is left out (nothing would be learned from it)."""
        if not messages or messages[0]["role"] == "assistant":
            raise ValueError("a conversation starts with a user (or system) message")
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        ids = self.prompt(messages[:first])
        mask = [False] * len(ids)
        i = first
        while i < len(messages):
            if messages[i]["role"] == "assistant":
                said = self._assistant_ids(messages[:i + 1])
                ids, mask = ids + said, mask + [True] * len(said)
                i += 1
            else:
                end = next((j for j in range(i, len(messages)) if messages[j]["role"] == "assistant"), len(messages))
                if end == len(messages):
                    break
                added = self.observation(messages[i:end])
                ids, mask = ids + added, mask + [False] * len(added)
                i = end
        return ids, mask

    def _assistant_ids(self, messages: list[dict]) -> list[int]:
        """The last message's (an assistant's) tokens with its EOS: canonically tokenized, as sampled."""
        if not self.chat:
            return self._ids(messages[-1]["content"]) + [self.tokenizer.eos_token_id]
        whole = self._render(messages, False)
        opened = self._render(messages[:-1], True)
        return self._ids(whole[len(opened):whole.rindex(self.eos) + len(self.eos)])

    def check(self) -> None:
        """Refuse a template whose turn-by-turn pieces differ from its render of the whole conversation
        (the model's text tokenized canonically), and one that shows no tools when there are some."""
        if not self.chat:
            return
        call = {"type": "function", "function": {"name": "probe", "arguments": {"a": 1}}}
        messages = [{"role": "user", "content": "Hello there."},
                    {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
                    {"role": "tool", "name": "probe", "content": "42"},
                    {"role": "assistant", "content": "It is 42."},
                    {"role": "user", "content": "Thanks."}]
        ids, _ = self.conversation(messages)
        ids += self.observation(messages[-1:])
        expected = self._ids(self._render(messages, True))
        if ids != expected:
            at = next((i for i, (a, b) in enumerate(zip(ids, expected)) if a != b), min(len(ids), len(expected)))
            raise ConfigError(f"the chat template of {self._name()} renders a conversation differently from its turns "
                              f"one after another (token {at}: {self.tokenizer.decode(ids[at:at + 8])!r} vs "
                              f"{self.tokenizer.decode(expected[at:at + 8])!r}); multi-turn rollouts need a template "
                              "whose turns add up to the whole")
        if self.tools:
            names = [t["function"]["name"] for t in self.tools]
            shown = self._render(messages[:1], True)
            if not all(n in shown for n in names):
                raise ConfigError(f"the chat template of {self._name()} does not show the tools ({', '.join(names)}) "
                                  "to the model: it ignores tools=; use a model whose template supports tools")

    def _name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "") or "the model"


def conversation_problem(messages: Any) -> str | None:
    """Why `messages` is no conversation to learn from (None when it is one): a list of dicts with a
    role (system, user, assistant, tool) and string content, starting with no assistant turn and
    holding at least one."""
    if not isinstance(messages, list) or not messages:
        return "it is no non-empty list of messages"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            return f"message {i} has no role of system, user, assistant or tool"
        if not isinstance(m.get("content", ""), str) or ("content" not in m and not m.get("tool_calls")):
            return f"message {i} has no string content"
    if messages[0]["role"] == "assistant":
        return "it starts with an assistant turn (there is nothing it answers)"
    if not any(m["role"] == "assistant" for m in messages):
        return "it has no assistant turn to learn"
    return None


def tokenize_conversations(rows: Sequence[Any], tokenizer: Any, *, messages_key: str, tools_key: str | None,
                           max_length: int) -> tuple[list[TokenizedSample], Truncation]:
    """SFT samples of conversation rows (`data.messages_key`), each cut to `max_length` tokens: the
    assistant turns are the targets (`ChatRenderer.conversation`). Returns the samples and what the
    cut did (`hpcrlhf.data.sft.Truncation`: the "prompt" is what precedes the first assistant turn)."""
    renderers: dict[str, ChatRenderer] = {}
    samples, prompts, totals = [], [], []
    for row in rows:
        tools = (row.data.get(tools_key) or []) if tools_key else []
        key = repr(tools)
        if key not in renderers:
            renderers[key] = ChatRenderer(tokenizer, tools)
        messages = [dict(m, content=m.get("content") or "") for m in row.data[messages_key]]
        ids, mask = renderers[key].conversation(messages)
        samples.append(TokenizedSample(tuple(ids[:max_length]), tuple(mask[:max_length]), row.origin))
        prompts.append(mask.index(True))
        totals.append(len(ids))
    return samples, Truncation(max_length, tuple(prompts), tuple(totals), tuple(any(s.loss_mask) for s in samples))
