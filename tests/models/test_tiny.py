"""The bundled tokenizer and tiny models: offline, deterministic, loadable by transformers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hpcrlhf.cache import atomic_dir, cache_dir
from hpcrlhf.errors import ModelError
from hpcrlhf.models.tiny import TINY_FAMILIES, build_tiny_model_dir, resolve_model_path
from hpcrlhf.models.tokenizer import build_tokenizer, corpus_text, tiny_tokenizer_dir


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory):
    """Every build in this module goes to a temporary cache, never the user's home."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HPCRLHF_CACHE", str(tmp_path_factory.mktemp("hpcrlhf-cache")))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir()))


def test_cache_dir_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCRLHF_CACHE", str(tmp_path / "root"))
    path = cache_dir("a", "b")
    assert path == tmp_path / "root" / "a" / "b" and path.is_dir()


def test_atomic_dir(tmp_path):
    final = tmp_path / "entry"
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("build failed")
    assert not final.exists() and list(tmp_path.iterdir()) == []

    with atomic_dir(final) as tmp:
        (tmp / "ok").write_text("mine")
    assert (final / "ok").read_text() == "mine"

    # Someone else finished first: their entry stays, ours is dropped.
    with atomic_dir(final) as tmp:
        (tmp / "ok").write_text("late")
    assert (final / "ok").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]


def test_tokenizer_is_deterministic():
    first = build_tokenizer().backend_tokenizer.to_str()
    second = build_tokenizer().backend_tokenizer.to_str()
    assert first == second


def test_digits_are_single_tokens(tokenizer):
    for digit in "0123456789":
        assert len(tokenizer(digit)["input_ids"]) == 1
    assert tokenizer.tokenize("12+345=357") == list("12+345=357")
    ids = tokenizer("907")["input_ids"]
    assert ids == [tokenizer.convert_tokens_to_ids(d) for d in "907"]
    assert tokenizer.decode(tokenizer("Adding 12 and 30 gives 42.")["input_ids"]) == (
        "Adding 12 and 30 gives 42."
    )


def test_special_tokens(tokenizer):
    ids = [
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        tokenizer.unk_token_id,
    ]
    assert None not in ids and len(set(ids)) == 4
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.eos_token == "<|eos|>"
    assert len(tokenizer) == 512
    # No BOS is prepended by plain encoding: prompt + response ids concatenate cleanly.
    assert tokenizer("1+2=")["input_ids"][0] != tokenizer.bos_token_id


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "12+34="}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|user|>\n12+34=<|eos|>\n<|assistant|>\n"
    full = messages + [{"role": "assistant", "content": "46"}]
    text = tokenizer.apply_chat_template(full, tokenize=False)
    assert text.endswith("<|assistant|>\n46<|eos|>\n")
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<|assistant|>") in ids


def test_the_chat_templates_renders_without_tools_are_unchanged(tokenizer):
    """Pinned from the template before tools were added: recipes and trained tiny models rely on them."""
    renders = [
        ([{"role": "user", "content": "12+34="}], True, "<|bos|><|user|>\n12+34=<|eos|>\n<|assistant|>\n"),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2="}], True,
         "<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\nHi<|eos|>\n<|assistant|>\nHello!<|eos|>\n<|user|>\n2+2="
         "<|eos|>\n<|assistant|>\n"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], False,
         "<|bos|><|user|>\na<|eos|>\n<|assistant|>\nb<|eos|>\n"),
    ]
    for messages, generation, text in renders:
        assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation) == text


