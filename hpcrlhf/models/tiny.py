"""Tiny causal language models, built in code so tests and demos never touch a model hub.

`build_tiny_model_dir(family)` writes a folder that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load like any downloaded checkpoint: a config made here, random
weights drawn under a fixed seed (two builds are byte-identical) and the bundled tokenizer.
Several architectures are offered so the code paths that differ between them (rotary vs learned
positions, grouped-query attention, mixture of experts) get exercised.

The llama is the default for tests and the demo. Its size was chosen so that about a minute of
SFT on 2 CPU cores teaches it two-digit addition (`ArithmeticTask(max_operand=99)`) to nearly
100 % on held-out problems, while an untrained one scores zero (numbers below).

Note: transformers loads the tokenizer of a qwen2 folder as `Qwen2Tokenizer`, which replaces
the saved pre-tokenizer by Qwen's own regex (digits are still one per token); it agrees with
the bundled tokenizer on the corpus, prompts and chat template.

Names of the form `builtin:tiny-<family>` (e.g. `builtin:tiny-llama`) can stand wherever a model
path is accepted; `resolve_model_path` turns them into the built folder.

`builtin:llama-<N>m` (e.g. `builtin:llama-20m`, `builtin:llama-500m`) names a llama of about N
million parameters with the bundled tokenizer, for benchmarks where arithmetic rather than process
overhead must set the step time (`sized_llama_dims` says its shape; built once, cached, seeded).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig

from hpcrlhf.cache import atomic_dir, cache_dir
from hpcrlhf.errors import ModelError
from hpcrlhf.models.tokenizer import tiny_tokenizer_dir, tokenizer_key

TINY_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "gpt2")
BUILTIN_PREFIX = "builtin:tiny-"
SIZED_PREFIX = "builtin:llama-"

# Bump when a family's config or initialisation changes, so stale cache entries are not reused.
# 2: version 1 could cache a folder without weights when built by rank > 0 of a distributed job.
BUILDER_VERSION = "2"
INIT_SEED = 1234

# Shared dimensions, chosen by experiment: a plain SFT loop (AdamW lr 2e-3, 50 warmup steps then
# cosine, batch 64, loss on response + EOS) on ArithmeticTask(max_operand=99) takes this llama
# (0.43M parameters) from 0 % to 99-100 % greedy exact match on 300 eval prompts in 2400-2600
# steps, 50-60 s on 2 CPU cores (three task seeds). Shorter schedules: 1200 steps (~26 s) 33 %,
# 1800 steps 59 %. Four layers were slower per second (1200 steps, 52 s: 65 %).
HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2  # grouped-query attention where the family supports it
INTERMEDIATE = 256
MAX_POSITIONS = 512


def _config(family: str, vocab_size: int, special: dict[str, int]) -> PretrainedConfig:
    common: dict[str, Any] = dict(vocab_size=vocab_size, **special)
    if family == "gpt2":
        return transformers.GPT2Config(
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            n_inner=INTERMEDIATE,
            n_positions=MAX_POSITIONS,
            **common,
        )
    decoder: dict[str, Any] = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=INTERMEDIATE,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        **common,
    )
    if family == "llama":
        return transformers.LlamaConfig(**decoder)
    if family == "mistral":
        return transformers.MistralConfig(sliding_window=None, **decoder)
    if family == "mixtral":
        # Experts are half-width so the MoE model costs about as much as the dense ones.
        decoder["intermediate_size"] = INTERMEDIATE // 2
        return transformers.MixtralConfig(
            num_local_experts=4, num_experts_per_tok=2, sliding_window=None, **decoder
        )
    if family == "qwen2":
        return transformers.Qwen2Config(use_sliding_window=False, **decoder)
    raise ModelError(_unknown_family(family))


def _unknown_family(family: str) -> str:
    return (
        f"unknown tiny model family {family!r}: valid families are {', '.join(TINY_FAMILIES)} "
        f"(as names: {', '.join(BUILTIN_PREFIX + f for f in TINY_FAMILIES)})"
    )


def tiny_model_key(family: str) -> str:
    """Identifies a build: builder version, transformers version, tokenizer and dimensions.

    The dimensions are part of the key so that changing them can never reuse a cached folder
    built with the old ones.
    """
    dims = (HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, MAX_POSITIONS, INIT_SEED)
    digest = hashlib.sha256(f"{tokenizer_key()}|{dims}".encode()).hexdigest()[:10]
    return f"v{BUILDER_VERSION}-tf{transformers.__version__}-{digest}"


def build_tiny_model_dir(family: str = "llama") -> Path:
    """The folder of the tiny `family` model with its tokenizer, built once and cached."""
    if family not in TINY_FAMILIES:
        raise ModelError(_unknown_family(family))
    final = cache_dir("models") / f"tiny-{family}-{tiny_model_key(family)}"
    if final.is_dir():
        return final
    return _build(final, f"builtin:tiny-{family}", lambda vocab, special: _config(family, vocab, special))


def _build(final: Path, name: str, make_config) -> Path:
    """Write the model `make_config(vocab_size, special_token_ids)` describes, with the bundled
    tokenizer, into the cache folder `final` (atomically): float32 weights drawn under INIT_SEED."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir()))
    special = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = make_config(len(tokenizer), special)
    with atomic_dir(final) as tmp:
        # Initialise on CPU in float32 under a fixed seed: the same bytes on every machine.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config = GenerationConfig(**special)
        # Every process builds its own copy (the first to finish is kept): under torch.distributed,
        # transformers writes weights on rank 0 only, which would leave a rank > 0's copy without them.
        model.should_save_on_this_rank = lambda is_main_process: is_main_process
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        weights = "model.safetensors" if (tmp / "model.safetensors").is_file() else "model.safetensors.index.json"
        missing = [file for file in ("config.json", weights) if not (tmp / file).is_file()]
        if missing:
            raise ModelError(f"building {name}: transformers {transformers.__version__} did not write "
                             f"{', '.join(missing)}; nothing was cached. Use the transformers version in constraints.txt")
    return final


