"""Scoring responses: reward models, rule-based rewards, and their weighted combination.

A `RewardSet` holds the sources of `reward.sources` (PPO, rejection sampling, `hpcrlhf
generate`). Each source gives one number per response; the score is their weighted sum:

    score = sum_i weight_i * r_i

- A reward model source runs the model on prompt + response (the tokens the policy produced,
  re-tokenised from text when the reward model has a different vocabulary) and takes the value
  at the last token, standardised with the model's stored reward mean/std when `normalize`.
- A rule source is a Python function `(prompt, response, row) -> float`: the bundled task's
  `task` (exact answer, 1 or 0) and `task_partial` (share of digits right), or a user's
  `package.module:function`. `row` is the prompt's dataset row (other fields, e.g. a reference
  answer, reach the rule through it).

`adjust_scores` then applies the configured penalties (length, missing EOS). Reward models are
frozen models (see `Trainer.build_frozen_model`): sharded under ZeRO-3, so every rank must call
`score` with the same number of sequences.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from hpcrlhf.config.schema import RewardConfig, RewardSourceConfig
from hpcrlhf.errors import ConfigError

RuleFn = Callable[[str, str, Mapping[str, Any]], float]


@dataclass(frozen=True)
class Response:
    """One generated response, as the reward sources see it."""

    prompt: str
    text: str
    """The decoded response (special tokens removed)."""
    sequence_ids: tuple[int, ...]
    """Prompt + response token ids (EOS included when generated)."""
    row: Mapping[str, Any]
    """The prompt's dataset row."""


def resolve_rule(name: str, task) -> RuleFn:
    """The function of a rule source, checked before anything runs."""
    if name in ("task", "task_partial"):
        if task is None:
            raise ConfigError(f"reward.sources: rule '{name}' scores the bundled task's answers, but task.name is "
                              "null; set task.name=arithmetic, or use a reward model or a module:function rule")
        score = task.score if name == "task" else task.partial_score
        return lambda prompt, response, row: score(prompt, response)
    module_name, sep, fn_name = name.partition(":")
    if not sep or not module_name or not fn_name:
        raise ConfigError(f"reward.sources: rule '{name}' is not a known rule; use task, task_partial, or "
                          "package.module:function")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"reward.sources: rule '{name}' cannot be imported ({e}); check the module is on "
                          "PYTHONPATH and defines the function") from None
    if not callable(fn) or len(inspect.signature(fn).parameters) != 3:
        raise ConfigError(f"reward.sources: rule '{name}' must be a function of (prompt, response, row)")
    return fn


def source_name(index: int, source: RewardSourceConfig) -> str:
    """Metric name of a source: `rule_<name>` or `model<i>_<folder name>`."""
    if source.rule is not None:
        return "rule_" + source.rule.replace(":", ".").replace("/", ".")
    return f"model{index}_{Path(source.model).name or 'rm'}"


class RewardModelScorer:
    """A frozen reward model scoring prompt + response sequences at their last token."""

    def __init__(self, model, tokenizer, policy_tokenizer, source: RewardSourceConfig, batch_size: int, device):
        from hpcrlhf.models.value import reward_stats

        self.model, self.tokenizer = model, tokenizer
        self.same_vocab = tokenizer.get_vocab() == policy_tokenizer.get_vocab()
        self.stats = reward_stats(model.module.config) if source.normalize else None
        self.pad_id, self.batch_size, self.device = tokenizer.pad_token_id, batch_size, device

    def _sequence(self, r: Response) -> list[int]:
        if self.same_vocab:
            return list(r.sequence_ids)
        # Another vocabulary: the model sees the text, ending in its own EOS like its training data.
        return self.tokenizer(r.prompt + r.text, add_special_tokens=True)["input_ids"] + [self.tokenizer.eos_token_id]

    @torch.no_grad()
    def __call__(self, responses: Sequence[Response]) -> torch.Tensor:
        from hpcrlhf.engines.hf_generate import right_pad
        from hpcrlhf.models.value import last_token_values

        out = []
        for start in range(0, len(responses), self.batch_size):
            ids, mask = right_pad([self._sequence(r) for r in responses[start : start + self.batch_size]], self.pad_id)
            values = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
            out.append(last_token_values(values, mask.to(self.device)).float().cpu())
        rewards = torch.cat(out) if out else torch.zeros(0)
        if self.stats is not None:
            mean, std = self.stats
            rewards = (rewards - mean) / max(std, 1e-8)
        return rewards


class RewardSet:
    """All sources of a `RewardConfig`; `score` returns the weighted sum and each source's values.

    `load_model(path)` gives a frozen value model (`FrozenModel` of a `ValueModel`) for a reward
    model folder."""

    def __init__(self, cfg: RewardConfig, load_model: Callable[[str], Any], tokenizer, task, device,
                 trust_remote_code: bool = False):
        from hpcrlhf.models.loading import load_tokenizer

        self.cfg = cfg
        self.weights = [s.weight for s in cfg.sources]
        self.names = [source_name(i, s) for i, s in enumerate(cfg.sources)]
        # Rules are resolved first: a typo fails before any reward model is loaded.
        rules = {i: resolve_rule(s.rule, task) for i, s in enumerate(cfg.sources) if s.rule is not None}
        self.scorers: list[Callable[[Sequence[Response]], torch.Tensor]] = []
        for i, source in enumerate(cfg.sources):
            if i in rules:
                self.scorers.append(_rule_scorer(rules[i]))
            else:
                rm_tokenizer = load_tokenizer(source.model, trust_remote_code=trust_remote_code)
                self.scorers.append(RewardModelScorer(load_model(source.model), rm_tokenizer, tokenizer, source,
                                                      cfg.batch_size, device))

    def score(self, responses: Sequence[Response]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(weighted sum, {source name: values}) for each response, float32 on the CPU."""
        parts = {name: scorer(responses) for name, scorer in zip(self.names, self.scorers)}
        total = torch.zeros(len(responses))
        for weight, values in zip(self.weights, parts.values()):
            total += weight * values
        return total, parts


def _rule_scorer(fn: RuleFn) -> Callable[[Sequence[Response]], torch.Tensor]:
    def score(responses: Sequence[Response]) -> torch.Tensor:
        return torch.tensor([float(fn(r.prompt, r.text, r.row)) for r in responses], dtype=torch.float32)

    return score


def adjust_scores(scores: torch.Tensor, lengths: torch.Tensor, finished: torch.Tensor, cfg: RewardConfig) -> torch.Tensor:
    """Scores with the length penalty (per response token) and the missing-EOS penalty applied."""
    out = scores - cfg.length_penalty * lengths.float()
    if cfg.missing_eos_penalty is not None:
        out = out + cfg.missing_eos_penalty * (~finished.bool()).float()
    return out
