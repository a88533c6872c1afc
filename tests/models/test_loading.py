"""Damaged model folders are named before transformers sees them: a model.safetensors cut short or
empty, a config.json that is not JSON, no tokenizer files, a shard an index names but lacks. Each
fails with the config field, the folder, what is wrong and the fix (exit 2 at the CLI, no traceback)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hpcrlhf.models.loading import (ModelPathError, check_model_source, check_tokenizer_files, check_weight_files,
                                    load_causal_lm, load_tokenizer)
from tests.launch_helpers import run_cli

RESTORE = "restore the folder from where the model came from"


def damage(folder: Path, kind: str) -> None:
    weights = folder / "model.safetensors"
    if kind == "truncated-header":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif kind == "truncated-data":
        weights.write_bytes(weights.read_bytes()[:-1000])
    elif kind == "empty-weights":
        weights.write_bytes(b"")
    elif kind == "config-not-json":
        (folder / "config.json").write_text('{"model_type": "llama",\n  "hidden_size": 128,,\n}')
    elif kind == "no-tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (folder / name).unlink(missing_ok=True)
    else:
        raise ValueError(kind)


EXPECTED = {
    "truncated-header": "has a damaged model.safetensors: it is cut short: 1,000 bytes, but its header alone takes",
    "truncated-data": "has a damaged model.safetensors: it is cut short: ",
    "empty-weights": "has a damaged model.safetensors: it is empty; " + RESTORE,
    "config-not-json": "has a config.json that is not valid JSON (line 2 column 22: Expecting property name",
    "no-tokenizer": "has no tokenizer files (none of tokenizer.json, tokenizer_config.json",
}


@pytest.fixture
def model_copy(tiny_llama, tmp_path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    return folder


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_damage_is_named_with_its_field(model_copy, kind):
    damage(model_copy, kind)
    with pytest.raises(ModelPathError) as caught:
        check_model_source(str(model_copy), "critic.path")
        check_tokenizer_files(str(model_copy), "critic.path")
        check_weight_files(str(model_copy), "critic.path")
    message = str(caught.value)
    assert message.startswith(f"critic.path: '{model_copy}' ") and EXPECTED[kind] in message, message
    assert caught.value.key == "critic.path" and caught.value.fix


def test_an_intact_folder_passes_and_loads(model_copy):
    check_model_source(str(model_copy))
    check_tokenizer_files(str(model_copy))
    check_weight_files(str(model_copy))
    assert load_tokenizer(str(model_copy)).pad_token_id is not None
    assert load_causal_lm(str(model_copy)).config.model_type == "llama"


def test_sharded_weights_are_checked_shard_by_shard(model_copy):
    """An index naming two shards: a missing one and one cut short are both named."""
    (model_copy / "model.safetensors").rename(model_copy / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelPathError, match="lacks model-00002-of-00002.safetensors, named by its "
                                             "model.safetensors.index.json"):
        check_weight_files(str(model_copy))
    shard = model_copy / "model-00001-of-00002.safetensors"
    shutil.copy(shard, model_copy / "model-00002-of-00002.safetensors")
    check_weight_files(str(model_copy))
    shard.write_bytes(shard.read_bytes()[:5000])
    with pytest.raises(ModelPathError, match="has a damaged model-00001-of-00002.safetensors: it is cut short"):
        check_weight_files(str(model_copy))


def test_a_file_or_a_missing_path_is_no_model(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelPathError, match=r"model.path: '.*weights.bin' is a file, not a model folder"):
        check_model_source(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelPathError, match=r"model.path: '/nonexistent/model' does not exist; give a model folder"):
        check_model_source("/nonexistent/model")


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_cli_damaged_model_folder_exits_2_naming_it(model_copy, tmp_path, kind):
    damage(model_copy, kind)
    proc = run_cli(["train", "sft", "-o", str(tmp_path / "run"), "--set", f"model.path={model_copy}",
                    "--set", "train.max_steps=1"], check=False, timeout=180)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"hpcrlhf: error: model.path: '{model_copy}' " in proc.stderr and EXPECTED[kind] in proc.stderr, \
        proc.stderr[-2000:]
