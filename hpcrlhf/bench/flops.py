"""Floating-point operations of a decoder-only transformer, from its Hugging Face config.

Counted as in the PaLM paper's MFU (Chowdhery et al. 2022, appendix B): a forward pass costs
2 FLOPs per parameter of every matrix multiply per token (embeddings are lookups and do not
count; the LM head does) plus the attention scores and weighted values, 2 x 2 x layers x
context x hidden per token; a training step (forward + backward) costs 3x the forward.
Mixture-of-experts layers count the experts a token is routed to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Shape:
    """What the FLOP count needs of a model."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    experts_per_token: int = 1
    gated_mlp: bool = True
    """SwiGLU-style MLP (gate, up, down: three matrices) rather than two (GPT-2)."""

    @classmethod
    def from_config(cls, config: Any) -> Shape:
        """From a `transformers` config (llama, mistral, mixtral, qwen2, gpt2 naming)."""
        def get(*names: str, default: Any = None) -> Any:
            return next((getattr(config, n) for n in names if getattr(config, n, None)), default)

        hidden = get("hidden_size", "n_embd")
        heads = get("num_attention_heads", "n_head")
        return cls(layers=get("num_hidden_layers", "n_layer"), hidden=hidden,
                   intermediate=get("intermediate_size", "n_inner", default=4 * hidden), heads=heads,
                   kv_heads=get("num_key_value_heads", default=heads), vocab=config.vocab_size,
                   experts_per_token=get("num_experts_per_tok", default=1),
                   gated_mlp=getattr(config, "model_type", "") != "gpt2")

    @property
    def matmul_params_per_layer(self) -> int:
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim  # q, o + k, v
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate * self.experts_per_token
        return attention + mlp

    def matmul_params(self, lm_head: bool = True) -> int:
        """Parameters a token multiplies through (the LM head, or a value model's 1-wide head)."""
        return self.layers * self.matmul_params_per_layer + (self.hidden * self.vocab if lm_head else self.hidden)


def forward_flops(shape: Shape, tokens: int, context: float, lm_head: bool = True) -> float:
    """FLOPs of a forward pass over `tokens` tokens whose mean attended context is `context`."""
    return tokens * (2 * shape.matmul_params(lm_head) + 4 * shape.layers * context * shape.hidden)


def train_flops(shape: Shape, tokens: int, context: float, lm_head: bool = True, recompute: bool = False) -> float:
    """Forward + backward (2x the forward); activation recomputation adds one more forward."""
    return (4.0 if recompute else 3.0) * forward_flops(shape, tokens, context, lm_head)


def causal_context(prompt_tokens: float, response_tokens: float) -> float:
    """Mean number of positions a token attends to in a causal sequence of prompt + response."""
    return (prompt_tokens + response_tokens + 1) / 2
