"""Scoring responses with `reward.sources`: reward models, rules, and their weighted combination.

A `RewardSet` holds the sources of `reward.sources` (PPO, rejection sampling, `hpcrlhf
generate`). Each source gives one number per response; the score is their weighted sum:

    score = sum_i weight_i * r_i

- A reward model source runs the model on prompt + response (the tokens the policy produced,
  re-tokenised from text when the reward model has a different vocabulary) and takes the value
  at the last token, standardised with the model's stored reward mean/std when `normalize`.
- A rule source is a rule (`hpcrlhf.rewards.rules`): a built-in one (math, code, format), the
  bundled task's, or a user's `package.module:function`.
- A server source is a reward server asked over HTTP (`hpcrlhf.rewards.remote`).

Each source becomes one scorer, a callable from the responses to a tensor of their values
(`RuleScorer`, `RewardModelScorer`), so another kind of source sits beside these two.

`adjust_scores` then applies the configured penalties (length, missing EOS). Reward models are
frozen models (see `ModelFactory.build_frozen_model`): sharded under ZeRO-3, so every rank must call
`score` with the same number of sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hpcrlhf.config.schema import RewardConfig, RewardSourceConfig, RulesConfig, source_name
from hpcrlhf.models.value import last_token_values, reward_stats
from hpcrlhf.rewards.remote import RemoteSource
from hpcrlhf.rewards.response import Response, Scorer
from hpcrlhf.rewards.rules import DEFAULT_RULES, resolve_rule

SourceScorer = Callable[[Sequence[Response]], torch.Tensor]
"""One source: the responses' values, float32 on the CPU."""


class RewardModelScorer:
    """A frozen reward model scoring prompt + response sequences at their last token."""

    def __init__(self, model, tokenizer, policy_tokenizer, source: RewardSourceConfig, batch_size: int, device):
        self.model, self.tokenizer = model, tokenizer
        # None: no policy (a reward server): the text is all there is
        self.same_vocab = policy_tokenizer is not None and tokenizer.get_vocab() == policy_tokenizer.get_vocab()
        self.stats = reward_stats(model.module.config) if source.normalize else None
        self.pad_id, self.batch_size, self.device = tokenizer.pad_token_id, batch_size, device

    def _sequence(self, r: Response) -> list[int]:
        if self.same_vocab:
            return list(r.sequence_ids)
        # Another vocabulary: the model sees the text, ending in its own EOS like its training data.
        return self.tokenizer(r.prompt + r.text, add_special_tokens=True)["input_ids"] + [self.tokenizer.eos_token_id]

    @torch.no_grad()
    def __call__(self, responses: Sequence[Response]) -> torch.Tensor:
        from hpcrlhf.engines.hf_generate import right_pad  # transformers (+3 s): only with a reward model

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

    `load_model(path, field)` gives a frozen value model (`FrozenModel` of a `ValueModel`) for a
    reward model folder named by config field `field`; `rules` sets the built-in rules."""

    def __init__(self, cfg: RewardConfig, load_model: Callable[[str, str], Any], tokenizer, task, device,
                 trust_remote_code: bool = False, rules: RulesConfig = DEFAULT_RULES,
                 served: Mapping[int, tuple[Sequence[str], str]] | None = None):
        self.cfg = cfg
        self.weights = [s.weight for s in cfg.sources]
        self.names = [source_name(i, s) for i, s in enumerate(cfg.sources)]
        # Rules and servers are resolved first: a typo or a missing token fails before any reward model is loaded.
        served = dict(served or {})
        missing = [i for i, s in enumerate(cfg.sources) if s.servers and i not in served]
        if missing:  # the runtime starts them first (hpcrlhf.cluster.reward_servers)
            raise ValueError(f"reward.sources{missing} are served by the job's reward servers, but none were given")
        resolved = {i: RuleScorer(RemoteSource(s, cfg.remote, f"reward.sources[{i}]", served[i]) if i in served
                                  else EnvReward(f"reward.sources[{i}].env") if s.env
                                  else resolve_rule(s.rule, task, f"reward.sources[{i}].rule",
                                                    timeout_s=cfg.rule_timeout_s, rules=rules) if s.rule is not None
                                  else RemoteSource(s, cfg.remote, f"reward.sources[{i}]"))
                    for i, s in enumerate(cfg.sources) if s.model is None or i in served}
        self.scorers: list[SourceScorer] = [
            resolved[i] if i in resolved else self._model_scorer(i, s, load_model, tokenizer, device, trust_remote_code)
            for i, s in enumerate(cfg.sources)]

    def _model_scorer(self, i: int, source: RewardSourceConfig, load_model, tokenizer, device,
                      trust_remote_code: bool) -> SourceScorer:
        from hpcrlhf.models.loading import load_tokenizer  # transformers (+3 s): only with a reward model

        rm_tokenizer = load_tokenizer(source.model, trust_remote_code=trust_remote_code, key=f"reward.sources[{i}].model")
        return RewardModelScorer(load_model(source.model, f"reward.sources[{i}].model"), rm_tokenizer, tokenizer, source,
                                 self.cfg.batch_size, device)

    @property
    def has_models(self) -> bool:
        """Whether a reward model scores here (its forwards are collective under ZeRO-3)."""
        return any(isinstance(s, RewardModelScorer) for s in self.scorers)

    def score(self, responses: Sequence[Response]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(weighted sum, {source name: values}) for each response, float32 on the CPU. Reward models
        score first: every rank runs their forwards (sharded under ZeRO-3) before a rule can be cut
        short by a stop request (StopRequested) on one rank."""
        models_first = sorted(zip(self.names, self.scorers), key=lambda item: isinstance(item[1], RuleScorer))
        computed = {name: scorer(responses) for name, scorer in models_first}
        parts = {name: computed[name] for name in self.names}
        total = torch.zeros(len(responses))
        for weight, values in zip(self.weights, parts.values()):
            total += weight * values
        return total, parts


@dataclass(frozen=True)
class EnvReward:
    """`reward.sources: [{env: true}]`: each trajectory's reward from its environment (the rewards of
    its turns plus the one at its end)."""

    label: str

    def scores(self, responses: Sequence[Response]) -> list[float]:
        missing = [i for i, r in enumerate(responses) if r.episode is None]
        if missing:
            raise ValueError(f"{self.label}: responses {missing[:5]} are not multi-turn trajectories (no agent ran them)")
        return [float(r.episode.reward) for r in responses]


@dataclass(frozen=True)
class RuleScorer:
    """A rule or a reward server as a reward source: its value for each response."""

    rule: Scorer

    def __call__(self, responses: Sequence[Response]) -> torch.Tensor:
        return torch.tensor(self.rule.scores(responses), dtype=torch.float32)


def adjust_scores(scores: torch.Tensor, lengths: torch.Tensor, finished: torch.Tensor, cfg: RewardConfig,
                  max_new_tokens: int) -> torch.Tensor:
    """Scores with the length penalty (per response token), the missing-EOS penalty and DAPO's
    overlong shaping (`overlong_penalty`) applied."""
    out = scores - cfg.length_penalty * lengths.float()
    if cfg.missing_eos_penalty is not None:
        out = out + cfg.missing_eos_penalty * (~finished.bool()).float()
    if cfg.overlong_buffer:
        out = out + overlong_penalty(lengths, max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty).to(out.dtype)
    return out


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), per response: 0 up to
    max_new_tokens - buffer tokens, then falling linearly to -penalty at max_new_tokens (and
    below it past the limit, which a cut response never is)."""
    expected = max_new_tokens - buffer
    return torch.clamp(-(lengths.double() - expected) / buffer * penalty, max=0.0)
