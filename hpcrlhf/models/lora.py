"""LoRA and QLoRA (peft): low-rank adapters on a frozen base, and export as a plain model.

`apply_lora` wraps any model a trainer loads (a causal LM, or the sequence-classification model
inside a value model, whose `score` head is then trained in full). Export merges the adapters
into a fresh copy of the base on the CPU (`merge_adapters`), so it works the same whether the
trained weights were sharded by ZeRO-3 or not, and writes both the merged model (loadable with
plain transformers or vLLM) and the adapter alone.

QLoRA loads the frozen base in 4-bit NF4 through bitsandbytes, which needs a CUDA GPU; asking
for it elsewhere is an error before any model is loaded. The exported model merges the adapters
into the 16-bit base, the usual QLoRA practice.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from collections.abc import Callable

import torch

from hpcrlhf.config.schema import LoRAConfig
from hpcrlhf.errors import ConfigError, ModelError

ADAPTER_DIR = "adapter"
_ADAPTER_KEYS = ("lora_", "modules_to_save")


def quantization_config(cfg: LoRAConfig, *, on_gpu: bool | None = None):
    """bitsandbytes' 4-bit config for QLoRA, or None; an error where it cannot run."""
    if not cfg.load_in_4bit:
        return None
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    have_bnb = importlib.util.find_spec("bitsandbytes") is not None
    if not (on_gpu and have_bnb):
        why = "no CUDA GPU is in use" if not on_gpu else "the bitsandbytes package is not installed"
        raise ModelError(f"lora.load_in_4bit: QLoRA's 4-bit base cannot be used here: {why}; set "
                         "lora.load_in_4bit=false (plain LoRA works everywhere), or run on a CUDA GPU with "
                         "bitsandbytes installed (pip install bitsandbytes)")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig, *, value_head: bool = False,
               gradient_checkpointing: bool = False) -> torch.nn.Module:
    """`model` with LoRA adapters (only adapters, and a value head, stay trainable)."""
    from peft import LoraConfig, TaskType, get_peft_model, prepare_model_for_kbit_training

    targets = "all-linear" if cfg.target_modules == "all-linear" else [m.strip() for m in cfg.target_modules.split(",") if m.strip()]
    if cfg.load_in_4bit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    elif gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    peft_cfg = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                          task_type=TaskType.SEQ_CLS if value_head else TaskType.CAUSAL_LM)
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as e:
        raise ConfigError(f"lora.target_modules: {cfg.target_modules!r} does not fit {type(model).__name__}: {e}; "
                          "use 'all-linear' or names of its linear layers (e.g. q_proj,v_proj)") from None


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trained part of a peft model's full state dict: adapters and fully trained modules."""
    return {k: v for k, v in state.items() if any(tag in k for tag in _ADAPTER_KEYS)}


def merge_adapters(state: dict[str, torch.Tensor], build_base: Callable[[], torch.nn.Module], cfg: LoRAConfig, *,
                   value_head: bool, folder: Path) -> torch.nn.Module:
    """Rebuild base + adapters from a trained peft state dict, save the adapter into
    `folder/adapter`, and return the merged plain model (not yet saved)."""
    peft_model = apply_lora(build_base(), cfg, value_head=value_head)
    trained = adapter_state(state)
    missing, unexpected = peft_model.load_state_dict(trained, strict=False)
    expected = set(adapter_state(peft_model.state_dict()))
    if unexpected or expected - set(trained):
        raise ModelError(f"LoRA export: trained adapter weights do not match a rebuilt model "
                         f"(unexpected {sorted(unexpected)[:3]}, missing {sorted(expected - set(trained))[:3]})")
    peft_model.save_pretrained(str(folder / ADAPTER_DIR))
    return peft_model.merge_and_unload()
