"""How long a sequence the generating model can hold, and the lengths a job asks of it.

A decoder has a fixed number of positions (`max_position_embeddings`, or `n_positions` ...,
in its config.json); prompt plus generated tokens must fit in them. Past that point a model with
learned positions fails (an index error after minutes of work) and a rotary one generates on
into positions it never saw: `rollout.max_new_tokens=100000000` ran for ten minutes to 6.6 GB
of memory before anything said so. So the lengths are checked against the model's config.json,
which is cheap to read, before anything heavy is loaded:

- `require_generation_fits(cfg)`: the response lengths a job or `hpcrlhf generate` config asks
  for (`rollout.max_new_tokens`, `eval.max_new_tokens`) plus at least one prompt token, before a
  job starts;
- `ContextWindow.require_prompt_fits`: each tokenised prompt plus its response length, where
  the prompts are read (naming the row), before the model loads where the job allows it.

A model whose config names no such limit (or a hub model not in the local cache) is not
checked; the first case is said once. The data limit `data.max_length` bounds the prompts of
online jobs and `generate` (a longer prompt is refused where it is read), not the window: a
folder's rows are mostly far shorter, so the window is checked against the rows themselves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable

from hpcrlhf.config.schema import JobConfig
from hpcrlhf.errors import ConfigError, DataError
from hpcrlhf.logs import get_logger

log = get_logger()

POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
"""config.json entries that give a model's positions, the usual one first (a multimodal model's
language model keeps them in `text_config`)."""


def model_config(path: str) -> dict | None:
    """The config.json of model `path` (a folder, a bundled `builtin:` name, or a hub name in the
    local hub cache), None when there is none to read here (the loaders report why, later)."""
    if path.startswith("builtin:"):
        from hpcrlhf.models.tiny import resolve_model_path  # torch, transformers: for builtin: names only

        path = resolve_model_path(path)
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
        except ValueError:  # not a hub id either: the model loader names the problem
            return None
        if not isinstance(cached, str):
            return None
        file = Path(cached)
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def positions_in(config: dict) -> tuple[int | None, str]:
    """(positions, the config entry that says so) of a model's config.json; (None, '') when it names none."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for key in POSITION_KEYS:
        value = text.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, key
    return None, ""


def model_positions(path: str) -> int | None:
    """The longest sequence model `path`'s config.json allows (None when it does not say)."""
    config = model_config(path)
    return positions_in(config)[0] if config is not None else None


@dataclass(frozen=True)
class ContextWindow:
    """The positions of the model that generates, and where that number comes from."""

    key: str
    """The config field or option that names the model (`model.path`, `--model`)."""
    path: str
    positions: int | None
    """None: the model's config names no limit, or could not be read here."""
    source: str = ""
    """The config.json entry that gives `positions`."""

    @classmethod
    def of(cls, path: str, key: str = "model.path", *, say_unlimited: bool = False) -> ContextWindow:
        """The window of model `path`; `say_unlimited`: log that a config without a limit is not checked."""
        config = model_config(path)
        positions, source = positions_in(config) if config is not None else (None, "")
        if say_unlimited and config is not None and positions is None:
            log.info(f"{key} {path!r}: its config.json names no position limit ({', '.join(POSITION_KEYS)}), so the "
                     "lengths of prompts and responses are not checked against the model")
        return cls(key, path, positions, source)

    @property
    def _held(self) -> str:
        return f"the {self.positions} positions of {self.key} {self.path!r} ({self.source} in its config.json)"

    def require_response_fits(self, field: str, new_tokens: int) -> None:
        """`new_tokens` generated after a prompt of at least one token fit the window (ConfigError)."""
        if self.positions is not None and new_tokens >= self.positions:
            raise ConfigError(f"{field}: {new_tokens} tokens cannot follow even a one-token prompt within {self._held}; "
                              f"use at most {self.positions - 1} minus the longest prompt's tokens")

    def require_prompt_fits(self, prompt_tokens: int, field: str, new_tokens: int, where: str) -> None:
        """A prompt of `prompt_tokens` (at `where`, e.g. `prompts.jsonl:17`) plus `new_tokens` fit (DataError)."""
        if self.positions is not None and prompt_tokens + new_tokens > self.positions:
            room = self.positions - prompt_tokens
            fix = (f"lower {field} to at most {room} or shorten the prompt" if room > 0 else
                   f"shorten the prompt to fewer than {self.positions} tokens")
            raise DataError(f"{where}: the prompt has {prompt_tokens} tokens, and with {field} {new_tokens} the sequence "
                            f"would be {prompt_tokens + new_tokens} tokens, more than {self._held}; {fix}")


    def require_prompts_fit(self, prompts: Iterable[tuple[int, str]], field: str, new_tokens: int) -> None:
        """Every (prompt tokens, where) plus `new_tokens` fits: the first one that does not is named."""
        for tokens, where in prompts:
            self.require_prompt_fits(tokens, field, new_tokens, where)


def generation_lengths(cfg: JobConfig) -> list[tuple[str, int]]:
    """(config field, tokens) of every response length a job or generate config asks the model for."""
    lengths = []
    rollout = getattr(cfg, "rollout", None)
    if rollout is not None:
        lengths.append(("rollout.max_new_tokens", rollout.max_new_tokens))
    evaluation = getattr(cfg, "eval", None)
    if evaluation is not None:
        lengths.append(("eval.max_new_tokens", evaluation.max_new_tokens))
    agent = getattr(cfg, "agent", None)
    if agent is not None:  # a trajectory's tokens after its first prompt: the model's turns and the answers
        lengths.append(("agent.max_tokens", agent.max_tokens))
    return lengths


def require_generation_fits(cfg: JobConfig, kind: str = "") -> ContextWindow:
    """Before a job or `generate` loads anything: every response length its config asks for fits
    the window of `model.path` (a reward model job, `kind` rm, generates nothing); returns the window."""
    window = ContextWindow.of(cfg.model.path, say_unlimited=kind != "rm")
    if kind != "rm":
        for field, tokens in generation_lengths(cfg):
            window.require_response_fits(field, tokens)
    return window
