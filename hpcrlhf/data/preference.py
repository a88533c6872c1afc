"""Preference data: (prompt, chosen, rejected) pairs and unpaired labelled completions.

Every response is tokenised like an SFT sample (`prompt + response + EOS`, loss mask on the
response and EOS), so reward models, DPO and KTO score exactly the tokens SFT trained on and a
policy will generate. Rows are checked up front and a bad row is named by file and line.

KTO's reference point needs completions that do *not* answer their prompt: each unpaired sample
carries a mismatched sequence, its own prompt followed by the completion of the next row
(`mismatched_pairs` over the dataset order, fixed for the whole run, so reference log-probs of
those sequences can be precomputed like any other).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence

from hpcrlhf.algos.preference import mismatched_pairs
from hpcrlhf.config.schema import PairDataConfig, TaskConfig, UnpairedDataConfig
from hpcrlhf.data.loading import load_rows
from hpcrlhf.data.sft import TokenizedSample, Truncation, keep_usable, tokenize_sft
from hpcrlhf.data.sources import Row, require_distinct, require_label, require_number, require_text
from hpcrlhf.errors import DataError


@dataclass(frozen=True)
class PairSample:
    chosen: TokenizedSample
    rejected: TokenizedSample
    margin: float
    """Preference margin from the data (0 without `data.margin_key`)."""
    tag: str
    """The row's "difficulty" field when it has one (the bundled task's easy/hard pairs), else ""."""


@dataclass(frozen=True)
class UnpairedSample:
    sample: TokenizedSample
    mismatched: TokenizedSample
    """This row's prompt followed by another row's completion (for the KL estimate)."""
    desirable: bool


def check_pair_rows(rows: Sequence[Row], data: PairDataConfig) -> None:
    keys = (data.prompt_key, data.chosen_key, data.rejected_key)
    require_text(rows, keys, key_option={data.prompt_key: "data.prompt_key", data.chosen_key: "data.chosen_key",
                                         data.rejected_key: "data.rejected_key"})
    require_distinct(rows, data.chosen_key, data.rejected_key)
    if data.margin_key:
        require_number(rows, data.margin_key, option="data.margin_key")


def check_unpaired_rows(rows: Sequence[Row], data: UnpairedDataConfig) -> None:
    require_text(rows, (data.prompt_key, data.completion_key),
                 key_option={data.prompt_key: "data.prompt_key", data.completion_key: "data.completion_key"})
    require_label(rows, data.label_key, option="data.label_key")


def tokenize_pairs(rows: Sequence[Row], tokenizer, data: PairDataConfig) -> tuple[list[PairSample], Truncation]:
    """Tokenised pairs, one per row, and what the cut to `data.max_length` did: a pair whose chosen
    and rejected it made the same tokens (a prompt filling it, or responses cut where they still
    agree) is marked unusable (see `keep_usable`)."""
    kw = dict(prompt_key=data.prompt_key, max_length=data.max_length, apply_chat_template=data.apply_chat_template)
    chosen, chosen_cut = tokenize_sft(rows, tokenizer, response_key=data.chosen_key, **kw)
    rejected, rejected_cut = tokenize_sft(rows, tokenizer, response_key=data.rejected_key, **kw)
    pairs = [PairSample(c, r, float(row.data[data.margin_key]) if data.margin_key else 0.0,
                        str(row.data.get("difficulty", ""))) for row, c, r in zip(rows, chosen, rejected)]
    return pairs, chosen_cut.of_pairs(rejected_cut, [c.input_ids != r.input_ids for c, r in zip(chosen, rejected)])


def tokenize_unpaired(rows: Sequence[Row], tokenizer, data: UnpairedDataConfig, *, split: str = "training",
                      path: str | None = None) -> list[UnpairedSample]:
    """Tokenised labelled completions, each with its mismatched sequence: those of the rows the cut
    to `data.max_length` leaves a response token (`keep_usable`; `split` and `path` name the rows
    in its messages), of which there must be at least 2."""
    if len(rows) < 2:
        where = f"{rows[0].origin}: the only row of its dataset; " if rows else ""
        raise DataError(f"{where}KTO needs at least 2 rows to pair prompts with unrelated completions, got {len(rows)}: "
                        "add rows (or raise data.max_samples, task.train_size or task.eval_size to 2 or more)")
    samples, truncation = tokenize_sft(rows, tokenizer, prompt_key=data.prompt_key, response_key=data.completion_key,
                                       max_length=data.max_length, apply_chat_template=data.apply_chat_template)
    kept = keep_usable(list(zip(rows, samples)), truncation, split=split, path=path)
    if len(kept) < 2:
        raise DataError(f"{kept[0][0].origin}: the only one of {len(rows)} {split} rows whose completion keeps a token "
                        f"within data.max_length={data.max_length}; KTO needs at least 2 rows to pair prompts with "
                        f"unrelated completions: raise data.max_length above the longest prompt "
                        f"({max(truncation.prompt_tokens)} tokens)")
    other = mismatched_pairs(len(kept)).tolist()
    return [UnpairedSample(s, splice(s, kept[j][1], data.max_length), bool(row.data[data.label_key]))
            for (row, s), j in zip(kept, other)]


def splice(prompt_of: TokenizedSample, response_of: TokenizedSample, max_length: int) -> TokenizedSample:
    """The prompt tokens of one sample followed by the response tokens of another."""
    prompt = [t for t, m in zip(prompt_of.input_ids, prompt_of.loss_mask) if not m]
    response = [t for t, m in zip(response_of.input_ids, response_of.loss_mask) if m]
    ids = (prompt + response)[:max_length]
    mask = ([False] * len(prompt) + [True] * len(response))[:max_length]
    return TokenizedSample(tuple(ids), tuple(mask), f"{prompt_of.origin} + response of {response_of.origin}")


def load_pairs(data: PairDataConfig, task_cfg: TaskConfig, tokenizer) -> tuple[list[PairSample], list[PairSample]]:
    """Checked, tokenised train and eval pairs (the task's mixed easy/hard pairs by default)."""
    train, evals = load_rows(data, task_cfg, lambda task, split, n: task.mixed_preference_rows(
        split, n, task_cfg.hard_pair_fraction, task_cfg.near_miss))
    for rows in (train, evals):
        check_pair_rows(rows, data)
    return (keep_usable(*tokenize_pairs(train, tokenizer, data), split="training", path=data.train_path),
            keep_usable(*tokenize_pairs(evals, tokenizer, data), split="eval", path=data.eval_path))


def load_unpaired(data: UnpairedDataConfig, task_cfg: TaskConfig, tokenizer) -> tuple[list[UnpairedSample], list[UnpairedSample]]:
    """Checked, tokenised train and eval labelled completions (the task's by default)."""
    train, evals = load_rows(data, task_cfg, lambda task, split, n: task.unpaired_rows(split, n))
    for rows in (train, evals):
        check_unpaired_rows(rows, data)
    return (tokenize_unpaired(train, tokenizer, data, path=data.train_path),
            tokenize_unpaired(evals, tokenizer, data, split="eval", path=data.eval_path) if evals else [])