def test_the_chat_template_shows_tools_their_calls_and_results(tokenizer):
    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return a * b

    def now() -> str:
        """The time."""
        return "noon"

    messages = [{"role": "user", "content": "37*59="},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 37, "b": 59}}}]},
                {"role": "tool", "name": "multiply", "content": "2183"}]
    text = tokenizer.apply_chat_template(messages, tools=[multiply, now], tokenize=False, add_generation_prompt=True)
    assert text == ("<|bos|><|system|>\nTools: multiply(a, b); now()<|eos|>\n<|user|>\n37*59=<|eos|>\n<|assistant|>\n"
                    '<tool_call>{"name":"multiply","arguments":{"a":37,"b":59}}</tool_call><|eos|>\n'
                    "<|user|>\n<tool_response>2183</tool_response><|eos|>\n<|assistant|>\n")
    with pytest.raises(Exception, match="unknown chat role robot: use system, user, assistant or tool"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_family_builds_and_loads(family, tokenizer):
    path = build_tiny_model_dir(family)
    assert (path / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(path))
    loaded_tok = AutoTokenizer.from_pretrained(str(path))
    prompt = "12+345="
    # qwen2 folders load as Qwen2Tokenizer (transformers insists); it must still agree.
    for text in [prompt, *corpus_text().splitlines()[:40]]:
        assert loaded_tok(text)["input_ids"] == tokenizer(text)["input_ids"], text
    batch = loaded_tok([prompt, "1+2="], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    for cfg in (model.config, model.generation_config):
        assert cfg.eos_token_id == tokenizer.eos_token_id
        assert cfg.bos_token_id == tokenizer.bos_token_id
        assert cfg.pad_token_id == tokenizer.pad_token_id
    if family == "mixtral":
        assert model.config.num_local_experts == 4 and model.config.num_experts_per_tok == 2
    # The second call reuses the cache entry.
    assert build_tiny_model_dir(family) == path


BUILD_AS_RANK = """
import os, sys, torch.distributed as dist
from hpcrlhf.models.tiny import build_tiny_model_dir
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=int(sys.argv[2]), world_size=2)
print(sorted(os.listdir(build_tiny_model_dir("llama"))))
dist.barrier()
"""


def test_every_rank_of_a_distributed_job_builds_a_complete_folder(tmp_path):
    """Ranks of a torchrun/MPI job may each build the model (first run on a node, a cache per node):
    rank 1's copy must hold the weights too (transformers writes them on rank 0 only by default)."""
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_AS_RANK, str(tmp_path / "rendezvous"), str(rank)],
                              env={**os.environ, "HPCRLHF_CACHE": str(tmp_path / f"cache-{rank}")},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, output[-3000:]
        assert "'config.json'" in output and "'model.safetensors'" in output, f"rank {rank}: {output[-3000:]}"
    first, second = (load_file(str(next((tmp_path / f"cache-{r}" / "models").glob("tiny-llama-*")) / "model.safetensors"))
                     for r in (0, 1))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_weights_are_deterministic(tmp_path, monkeypatch):
    dirs = []
    for name in ("a", "b"):
        monkeypatch.setenv("HPCRLHF_CACHE", str(tmp_path / name))
        dirs.append(build_tiny_model_dir("llama"))
    assert dirs[0] != dirs[1]
    first, second = (load_file(str(Path(d) / "model.safetensors")) for d in dirs)
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key
    files = [(d / "model.safetensors").read_bytes() for d in dirs]
    assert files[0] == files[1]


def test_resolve_model_path():
    path = resolve_model_path("builtin:tiny-llama")
    assert Path(path) == build_tiny_model_dir("llama")
    assert resolve_model_path("/some/where/model") == "/some/where/model"
    assert resolve_model_path("org/model-name") == "org/model-name"
    with pytest.raises(ModelError, match="builtin:tiny-llama"):
        resolve_model_path("builtin:tiny-falcon")
    with pytest.raises(ModelError, match="gpt2"):
        build_tiny_model_dir("falcon")


@pytest.mark.parametrize("size", [20, 60, 500, 3000])
def test_sized_llama_dims_count_the_parameters_asked_for(size):
    """`builtin:llama-<N>m`'s shape against the count transformers makes of it (built on the meta
    device: no memory): within one layer's worth of N million."""
    import transformers

    from hpcrlhf.models.tiny import sized_llama_dims

    dims = sized_llama_dims(size)
    config = transformers.LlamaConfig(vocab_size=512, tie_word_embeddings=False, **dims)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in model.parameters())
    layer = count / dims["num_hidden_layers"]
    assert abs(count - size * 1e6) < layer, (size, count, dims)
    assert dims["hidden_size"] % dims["num_attention_heads"] == 0
    assert dims["num_attention_heads"] % dims["num_key_value_heads"] == 0


def test_sized_llama_builds_once_and_bad_names_say_the_form():
    path = Path(resolve_model_path("builtin:llama-20m"))
    assert path == Path(resolve_model_path("builtin:llama-20m"))  # cached, not rebuilt
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert 19e6 < sum(p.numel() for p in model.parameters()) < 21e6
    assert AutoTokenizer.from_pretrained(str(path)).get_vocab() == AutoTokenizer.from_pretrained(
        str(tiny_tokenizer_dir())).get_vocab()
    for bad in ("builtin:llama-20", "builtin:llama-xm", "builtin:llama-0m", "builtin:llama--5m"):
        with pytest.raises(ModelError, match="builtin:llama-"):
            resolve_model_path(bad)
