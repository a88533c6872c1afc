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

    def check(self) -> None:
        """Refuse a template whose turn-by-turn pieces differ from its render of the whole conversation
        (the model's text tokenized canonically), and one that shows no tools when there are some."""
        if not self.chat:
            return
        call = {"type": "function", "function": {"name": "probe", "arguments": {"a": 1}}}
        turns = [[{"role": "user", "content": "Hello there."}],
                 {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
                 [{"role": "tool", "name": "probe", "content": "42"}],
                 {"role": "assistant", "content": "It is 42."},
                 [{"role": "user", "content": "Thanks."}]]
        messages, ids = list(turns[0]), self.prompt(turns[0])
        for i in range(1, len(turns)):
            if i % 2:  # the model's turn: its canonical tokens and EOS
                reply = turns[i]
                messages.append(reply)
                whole = self._render(messages, False)
                opened = self._render(messages[:-1], True)
                ids += self._ids(whole[len(opened):whole.rindex(self.eos) + len(self.eos)])
            else:
                messages += turns[i]
                ids += self.observation(turns[i])
        expected = self._ids(self._render(messages, True))
        if ids != expected:
            at = next((i for i, (a, b) in enumerate(zip(ids, expected)) if a != b), min(len(ids), len(expected)))
            raise ConfigError(f"the chat template of {self._name()} renders a conversation differently from its turns "
                              f"one after another (token {at}: {self.tokenizer.decode(ids[at:at + 8])!r} vs "
                              f"{self.tokenizer.decode(expected[at:at + 8])!r}); multi-turn rollouts need a template "
                              "whose turns add up to the whole")
        if self.tools:
            names = [t["function"]["name"] for t in self.tools]
            shown = self._render(turns[0], True)
            if not all(n in shown for n in names):
                raise ConfigError(f"the chat template of {self._name()} does not show the tools ({', '.join(names)}) "
                                  "to the model: it ignores tools=; use a model whose template supports tools")

    def _name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "") or "the model"
