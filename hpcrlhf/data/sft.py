"""Tokenising (prompt, response) rows for next-token training, and what `data.max_length` may cut.

A sample is `prompt tokens + response tokens + EOS`; the loss mask is true on the response and
EOS only. Prompt and response are tokenised separately (the prompt exactly as it is tokenised at
generation time), so the model learns to continue the prompt it will actually see.

A sample longer than `data.max_length` loses its end: its EOS first, then response tokens, then
prompt tokens. `keep_usable` applies one rule to the rows of every job kind that trains on
prompt + response (SFT, CSFT, reward model, DPO, KTO), train and eval split alike: a row the cut
leaves nothing to learn from (no response token; a pair whose chosen and rejected became the
same tokens) is left out, with a warning that counts them; a split left with no row at all is an
error naming the file, `data.max_length` and the longest prompt; and when most rows lose their
EOS, the warning says the model will not learn where a response ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar
from collections.abc import Sequence

from hpcrlhf.data.sources import Row
from hpcrlhf.errors import ConfigError, DataError
from hpcrlhf.logs import get_logger

T = TypeVar("T")


@dataclass(frozen=True)
class TokenizedSample:
    input_ids: tuple[int, ...]
    loss_mask: tuple[bool, ...]
    """True where the token is a training target (response and EOS)."""
    origin: str


def encode_prompts(tokenizer, prompts: Sequence[str], apply_chat_template: bool = False) -> list[list[int]]:
    """Token ids of prompts as the model sees them, special tokens and chat template included."""
    if not prompts:  # a fast tokenizer fails on an empty batch
        return []
    if apply_chat_template:
        _require_chat_template(tokenizer)
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
        return token_ids(tokenizer, prompts, add_special_tokens=False)
    return token_ids(tokenizer, prompts, add_special_tokens=True)


def token_ids(tokenizer, texts: Sequence[str], *, add_special_tokens: bool) -> list[list[int]]:
    """The token ids of each text, as `tokenizer(texts, add_special_tokens=...)["input_ids"]` gives them.
    A fast tokenizer in its plain state (no truncation or padding set, special tokens handled as its
    `split_special_tokens` says) is asked directly through its Rust backend: the same ids without
    transformers' per-row conversion of every encoding (offsets, masks, type ids) to Python lists,
    which took half the time of tokenising a dataset (3.6 s of 80,000 rows, 1.7 s directly)."""
    texts = list(texts)
    if not texts:  # a fast tokenizer fails on an empty batch
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    plain = (backend is not None and backend.truncation is None and backend.padding is None
             and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)))
    if not plain:
        return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return [e.ids for e in backend.encode_batch(texts, add_special_tokens=add_special_tokens)]


def _require_chat_template(tokenizer) -> None:
    """A base model's tokenizer has no chat template; transformers would fail deep inside
    `apply_chat_template` with a ValueError that does not say which setting asked for it."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or "the model"
        raise ConfigError(f"data.apply_chat_template: true, but the tokenizer of {name} has no chat template; set "
                          "data.apply_chat_template=false for a base model, or use a chat model")


def encode_prompt(tokenizer, prompt: str, apply_chat_template: bool = False) -> list[int]:
    return encode_prompts(tokenizer, [prompt], apply_chat_template)[0]


@dataclass(frozen=True)
class Truncation:
    """What cutting a split's rows to `max_length` tokens did, row by row: the tokens of each
    row's prompt and of its whole sample (prompt + response + EOS; a pair's longer one) before
    the cut, and whether the cut left the row anything to learn from."""

    max_length: int
    prompt_tokens: tuple[int, ...]
    sample_tokens: tuple[int, ...]
    usable: tuple[bool, ...]
    lost: str = "every response token"
    """What an unusable row lost, for the messages."""

    @property
    def rows(self) -> int:
        return len(self.usable)

    @property
    def cut(self) -> int:
        """Rows whose response lost its end (the EOS at least)."""
        return sum(n > self.max_length for n in self.sample_tokens)

    def of_pairs(self, other: Truncation, usable: Sequence[bool]) -> Truncation:
        """The truncation of pairs whose chosen responses had this one and rejected ones `other`."""
        return Truncation(self.max_length, self.prompt_tokens, tuple(map(max, self.sample_tokens, other.sample_tokens)),
                          tuple(usable), "the difference between chosen and rejected")


