"""Mixture-of-experts routers: the load-balancing loss that keeps every expert in use.

A router that sends most tokens to a few experts wastes the others (and, with expert
parallelism, overloads their devices). Switch Transformer's auxiliary loss -- the number of
experts times the sum over experts of (share of tokens routed to it) x (mean router probability
for it), 1 x top_k at perfect balance -- pushes towards an even load. transformers computes it
for its MoE models (Mixtral, Qwen2-MoE, ...) when a forward is asked for the router logits
(`output_router_logits=True`), over the non-padding tokens, and returns it as `aux_loss`.

`model.router_aux_loss_coef` > 0 adds coef x that loss to the trained model's loss (sft, the ppo
actor); 0 leaves the router logits uncomputed, as transformers does by default.
"""

from __future__ import annotations

from typing import Any


def has_router(config: Any) -> bool:
    """Whether a transformers model config describes a mixture-of-experts model with a router loss."""
    return hasattr(config, "output_router_logits") and hasattr(config, "router_aux_loss_coef")


def router_kwargs(coef: float) -> dict[str, bool]:
    """Forward arguments that make an MoE model return its load-balancing loss (none when off)."""
    return {"output_router_logits": True} if coef else {}
