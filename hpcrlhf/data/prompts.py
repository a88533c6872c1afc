"""Prompts of the jobs that generate (PPO, rejection sampling, `hpcrlhf generate`): dataset rows'
prompt field, checked and tokenised once, with where each row came from for errors about it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping, Sequence

from hpcrlhf.config.schema import PPOConfig, PromptDataConfig, RSConfig
from hpcrlhf.data.loading import held_out_prompt_rows, load_train_rows, require_task_prompts
from hpcrlhf.data.sft import encode_prompts
from hpcrlhf.data.sources import Row, require_text
from hpcrlhf.errors import DataError


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    text: str
    row: Mapping[str, Any]
    origin: str = ""
    """Where the row came from (`prompts.jsonl:17`), for errors about it."""


def load_prompts(cfg: PPOConfig | RSConfig, tokenizer, eval_limit: int | None = None) -> tuple[list[Prompt], list[Prompt]]:
    """(train prompts, up to `eval_limit` held-out prompts (`held_out_prompt_rows`))."""
    eval_rows, key = held_out_prompt_rows(cfg.data, cfg.task, eval_limit)
    return load_train_prompts(cfg, tokenizer), encode_prompt_rows(eval_rows, cfg.data, tokenizer, key)


def load_train_prompts(cfg: PPOConfig | RSConfig, tokenizer) -> list[Prompt]:
    """Training prompts from `data.train_path` or the bundled task's prompt rows."""
    rows = load_train_rows(cfg.data, cfg.task, lambda task, split, n: task.prompt_rows(split, n))
    if cfg.data.train_path:  # a task named on purpose scores these too (rollout/task_score, `task` rules)
        require_task_prompts(rows, cfg.data.prompt_key, cfg.task, cfg.data)
    if cfg.multi_turn() is not None:
        return episode_rows(rows, cfg.data.prompt_key)
    return encode_prompt_rows(rows, cfg.data, tokenizer)


def episode_rows(rows: list[Row], key: str) -> list[Prompt]:
    """Dataset rows as the prompts of multi-turn trajectories: not tokenised here (the environment's
    `reset` gives the first message, which the agent renders), the text their field `key` holds if any."""
    return [Prompt((), str(r.data.get(key, "")), r.data, r.origin) for r in rows]


def encode_prompt_rows(rows: list[Row], data: PromptDataConfig, tokenizer, key: str | None = None) -> list[Prompt]:
    """Checked, tokenised prompts of dataset rows (field `key`, default `data.prompt_key`; chat
    template, max length)."""
    if not rows:
        return []
    key = key or data.prompt_key
    require_text(rows, (key,), key_option={key: "data.prompt_key"})
    texts = [r.data[key] for r in rows]
    ids = encode_prompts(tokenizer, texts, data.apply_chat_template)
    for row, p in zip(rows, ids):
        if len(p) > data.max_length:
            raise DataError(f"{row.origin}: prompt has {len(p)} tokens > data.max_length {data.max_length}; "
                            "raise data.max_length or shorten the prompt")
    return [Prompt(tuple(p), t, r.data, r.origin) for p, t, r in zip(ids, texts, rows)]


def response_lengths(prompts: Sequence[Prompt], key: str, most: int) -> tuple[int, ...]:
    """Each prompt's fixed response length, its row's field `key` (`rollout.length_key`, a benchmark's): a
    DataError naming the row unless it is a whole number from 1 to `most` (rollout.max_new_tokens)."""
    out = []
    for p in prompts:
        value = p.row.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise DataError(f"{p.origin}: field {key!r} (rollout.length_key) is {value!r}; give each row a whole "
                            f"number of response tokens from 1 to rollout.max_new_tokens ({most})")
        out.append(value)
    return tuple(out)
