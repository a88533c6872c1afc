"""Model shapes for planning: parameter count and the dimensions the memory maths needs.

The node map is built before anything is loaded, so a model's size comes from its config.json
alone: a local folder's file, a bundled model's (`builtin:tiny-*`, `builtin:llama-<N>m`), or the published config
numbers of a few well-known hub models (`KNOWN_CONFIGS`), since planning runs where the hub may
be out of reach. Parameters are counted with the exact formula of each supported architecture
(llama, mistral, qwen2, mixtral, gpt2); tests check it against models transformers builds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrlhf.errors import ConfigError, ModelError

BUILTIN_PREFIX = "builtin:"  # hpcrlhf.models.tiny's names; not imported, it pulls in torch


class ShapeError(ConfigError):
    """A model path the planner cannot size; `key`, `path`, `reason` and `fix` are kept apart so
    the node map can list it with its other problems."""

    def __init__(self, key: str, path: str, reason: str, fix: str):
        super().__init__(f"{key}: {path!r} {reason}; {fix}")
        self.key, self.path, self.reason, self.fix = key, path, reason, fix


@dataclass(frozen=True)
class ModelShape:
    """What the planner knows of a model: its size and the dimensions the memory maths uses."""

    params: int
    """Parameters of the causal LM (lm_head counted once when tied to the embeddings)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    """MLP width (of one expert for mixture-of-experts models)."""
    tied_embeddings: bool

    @property
    def value_model_params(self) -> int:
        """Parameters as a value model (critic, reward model): the backbone plus a linear score
        head of one output without bias (`*ForSequenceClassification`); no lm_head."""
        lm_head = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.params - lm_head + self.hidden_size


def _decoder(model_type: str, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
             tied: bool = False) -> dict[str, Any]:
    """A config.json of a llama-like decoder, as the model's hub page publishes it."""
    return {"model_type": model_type, "num_hidden_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": intermediate,
            "vocab_size": vocab, "tie_word_embeddings": tied}


KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-2-7b-hf": _decoder("llama", 32, 4096, 32, 32, 11008, 32000),
    "meta-llama/Llama-2-13b-hf": _decoder("llama", 40, 5120, 40, 40, 13824, 32000),
    "meta-llama/Llama-2-70b-hf": _decoder("llama", 80, 8192, 64, 8, 28672, 32000),
    "codellama/CodeLlama-7b-hf": _decoder("llama", 32, 4096, 32, 32, 11008, 32016),
    "codellama/CodeLlama-13b-hf": _decoder("llama", 40, 5120, 40, 40, 13824, 32016),
    "codellama/CodeLlama-34b-hf": _decoder("llama", 48, 8192, 64, 8, 22016, 32000),
    "meta-llama/Meta-Llama-3-8B": _decoder("llama", 32, 4096, 32, 8, 14336, 128256),
    "meta-llama/Meta-Llama-3-70B": _decoder("llama", 80, 8192, 64, 8, 28672, 128256),
    "meta-llama/Llama-3.1-8B": _decoder("llama", 32, 4096, 32, 8, 14336, 128256),
    "meta-llama/Llama-3.1-70B": _decoder("llama", 80, 8192, 64, 8, 28672, 128256),
    "mistralai/Mistral-7B-v0.1": _decoder("mistral", 32, 4096, 32, 8, 14336, 32000),
    "Qwen/Qwen2.5-0.5B": _decoder("qwen2", 24, 896, 14, 2, 4864, 151936, tied=True),
    "Qwen/Qwen2.5-1.5B": _decoder("qwen2", 28, 1536, 12, 2, 8960, 151936, tied=True),
    "Qwen/Qwen2.5-3B": _decoder("qwen2", 36, 2048, 16, 2, 11008, 151936, tied=True),
    "Qwen/Qwen2.5-7B": _decoder("qwen2", 28, 3584, 28, 4, 18944, 152064),
    "Qwen/Qwen2.5-14B": _decoder("qwen2", 48, 5120, 40, 8, 13824, 152064),
    "Qwen/Qwen2.5-32B": _decoder("qwen2", 64, 5120, 40, 8, 27648, 152064),
    "Qwen/Qwen2.5-72B": _decoder("qwen2", 80, 8192, 64, 8, 29568, 152064),
}
"""Hub name -> published config numbers (chat/instruct variants share their base's shape)."""
KNOWN_CONFIGS.update({
    "meta-llama/Llama-2-7b-chat-hf": KNOWN_CONFIGS["meta-llama/Llama-2-7b-hf"],
    "meta-llama/Llama-2-13b-chat-hf": KNOWN_CONFIGS["meta-llama/Llama-2-13b-hf"],
    "meta-llama/Llama-2-70b-chat-hf": KNOWN_CONFIGS["meta-llama/Llama-2-70b-hf"],
    "meta-llama/Meta-Llama-3-8B-Instruct": KNOWN_CONFIGS["meta-llama/Meta-Llama-3-8B"],
    "meta-llama/Meta-Llama-3-70B-Instruct": KNOWN_CONFIGS["meta-llama/Meta-Llama-3-70B"],
    "meta-llama/Llama-3.1-8B-Instruct": KNOWN_CONFIGS["meta-llama/Llama-3.1-8B"],
    "meta-llama/Llama-3.1-70B-Instruct": KNOWN_CONFIGS["meta-llama/Llama-3.1-70B"],
    **{f"Qwen/Qwen2.5-{size}-Instruct": KNOWN_CONFIGS[f"Qwen/Qwen2.5-{size}"]
       for size in ("0.5B", "1.5B", "3B", "7B", "14B", "32B", "72B")},
})


