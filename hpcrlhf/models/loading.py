"""Loading tokenizers and causal LMs from the paths users give.

A path is checked before transformers sees it, and every problem names the config field that gave
the path: a folder needs a config.json that parses, tokenizer files and whole weight files (a
truncated or empty model.safetensors is named, not met in safetensors' C++); a name that is no
folder must be a hub model the hub can provide now (`hpcrlhf.hub`), else it fails at once naming
both readings instead of after a minute of hub retries.

The attention kernel is chosen here, once: flash-attn when it is installed and a GPU is used,
else PyTorch's sdpa. Asking for flash-attn where it cannot run is an error, not a silent swap.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from hpcrlhf.errors import ModelError
from hpcrlhf.formats import file_problem
from hpcrlhf.hub import hub_problem, is_hub_id
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


class ModelPathError(ModelError):
    """A model path that cannot be loaded; `key`, `path`, `reason` and `fix` are kept apart so a
    check of several paths can list them together."""

    def __init__(self, key: str, path: str, reason: str, fix: str):
        super().__init__(f"{key}: '{path}' {reason}; {fix}")
        self.key, self.path, self.reason, self.fix = key, path, reason, fix


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt", "merges.txt")
"""A folder with none of these has no tokenizer transformers can load."""
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
RESTORE = "restore the folder from where the model came from (copy or download it again, or export it again)"


def check_model_source(path: str, key: str = "model.path") -> None:
    """Fail at once, naming `key`, unless `path` is a model folder with a readable config.json or
    a hub model this process can get now (`hpcrlhf.hub`): a name that is neither never reaches
    transformers, which would retry the hub for about a minute."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        _read_config(folder, path, key)
        return
    if folder.exists():
        raise ModelPathError(key, path, "is a file, not a model folder",
                             "give the folder that holds its config.json and weights")
    if path.startswith(("/", ".", "~")) or not is_hub_id(path):
        where = "" if folder.is_absolute() else f" (nothing at {folder.absolute()})"
        raise ModelPathError(key, path, f"does not exist{where}", "give a model folder, a hub name or builtin:tiny-llama")
    why = hub_problem(path, "model")
    if why:
        raise ModelPathError(key, path, f"is neither a local folder (nothing at {folder.absolute()}) nor a hub "
                             f"model: {why}", "give the path of a model folder (download hub models to shared "
                             "storage first), a hub name where the hub can be reached, or builtin:tiny-llama")


def _read_config(folder: Path, path: str, key: str) -> None:
    file = folder / "config.json"
    if not file.is_file():
        raise ModelPathError(key, path, "has no config.json", "is it a Hugging Face model folder? "
                             "(`save_pretrained` writes one)")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ModelPathError(key, path, "has a config.json that is not text", RESTORE) from None
    except json.JSONDecodeError as e:
        raise ModelPathError(key, path, f"has a config.json that is not valid JSON (line {e.lineno} column "
                             f"{e.colno}: {e.msg})", RESTORE) from None
    if not isinstance(config, dict):
        raise ModelPathError(key, path, f"has a config.json holding a JSON {type(config).__name__}, not an object",
                             RESTORE)


def check_tokenizer_files(path: str, key: str = "model.path") -> None:
    """A local model folder must hold tokenizer files (hub names and the bundled models are
    not checked here)."""
    folder = Path(path).expanduser()
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelPathError(key, path, f"has no tokenizer files (none of {', '.join(TOKENIZER_FILES)})",
                             f"save the tokenizer of the model into it (tokenizer.save_pretrained('{path}')), or "
                             "copy those files from the model it was trained from")


def check_weight_files(path: str, key: str = "model.path") -> None:
    """The weight files of a local model folder (single files, or the shards an index names) must be
    there and whole (`hpcrlhf.formats`); a folder without any is left to transformers to report."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return
    files = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    for index in (folder / name for name in WEIGHT_INDEXES):
        if not index.is_file():
            continue
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ModelPathError(key, path, f"has an unreadable {index.name} (not JSON with a weight_map)",
                                 RESTORE) from None
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise ModelPathError(key, path, f"lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}, "
                                 f"named by its {index.name}", RESTORE)
        files += [folder / name for name in shards]
    for file in files:
        problem = file_problem(file)
        if problem:
            raise ModelPathError(key, path, f"has a damaged {file.name}: it {problem}", RESTORE)


def load_tokenizer(path: str, *, trust_remote_code: bool = False, key: str = "model.path"):
    from transformers import AutoTokenizer

    path = resolve_model_path(path)
    check_model_source(path, key)
    check_tokenizer_files(path, key)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise ModelError(f"{key}: cannot load the tokenizer of '{path}': {_first_line(e)}") from None
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ModelError(f"tokenizer of '{path}' has neither a pad nor an eos token; add one to the tokenizer")
        tok.pad_token = tok.eos_token  # a common, harmless default: padded positions carry no loss
    return tok


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def from_pretrained(auto_cls, path: str, *, attn_implementation: str = "auto", dtype: str = "fp32",
                    trust_remote_code: bool = False, quantization_config=None, key: str = "model.path", **kwargs):
    """`auto_cls.from_pretrained` with hpcrlhf's path checks, attention choice and errors; `key`
    is the config field that named the path."""
    from safetensors import SafetensorError
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # hpcrlhf reports its own progress
    path = resolve_model_path(path)
    check_model_source(path, key)
    check_weight_files(path, key)
    attn = resolve_attn_implementation(attn_implementation)
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    try:
        return auto_cls.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attn,
                                        trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError, SafetensorError) as e:
        what = auto_cls.__name__.removeprefix("AutoModelFor")
        raise ModelError(f"{key}: cannot load '{path}' as {what}: {e}") from None


def load_causal_lm(path: str, *, attn_implementation: str = "auto", dtype: str = "fp32", trust_remote_code: bool = False,
                   quantization_config=None, key: str = "model.path"):
    from transformers import AutoModelForCausalLM

    return from_pretrained(AutoModelForCausalLM, path, attn_implementation=attn_implementation, dtype=dtype,
                           trust_remote_code=trust_remote_code, quantization_config=quantization_config, key=key)