def sized_llama_dims(params_m: float) -> dict[str, int]:
    """Width, depth and heads of `builtin:llama-<params_m>m`: a width class by size (head dim 64 or
    128, grouped-query attention), then as many layers as bring the count nearest to params_m
    million (embeddings are small: the bundled tokenizer has few tokens)."""
    if not params_m > 0:
        raise ModelError(f"builtin:llama-{params_m:g}m: the size must be a positive number of millions of parameters "
                         "(e.g. builtin:llama-20m)")
    hidden, inter, heads, kv = ((768, 2048, 12, 4) if params_m <= 100 else (1536, 4096, 12, 4) if params_m <= 1500
                                else (2048, 5504, 16, 4))
    head_dim = hidden // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv * head_dim + 3 * hidden * inter + 2 * hidden
    return dict(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                num_hidden_layers=max(1, round(params_m * 1e6 / per_layer)))


def _sized(name: str) -> float:
    """N of `builtin:llama-<N>m`."""
    size = name[len(SIZED_PREFIX):]
    try:
        if not size.endswith("m"):
            raise ValueError
        return float(size[:-1])
    except ValueError:
        raise ModelError(f"model name {name!r}: sized builtin llamas are named builtin:llama-<N>m with N millions of "
                         "parameters, e.g. builtin:llama-20m or builtin:llama-500m") from None


def build_sized_llama_dir(params_m: float) -> Path:
    """The folder of `builtin:llama-<params_m>m` with the bundled tokenizer, built once and cached
    (float32 weights drawn under a fixed seed)."""
    dims = sized_llama_dims(params_m)
    digest = hashlib.sha256(f"{tokenizer_key()}|{sorted(dims.items())}|{INIT_SEED}".encode()).hexdigest()[:10]
    final = cache_dir("models") / f"llama-{params_m:g}m-v{BUILDER_VERSION}-tf{transformers.__version__}-{digest}"
    if final.is_dir():
        return final
    return _build(final, f"builtin:llama-{params_m:g}m", lambda vocab, special: transformers.LlamaConfig(
        vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False, **dims, **special))


def resolve_model_path(name_or_path: str) -> str:
    """Map `builtin:tiny-<family>` and `builtin:llama-<N>m` to their built folders; return anything
    else unchanged."""
    if name_or_path.startswith(SIZED_PREFIX):
        return str(build_sized_llama_dir(_sized(name_or_path)))
    if not name_or_path.startswith(BUILTIN_PREFIX):
        return name_or_path
    family = name_or_path[len(BUILTIN_PREFIX) :]
    if family not in TINY_FAMILIES:
        raise ModelError(_unknown_family(family))
    return str(build_tiny_model_dir(family))