def _llama_like(c: dict[str, Any]) -> ModelShape:
    """llama, mistral, qwen2 and mixtral: embeddings, per layer q/k/v/o projections (q/k/v with
    bias in qwen2 or with `attention_bias`), a gated MLP (three matrices; one per expert plus a
    router in mixtral) and two RMSNorms, a final RMSNorm, and an lm_head unless tied."""
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or h // heads
    inter = c["intermediate_size"]
    tied = bool(c.get("tie_word_embeddings", False))
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = h * q + 2 * h * kv + q * h
    if c["model_type"] == "qwen2" or c.get("attention_bias"):
        attention += q + 2 * kv + (h if c.get("attention_bias") else 0)  # llama's attention_bias also biases o_proj
    mlp = 3 * h * inter + (2 * inter + h if c.get("mlp_bias") else 0)
    if c["model_type"] == "mixtral":
        experts = c["num_local_experts"]
        mlp = experts * mlp + h * experts  # experts plus the router (no bias)
    per_layer = attention + mlp + 2 * h
    params = vocab * h + layers * per_layer + h + (0 if tied else vocab * h)
    return ModelShape(params, layers, h, heads, kv_heads, head_dim, vocab, inter, tied)


def _gpt2(c: dict[str, Any]) -> ModelShape:
    """gpt2: token and position embeddings, per layer two LayerNorms, fused qkv and output
    projections and a two-matrix MLP (all with bias), a final LayerNorm, lm_head tied by default."""
    h, layers, vocab, heads = c["n_embd"], c["n_layer"], c["vocab_size"], c["n_head"]
    inter = c.get("n_inner") or 4 * h
    tied = bool(c.get("tie_word_embeddings", True))
    per_layer = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * inter + inter) + (inter * h + h)
    params = vocab * h + c["n_positions"] * h + layers * per_layer + 2 * h + (0 if tied else vocab * h)
    return ModelShape(params, layers, h, heads, heads, h // heads, vocab, inter, tied)


_ARCHITECTURES = {"llama": _llama_like, "mistral": _llama_like, "qwen2": _llama_like, "mixtral": _llama_like,
                  "gpt2": _gpt2}


def shape_from_config(config: dict[str, Any], *, key: str, source: str) -> ModelShape:
    """The shape of a model from its config.json contents; `key`/`source` name it in errors."""
    model_type = config.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ShapeError(key, source, f"is a {model_type!r} model, which the planner cannot size",
                         f"use a model of a supported type: {', '.join(sorted(_ARCHITECTURES))}")
    try:
        return _ARCHITECTURES[model_type](config)
    except (KeyError, TypeError, ZeroDivisionError) as err:
        raise ShapeError(key, source, f"has a config.json without a usable {err} entry",
                         "give a complete Hugging Face config.json") from None


def shape_of(path: str, key: str = "model.path") -> ModelShape:
    """The shape of the model at `path`: a local folder, `builtin:tiny-<family>` or a known hub name.

    `key` is the config field that named the path (`critic.path`, `reward.sources[0].model`), so a
    path that cannot be sized is reported where the user wrote it.
    """
    if path.startswith(BUILTIN_PREFIX):
        from hpcrlhf.models.tiny import resolve_model_path  # torch, transformers: `hpcrlhf plan` needs neither

        try:
            path = resolve_model_path(path)
        except ModelError as err:
            raise ShapeError(key, path, "is not a bundled model", str(err)) from None
    folder = Path(path).expanduser()
    if folder.is_dir():
        file = folder / "config.json"
        if not file.is_file():
            raise ShapeError(key, path, "is a folder without config.json", "give a Hugging Face model folder")
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ShapeError(key, path, f"has an unreadable config.json ({err})",
                             "repair or replace the file") from None
        return shape_from_config(config, key=key, source=path)
    if path in KNOWN_CONFIGS:
        return shape_from_config(KNOWN_CONFIGS[path], key=key, source=path)
    raise ShapeError(key, path, "is neither a local model folder nor a hub model whose shape the planner knows",
                     f"give a local model folder with its config.json (download it to shared storage), or a known "
                     f"name: {', '.join(sorted(KNOWN_CONFIGS))}")
