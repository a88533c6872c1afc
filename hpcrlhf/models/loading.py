"""Loading tokenizers and causal LMs from the paths users give.

The attention kernel is chosen here, once: flash-attn when it is installed and a GPU is used,
else PyTorch's sdpa. Asking for flash-attn where it cannot run is an error, not a silent swap.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from hpcrlhf.errors import ModelError
from hpcrlhf.models.tiny import resolve_model_path

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_attn_implementation(requested: str, *, on_gpu: bool | None = None) -> str:
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    have_flash = importlib.util.find_spec("flash_attn") is not None
    if requested == "auto":
        return "flash_attention_2" if (have_flash and on_gpu) else "sdpa"
    if requested == "flash_attention_2" and not (have_flash and on_gpu):
        why = "the flash-attn package is not installed" if not have_flash else "no GPU is in use"
        raise ModelError(
            f"model.attn_implementation: 'flash_attention_2' cannot be used: {why}; "
            "use 'sdpa' (or 'auto'), or install flash-attn on a GPU machine (pip install '.[gpu]')"
        )
    return requested


def _check_model_path(path: str) -> None:
    p = Path(path).expanduser()
    looks_local = path.startswith(("/", ".", "~")) or p.exists() or path.count("/") > 1
    if looks_local and not p.exists():
        raise ModelError(f"model.path: '{path}' does not exist; give a model folder, a hub name or builtin:tiny-llama")
    if p.is_dir() and not (p / "config.json").exists():
        raise ModelError(f"model.path: '{path}' has no config.json; is it a Hugging Face model folder?")
    if not p.exists() and os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ModelError(
            f"model.path: '{path}' is not a local folder and the hub is off (HF_HUB_OFFLINE=1); "
            "download the model to shared storage and give its path"
        )


def load_tokenizer(path: str, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = resolve_model_path(path)
    _check_model_path(path)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ModelError(f"tokenizer of '{path}' has neither a pad nor an eos token; add one to the tokenizer")
        tok.pad_token = tok.eos_token  # a common, harmless default: padded positions carry no loss
    return tok


def from_pretrained(auto_cls, path: str, *, attn_implementation: str = "auto", dtype: str = "fp32",
                    trust_remote_code: bool = False, quantization_config=None, **kwargs):
    """`auto_cls.from_pretrained` with hpcrlhf's path checks, attention choice and errors."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # hpcrlhf reports its own progress
    path = resolve_model_path(path)
    _check_model_path(path)
    attn = resolve_attn_implementation(attn_implementation)
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    try:
        return auto_cls.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attn,
                                        trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as e:
        what = auto_cls.__name__.removeprefix("AutoModelFor")
        raise ModelError(f"model.path: cannot load '{path}' as {what}: {e}") from None


def load_causal_lm(path: str, *, attn_implementation: str = "auto", dtype: str = "fp32", trust_remote_code: bool = False,
                   quantization_config=None):
    from transformers import AutoModelForCausalLM

    return from_pretrained(AutoModelForCausalLM, path, attn_implementation=attn_implementation, dtype=dtype,
                           trust_remote_code=trust_remote_code, quantization_config=quantization_config)
