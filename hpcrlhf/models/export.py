"""Writing a trained model as a plain Hugging Face folder (loadable by transformers and vLLM).

Given the full trained state dict on rank 0, `export_pretrained` unwraps hpcrlhf's value-model
wrapper, merges LoRA adapters when there are any (keeping the adapter too, in `adapter/`),
records extra config entries (a reward model's normalisation statistics) and saves the model
with its tokenizer, all into a staging folder renamed into place when complete (a failed export
leaves no half folder). `checkpoint_names` gives a state dict the names and layout it has on
disk, which is what vLLM loads (weight sync).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

import torch

from hpcrlhf.config.schema import LoRAConfig
from hpcrlhf.run.diskspace import out_of_space_is_an_error
from hpcrlhf.models.lora import merge_adapters
from hpcrlhf.models.value import ValueModel
from hpcrlhf.run.files import replace_file, staged_folder


def export_pretrained(module: torch.nn.Module, state: dict[str, torch.Tensor], folder: Path, tokenizer, *,
                      lora: LoRAConfig, build_base: Callable[[], torch.nn.Module],
                      config_updates: dict[str, Any] | None = None, files: dict[str, str] | None = None) -> None:
    """Write the model into `folder` (and `files`, name -> text, beside it). It is written into a
    fresh private staging folder and renamed into place only when complete (hpcrlhf.run.files), so
    a failed export (a full disk) leaves no half folder and an earlier export as it was."""
    value_head = isinstance(module, ValueModel)
    prefix = "hf_model." if value_head else ""
    model = module.hf_model if value_head else module
    state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    needs = sum(v.numel() * v.element_size() for v in state.values())
    with out_of_space_is_an_error(folder.parent, f"the exported model ({folder.name}/)", needs=needs,
                                  resume_hint=": it exports the model again"), staged_folder(folder) as staging:
        if lora.rank:
            model, state = merge_adapters(state, build_base, lora, value_head=value_head, folder=staging), None
        for key, value in (config_updates or {}).items():
            setattr(model.config, key, value)
        model.save_pretrained(str(staging), state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        for name, text in (files or {}).items():
            replace_file(staging / name, text)


def checkpoint_names(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (from `model.state_dict()`) in the model's checkpoint format: the names and
    tensor layout `save_pretrained` writes and vLLM loads. transformers 5 holds some weights in
    memory differently from its checkpoints -- Mixtral's experts as fused 3-D tensors
    (`mlp.experts.gate_up_proj`) where checkpoints have one `w1`/`w2`/`w3` per expert under
    `block_sparse_moe` -- and undoes that when saving; this applies the same reversal (its
    conversion table is the one the model was loaded with). Unchanged for families without
    conversions (Llama, Qwen2, GPT-2, ...)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(state))



def checkpoint_stream(engine, chunk_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A training engine's weights as (name, tensor) pairs in checkpoint format, chunk by chunk
    (`TrainingEngine.state_chunks`: under ZeRO-3 a tensor is valid only until the next pair is
    asked for). Every rank must exhaust it (the gathers are collective); only rank 0 gets pairs."""
    for chunk in engine.state_chunks(chunk_bytes):
        if chunk:
            yield from checkpoint_names(engine.module, chunk).items()
