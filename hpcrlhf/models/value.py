"""Value models: a causal-LM backbone with a scalar head, for reward models and PPO critics.

On disk a value model is Hugging Face's `*ForSequenceClassification` with one label (the head is
the linear `score` layer), so a trained reward model loads with plain transformers (and serves
with vLLM's reward/classify runner) without hpcrlhf. Loading a causal-LM folder instead gives
the same backbone with a freshly initialised head: that is how a reward model starts from an SFT
model, and a PPO critic from a reward model (head kept) or from the policy (head new).

hpcrlhf needs a value at *every* token (the critic), and the reward of a sequence is the value
at its last real token, so `ValueModel` runs backbone and head itself rather than transformers'
pooled forward. A trained reward model's normalisation statistics (mean and standard deviation
of its rewards on held-out data) are stored in its config.json as `reward_mean`/`reward_std`;
`normalized_rewards` applies them.
"""

from __future__ import annotations

import torch

from hpcrlhf.errors import ModelError

REWARD_MEAN, REWARD_STD = "reward_mean", "reward_std"


class ValueModel(torch.nn.Module):
    """Per-token scalar values of a sequence-classification model with one label."""

    def __init__(self, hf_model: torch.nn.Module):
        super().__init__()
        self.hf_model = hf_model
        inner = self._inner()
        if not hasattr(inner, "score"):
            raise ModelError(f"{type(inner).__name__} has no `score` head; hpcrlhf value models need a "
                             "*ForSequenceClassification architecture with a linear `score` layer")

    def _inner(self) -> torch.nn.Module:
        """The transformers model (under a peft wrapper when LoRA is applied)."""
        return self.hf_model.get_base_model() if hasattr(self.hf_model, "get_base_model") else self.hf_model

    @property
    def config(self):
        return self._inner().config

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.hf_model.gradient_checkpointing_enable(**kwargs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = False) -> torch.Tensor:
        """(batch, seq) values in fp32."""
        inner = self._inner()
        # LoRA layers are injected into the backbone in place and the head is wrapped in place,
        # so calling the parts directly still runs the adapters.
        hidden = inner.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=use_cache).last_hidden_state
        return inner.score(hidden).squeeze(-1).float()


def last_token_values(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The value at each row's last attended position (right-padded rows): the sequence reward."""
    last = attention_mask.long().sum(-1) - 1
    return values.gather(-1, last.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def load_value_model(path: str, *, pad_token_id: int, attn_implementation: str = "auto", dtype: str = "fp32",
                     trust_remote_code: bool = False, quantization_config=None, key: str = "model.path"):
    """A one-label sequence-classification model from a reward-model or causal-LM folder (`key`: the
    config field that names it, for errors)."""
    from transformers import AutoModelForSequenceClassification

    from hpcrlhf.models.loading import from_pretrained  # transformers, as above: rewards imports this module

    return from_pretrained(AutoModelForSequenceClassification, path, attn_implementation=attn_implementation,
                           dtype=dtype, trust_remote_code=trust_remote_code, quantization_config=quantization_config,
                           num_labels=1, pad_token_id=pad_token_id, key=key)


def reward_stats(config) -> tuple[float, float] | None:
    """(mean, std) stored by reward-model training, or None for a model without them."""
    mean, std = getattr(config, REWARD_MEAN, None), getattr(config, REWARD_STD, None)
    return None if mean is None or std is None else (float(mean), float(std))


def normalized_rewards(rewards: torch.Tensor, config) -> torch.Tensor:
    """(r - mean) / std with the model's stored statistics (unchanged when it has none)."""
    stats = reward_stats(config)
    if stats is None:
        return rewards
    mean, std = stats
    return (rewards - mean) / max(std, 1e-8)