def tokenize_sft(
    rows: Sequence[Row],
    tokenizer,
    *,
    prompt_key: str,
    response_key: str,
    max_length: int,
    apply_chat_template: bool = False,
) -> tuple[list[TokenizedSample], Truncation]:
    """Tokenise rows, each cut to `max_length` tokens; returns the samples (one per row, usable or
    not: see `keep_usable`) and what the cut did."""
    if not rows:
        return [], Truncation(max_length, (), (), ())
    prompts = encode_prompts(tokenizer, [r.data[prompt_key] for r in rows], apply_chat_template)
    responses = token_ids(tokenizer, [r.data[response_key] for r in rows], add_special_tokens=False)
    samples, eos = [], [tokenizer.eos_token_id]  # an attribute lookup through transformers' __getattr__: once
    for row, prompt, response in zip(rows, prompts, responses):
        ids = prompt + response + eos
        mask = [False] * len(prompt) + [True] * (len(response) + 1)
        samples.append(TokenizedSample(tuple(ids[:max_length]), tuple(mask[:max_length]), row.origin))
    lengths = [(len(p), len(p) + len(r) + 1) for p, r in zip(prompts, responses)]
    return samples, Truncation(max_length, tuple(p for p, _ in lengths), tuple(n for _, n in lengths),
                               tuple(any(s.loss_mask) for s in samples))


def keep_usable(items: Sequence[T], truncation: Truncation, *, split: str, path: str | None) -> list[T]:
    """The items (one per row of `truncation`) the cut to `data.max_length` left something to
    learn from. None left: a DataError. Some left out, or responses cut: a warning with the counts
    (when most lose their EOS, it says the model will not learn where a response ends).
    `split` is "training" or "eval"; `path` the split's data file (None: the bundled task's rows)."""
    t, n = truncation, truncation.rows
    option = "data.train_path" if split == "training" else "data.eval_path"
    source = f"{path} ({option})" if path else f"the bundled task's {split} split"
    kept = [item for item, ok in zip(items, t.usable) if ok]
    if n == 0 or (t.cut == 0 and len(kept) == n):
        return kept
    longest_prompt, longest = max(t.prompt_tokens), max(t.sample_tokens)
    whole = f"{longest} keeps every sample whole (response and EOS)"
    fix = (f"raise data.max_length above the longest prompt ({longest_prompt} tokens); {whole}"
           if longest_prompt >= t.max_length else f"raise data.max_length: {whole}")
    if not kept:
        what = ", so eval/loss cannot be computed" if split == "eval" else ""
        raise DataError(f"data.max_length={t.max_length} tokens leaves nothing to learn from in any of the {n} {split} "
                        f"rows of {source}: each lost {t.lost} to the cut (prompts are {min(t.prompt_tokens)} to "
                        f"{longest_prompt} tokens; prompt + response + EOS must fit){what}; {fix}")
    dropped = n - len(kept)
    message = (f"data.max_length={t.max_length} tokens cuts the responses of {t.cut} of the {n} {split} rows of "
               f"{source}" + (f"; {dropped} of them lost {t.lost} and are left out" if dropped else ""))
    if 2 * t.cut > n:
        harm = ("the model will not learn where a response ends (nor to stop generating)" if split == "training"
                else "eval/loss measures cut responses")
        message += f". Most responses lose their end (EOS): {harm}; {fix}"
    else:
        message += f" ({whole})"
    get_logger().warning(message)
    return kept
