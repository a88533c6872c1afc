"""Writing a trained model as a plain Hugging Face folder (loadable by transformers and vLLM).

Given the full trained state dict on rank 0, `export_pretrained` unwraps hpcrlhf's value-model
wrapper, merges LoRA adapters when there are any (keeping the adapter too, in `adapter/`),
records extra config entries (a reward model's normalisation statistics) and saves the model
with its tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from hpcrlhf.config.schema import LoRAConfig
from hpcrlhf.models.lora import merge_adapters
from hpcrlhf.models.value import ValueModel


def export_pretrained(module: torch.nn.Module, state: dict[str, torch.Tensor], folder: Path, tokenizer, *,
                      lora: LoRAConfig, build_base: Callable[[], torch.nn.Module],
                      config_updates: dict[str, Any] | None = None) -> None:
    value_head = isinstance(module, ValueModel)
    prefix = "hf_model." if value_head else ""
    model = module.hf_model if value_head else module
    state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    folder.mkdir(parents=True, exist_ok=True)
    if lora.rank:
        model, state = merge_adapters(state, build_base, lora, value_head=value_head, folder=folder), None
    for key, value in (config_updates or {}).items():
        setattr(model.config, key, value)
    model.save_pretrained(str(folder), state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
