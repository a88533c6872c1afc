"""Model shapes: the parameter formula against models transformers builds, published sizes, and
paths the planner cannot size reported at the field that names them."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from hpcrlhf.errors import ConfigError
from hpcrlhf.models.tiny import TINY_FAMILIES, build_tiny_model_dir
from hpcrlhf.placement.shapes import KNOWN_CONFIGS, shape_from_config, shape_of

from .helpers import find, problems


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_params_of_tiny_models_match_the_loaded_models(family):
    folder = str(build_tiny_model_dir(family))
    shape = shape_of(f"builtin:tiny-{family}")
    assert shape == shape_of(folder)
    assert shape.params == _count(AutoModelForCausalLM.from_pretrained(folder))
    # critics and reward models load the backbone with a one-output score head
    assert shape.value_model_params == _count(AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1))


def test_known_configs_match_transformers_and_published_sizes():
    distinct = {id(config): (name, config) for name, config in KNOWN_CONFIGS.items()}  # aliases share a config
    for name, config in distinct.values():
        with torch.device("meta"):  # no memory: only the parameter shapes
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        assert shape_from_config(config, key="model.path", source=name).params == _count(model), name
    published = {  # parameter counts on the models' hub pages
        "meta-llama/Llama-2-7b-hf": 6_738_415_616, "meta-llama/Llama-2-13b-hf": 13_015_864_320,
        "meta-llama/Llama-2-70b-hf": 68_976_648_192, "meta-llama/Meta-Llama-3-8B": 8_030_261_248,
        "meta-llama/Meta-Llama-3-70B": 70_553_706_496, "mistralai/Mistral-7B-v0.1": 7_241_732_096,
        "Qwen/Qwen2.5-7B": 7_615_616_512, "Qwen/Qwen2.5-72B": 72_706_203_648,
    }
    for name, params in published.items():
        assert shape_of(name).params == params, name
    llama70 = shape_of("meta-llama/Llama-2-70b-hf")
    assert (llama70.num_layers, llama70.num_attention_heads, llama70.num_kv_heads, llama70.head_dim) == (80, 64, 8, 128)


def test_a_local_folder_wins_over_the_table(tmp_path):
    folder = tmp_path / "meta-llama" / "Llama-2-7b-hf"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(KNOWN_CONFIGS["Qwen/Qwen2.5-0.5B"]))
    assert shape_of(str(folder)).params == 494_032_768


@pytest.mark.parametrize("write, needle", [
    (None, "is a folder without config.json"),
    ('{"model_type": "t5"}', "is a 't5' model, which the planner cannot size"),
    ('{"model_type": "llama"}', "without a usable 'hidden_size' entry"),
])
def test_folders_that_cannot_be_sized(tmp_path, write, needle):
    if write is not None:
        (tmp_path / "config.json").write_text(write)
    with pytest.raises(ConfigError, match=needle) as info:
        shape_of(str(tmp_path), "critic.path")
    assert str(info.value).startswith(f"critic.path: '{tmp_path}'")


def test_unknown_hub_names_are_reported_at_their_field_with_the_known_names():
    found = problems(None, "model.path=acme/secret-7b")
    unknown = find(found, "model.path = 'acme/secret-7b'", "neither a local model folder nor a hub model",
                   "give a local model folder", "meta-llama/Llama-2-7b-hf", "Qwen/Qwen2.5-72B")
    assert "builtin" not in unknown.partition("fix:")[0]
    found = problems("ppo-7b", "reward.sources=[{rule: task}, {model: acme/rm}]", "critic.path=acme/critic")
    find(found, "reward.sources[1].model = 'acme/rm'", "neither a local model folder")
    find(found, "critic.path = 'acme/critic'", "neither a local model folder")
    find(problems(None, "reference.path=acme/ref"), "reference.path = 'acme/ref'")
    find(problems(None, "model.path=builtin:tiny-t5"), "model.path = 'builtin:tiny-t5'", "unknown tiny model family")
