"""Tests of the typed-config loader: layering, type checks, error messages, YAML round trips."""

from __future__ import annotations  # the loader must resolve string annotations

import dataclasses
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcrlhf.config import apply_overrides, describe, field_docs, from_dict, load_config, to_dict, to_yaml
from hpcrlhf.config.loader import NonEmpty
from hpcrlhf.config.recipe_yaml import quoted
from hpcrlhf.errors import ConfigError


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 1e-4
    """Peak learning rate."""
    lr_scheduler: Literal["constant", "cosine", "linear"] = "cosine"
    """Learning-rate schedule
    after warm-up."""
    steps: int = 100
    """Optimizer steps."""
    warmup: int = 0
    """Warm-up steps."""
    betas: tuple[float, ...] = (0.9, 0.95)
    """AdamW betas."""
    clip: float | None = 1.0
    """Gradient clipping (null: off)."""
    bf16: bool = True
    """Train in bf16."""

    def __post_init__(self) -> None:
        if self.warmup > self.steps:
            raise ConfigError(f"warmup ({self.warmup}) must not exceed steps ({self.steps})")


@dataclass(frozen=True)
class DataConfig:
    path: str | None = None
    """Training file."""
    tags: list[str] = field(default_factory=lambda: ["base"])
    """Free-form tags."""
    shape: tuple[int, str] = (2, "x")
    """A fixed-length pair."""
    eval_path: Annotated[str, NonEmpty()] | None = None
    """Held-out file (a path: never empty)."""


@dataclass(frozen=True)
class RewardConfig:
    weight: float = 1.0
    """Weight of this reward."""
    kind: Literal["rule", "model"] = "rule"
    """Where the score comes from."""


@dataclass(frozen=True)
class EngineConfig:
    zero_stage: Literal[0, 1, 2, 3] = 0
    """ZeRO stage."""
    env: dict[str, str] = field(default_factory=lambda: {"A": "1"})
    """Environment variables."""
    rewards: dict[str, RewardConfig] = field(default_factory=lambda: {"math": RewardConfig()})
    """Rewards by name."""
    extra: Any = None
    """Anything at all."""
    size: int | str = 1
    """An int or a name."""


@dataclass(frozen=True)
class ModelConfig:
    name: str = "tiny"
    """Model name."""
    layers: int | None = None
    """Layer count (null: the model's own)."""


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    """LoRA rank."""


@dataclass(frozen=True)
class JobConfig:
    data: DataConfig = field(default_factory=DataConfig)
    """Data settings."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Engine settings."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model settings."""
    seed: int = 0
    """Global random seed."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimizer settings."""
    lora: LoraConfig | None = None
    """LoRA adapters (null: full fine-tuning)."""


VALID_TOP = "valid keys: data, engine, lora, model, seed, train"


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def error_of(*args: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(JobConfig, *args, **kwargs)
    return str(info.value)


# ---------------------------------------------------------------- layering
def test_defaults() -> None:
    assert load_config(JobConfig) == JobConfig()


def test_partial_nested_file(tmp_path: Path) -> None:
    path = write(tmp_path, """
        seed: 7
        train:
          lr: 0.001
        """)
    cfg = load_config(JobConfig, path)
    assert cfg.seed == 7 and cfg.train.lr == 0.001
    assert cfg.train.steps == 100 and cfg.model == ModelConfig()


def test_empty_file_is_defaults(tmp_path: Path) -> None:
    assert load_config(JobConfig, write(tmp_path, "# only a comment\n")) == JobConfig()


def test_precedence_defaults_file_data_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "train: {lr: 0.1, steps: 5}\nseed: 1\nmodel: {name: file}\n")
    cfg = load_config(JobConfig, path, ["train.lr=0.3"], data={"train": {"lr": 0.2}, "seed": 2})
    assert (cfg.train.lr, cfg.train.steps, cfg.seed, cfg.model.name) == (0.3, 5, 2, "file")
    assert load_config(JobConfig, overrides=["seed=1", "seed=2"]).seed == 2  # in order


def test_post_init_sees_final_values(tmp_path: Path) -> None:
    # warmup=200 alone breaks warmup <= steps; the override fixes it before anything is built.
    path = write(tmp_path, "train:\n  warmup: 200\n")
    cfg = load_config(JobConfig, path, ["train.steps=300"])
    assert (cfg.train.warmup, cfg.train.steps) == (200, 300)


def test_apply_overrides_returns_new_instance() -> None:
    cfg = JobConfig()
    new = apply_overrides(cfg, ["train.lr=3e-4", "model.layers=4"])
    assert new.train.lr == 3e-4 and new.model.layers == 4
    assert cfg == JobConfig()
    assert apply_overrides(new, "seed=3").seed == 3  # one string is one override
    assert apply_overrides(new, "seed=3").train.lr == 3e-4


def test_frozen() -> None:
    cfg = load_config(JobConfig, overrides=["seed=1"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.lr = 2.0  # type: ignore[misc]


def test_defaults_not_mutated_between_loads() -> None:
    first = load_config(JobConfig, overrides=["engine.env.B=two", "data.tags=[x]", "engine.rewards.math.weight=3"])
    assert first.engine.env == {"A": "1", "B": "two"}
    assert first.engine.rewards["math"].weight == 3.0
    again = load_config(JobConfig)
    assert again == JobConfig()
    assert again.engine.env == {"A": "1"} and again.data.tags == ["base"]


# ---------------------------------------------------------------- types
def test_scalar_types() -> None:
    cfg = from_dict(JobConfig, {"train": {"lr": 1, "steps": 5.0, "bf16": False, "clip": None},
                                "model": {"name": "big", "layers": 12}})
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 5 and isinstance(cfg.train.steps, int)
    assert cfg.train.bf16 is False and cfg.train.clip is None and cfg.model.layers == 12


def test_overrides_parse_yaml_values() -> None:
    cfg = load_config(JobConfig, overrides=[
        "train.lr=3e-4",        # YAML 1.1 gives the string '3e-4'; float fields accept it
        "train.clip=null",
        "train.betas=[0.8, 0.9]",
        "data.path=",           # a bare empty value is the empty string
        "engine.extra={a: [1, 2]}",
        "engine.zero_stage=3",
    ])
    assert cfg.train.lr == 3e-4 and cfg.train.clip is None
    assert cfg.train.betas == (0.8, 0.9) and isinstance(cfg.train.betas, tuple)
    assert cfg.data.path == "" and cfg.engine.extra == {"a": [1, 2]} and cfg.engine.zero_stage == 3


def test_sequences() -> None:
    cfg = from_dict(JobConfig, {"data": {"tags": ("a", "b"), "shape": [3, "y"]}, "train": {"betas": [1, 2]}})
    assert cfg.data.tags == ["a", "b"] and isinstance(cfg.data.tags, list)
    assert cfg.data.shape == (3, "y") and cfg.train.betas == (1.0, 2.0)


def test_dicts_replace_from_mapping_update_from_override() -> None:
    cfg = from_dict(JobConfig, {"engine": {"env": {"B": "2"}, "rewards": {"code": {"kind": "model"}}}})
    assert cfg.engine.env == {"B": "2"}
    assert cfg.engine.rewards == {"code": RewardConfig(kind="model")}
    updated = apply_overrides(cfg, ["engine.env.C=x", "engine.rewards.code.weight=0.5"])
    assert updated.engine.env == {"B": "2", "C": "x"}
    assert updated.engine.rewards == {"code": RewardConfig(weight=0.5, kind="model")}


def test_union_any_and_optional_section() -> None:
    assert from_dict(JobConfig, {"engine": {"size": "big"}}).engine.size == "big"
    assert from_dict(JobConfig, {"engine": {"size": 4}}).engine.size == 4
    assert from_dict(JobConfig, {"engine": {"extra": object}}).engine.extra is object
    assert from_dict(JobConfig, {"lora": {}}).lora == LoraConfig()
    assert load_config(JobConfig, overrides=["lora.rank=4"]).lora == LoraConfig(rank=4)
    assert from_dict(JobConfig, {"lora": LoraConfig(rank=2)}).lora == LoraConfig(rank=2)
    merged = load_config(JobConfig, overrides=["model.layers=3"], data={"model": ModelConfig(name="given")})
    assert merged.model == ModelConfig(name="given", layers=3)


@pytest.mark.parametrize(("override", "message"), [
    ("train.bf16=1", "train.bf16: expected a boolean (true or false), got 1 (int)"),
    ("train.bf16=maybe", "train.bf16: expected a boolean (true or false), got 'maybe' (str)"),
    ("train.steps=true", "train.steps: expected an int, got true (bool)"),
    ("train.steps=2.5", "train.steps: expected an int, got 2.5 (float)"),
    ("train.lr='0.001'", "train.lr: expected a float, got '0.001' (str); remove the quotes"),
    ('train.lr="1e-4"', "train.lr: expected a float, got '1e-4' (str); remove the quotes"),
    ("train.steps=1:30", "train.steps: 1:30 is YAML 1.1's base-60 notation for 90; write the number in decimal, "
                         "or quote it if you mean text"),
    ("train.lr=1:30.5", "train.lr: 1:30.5 is YAML 1.1's base-60 notation for 90.5; write the number in decimal, "
                        "or quote it if you mean text"),
    ("train.lr=0x10", "train.lr: 0x10 is YAML 1.1's hexadecimal notation for 16; write the number in decimal, or "
                      "quote it if you mean text"),
    ("train.steps=-010", "train.steps: -010 is YAML 1.1's octal notation for -8; write the number in decimal, or "
                         "quote it if you mean text"),
    ("train.steps=0b101", "train.steps: 0b101 is YAML 1.1's binary notation for 5; write the number in decimal, or "
                          "quote it if you mean text"),
    ("model.name=2:00:00", "model.name: 2:00:00 is YAML 1.1's base-60 notation for 7200; write the number in "
                           "decimal, or quote it if you mean text"),
    ("train.steps='12'", "train.steps: expected an int, got '12' (str); remove the quotes"),
    ("train.steps=null", "train.steps: expected an int, got null"),
    ("train.lr=true", "train.lr: expected a float, got true (bool)"),
    ("train.lr=abc", "train.lr: expected a float, got 'abc' (str)"),
    ("model.name=3", "model.name: expected a string, got 3 (int); quote it"),
    ("model.name=[a]", "model.name: expected a string, got ['a'] (list)"),
    ("train.betas=0.9", "train.betas: expected a list, got 0.9 (float)"),
    ("train.betas=[0.9, x]", "train.betas[1]: expected a float, got 'x' (str)"),
    ("data.shape=[1]", "data.shape: expected a list of 2 items, got [1] (list)"),
    ("engine.env=[1]", "engine.env: expected a mapping, got [1] (list)"),
    ("engine.env.B=2", "engine.env.B: expected a string, got 2 (int); quote it"),
    ("engine.zero_stage=4", "engine.zero_stage: 4 is not one of 0, 1, 2, 3"),
    ("engine.zero_stage='1'", "engine.zero_stage: '1' is not one of 0, 1, 2, 3 (did you mean 1?)"),
    ("engine.size=[1]", "engine.size: expected an int or a string, got [1] (list)"),
    ("model.layers=x", "model.layers: expected an int, got 'x' (str)"),
    ("train=3", "train: expected a mapping (section), got 3 (int)"),
    ("lora=3", "lora: expected a mapping (section), got 3 (int)"),
])
def test_type_errors_in_overrides(override: str, message: str) -> None:
    assert error_of(overrides=[override]) == f"--set {override}: {message}"


# ---------------------------------------------------------------- file errors, with line numbers
def test_wrong_type_in_file_names_file_line_key_and_value(tmp_path: Path) -> None:
    path = write(tmp_path, """
        seed: 1

        train:
          steps: 10
          lr: fast
        """)
    assert error_of(path) == f"{path}:5: train.lr: expected a float, got 'fast' (str)"


def test_literal_in_file_with_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  lr_scheduler: cosin\n")
    assert error_of(path) == (f"{path}:2: train.lr_scheduler: 'cosin' is not one of 'constant', 'cosine', "
                              f"'linear' (did you mean 'cosine'?)")


def test_unknown_top_level_key(tmp_path: Path) -> None:
    path = write(tmp_path, "seed: 1\n\n# comment\ntrian:\n  lr: 0.1\n")
    assert error_of(path) == f"{path}:4: unknown key 'trian' in the top level; {VALID_TOP} (did you mean 'train'?)"


def test_unknown_nested_key(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  lr: 0.1\n  lrr: 0.2\n")
    message = error_of(path)
    assert message.startswith(f"{path}:3: unknown key 'lrr' in section 'train'; valid keys: betas, bf16, clip, ")
    assert message.endswith("(did you mean 'lr'?)")


def test_unknown_key_without_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "zzzzzz: 1\n")
    assert error_of(path) == f"{path}:1: unknown key 'zzzzzz' in the top level; {VALID_TOP}"


def test_section_given_a_scalar(tmp_path: Path) -> None:
    path = write(tmp_path, "seed: 1\ntrain: 3\n")
    assert error_of(path) == f"{path}:2: train: expected a mapping (section), got 3 (int)"


def test_null_for_non_optional(tmp_path: Path) -> None:
    path = write(tmp_path, "seed: null\n")
    assert error_of(path) == f"{path}:1: seed: expected an int, got null"


def test_bad_list_item_has_its_own_line(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  betas:\n    - 0.9\n    - high\n")
    assert error_of(path) == f"{path}:4: train.betas[1]: expected a float, got 'high' (str)"


def test_flow_mapping_line(tmp_path: Path) -> None:
    path = write(tmp_path, "seed: 1\nmodel: {name: tiny, layers: many}\n")
    assert error_of(path) == f"{path}:2: model.layers: expected an int, got 'many' (str)"


def test_post_init_error_gets_location(tmp_path: Path) -> None:
    path = write(tmp_path, "seed: 1\ntrain:\n  warmup: 200\n")
    assert error_of(path) == f"{path}:2: train: warmup (200) must not exceed steps (100)"
    assert error_of(overrides=["train.warmup=500"]) == (
        "--set train.warmup=500: train: warmup (500) must not exceed steps (100)")
    with pytest.raises(ConfigError, match=r"^<dict>: train: warmup"):
        from_dict(JobConfig, {"train": {"warmup": 200}})


def test_missing_file(tmp_path: Path) -> None:
    assert error_of(tmp_path / "x.yaml") == f"recipe file '{tmp_path / 'x.yaml'}' does not exist"


def test_directory(tmp_path: Path) -> None:
    assert "is a directory" in error_of(tmp_path)


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "seed: 1\n")

    def deny(*args: Any, **kwargs: Any) -> str:  # chmod is no use when tests run as root
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "open", deny)
    assert error_of(path) == f"cannot read recipe file '{path}': Permission denied"


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_bytes(b"seed: \xff\n")
    assert error_of(path).startswith(f"{path}: recipe file is not UTF-8 text")


def test_invalid_yaml_has_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "seed: 1\ntrain:\n  lr: [0.1\n")
    message = error_of(path)
    assert message.startswith(f"{path}:4:1: invalid YAML: ")
    path = write(tmp_path, "seed: 1\n  bad: 2\n", name="indent.yaml")
    assert error_of(path).startswith(f"{path}:2:6: invalid YAML: mapping values are not allowed here")


def test_top_level_not_a_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "# a list\n- 1\n- 2\n")
    assert error_of(path) == (f"{path}:2: the top level of a recipe must be a mapping of keys to values, "
                              f"got [1, 2] (list)")
    with pytest.raises(ConfigError, match=r"^<data>: the top level must be a mapping"):
        load_config(JobConfig, data=[1])  # type: ignore[arg-type]


def test_duplicate_keys_name_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  lr: 0.1\n  steps: 3\n  lr: 0.2\n")
    assert error_of(path) == (f"{path}:4: duplicate key 'lr' (first at line 2); "
                              f"YAML would silently keep only the last value")
    path = write(tmp_path, "seed: 1\nseed: 2\n", name="top.yaml")
    assert "top.yaml:2: duplicate key 'seed' (first at line 1)" in error_of(path)


def test_same_key_in_different_mappings_and_merge_keys_are_fine(tmp_path: Path) -> None:
    path = write(tmp_path, """
        model: &base {name: a}
        data:
          path: p
        engine:
          rewards:
            math: {weight: 2.0}
            code: {weight: 3.0}
        """)
    cfg = load_config(JobConfig, path)
    assert cfg.engine.rewards["code"].weight == 3.0 and cfg.model.name == "a"
    path = write(tmp_path, "engine:\n  extra:\n    base: &b {x: 1, y: 2}\n    more:\n      <<: *b\n      x: 3\n",
                 name="merge.yaml")
    assert load_config(JobConfig, path).engine.extra["more"] == {"x": 3, "y": 2}


# ---------------------------------------------------------------- override syntax
@pytest.mark.parametrize("bad", ["seed", "=3", "train..lr=1", ".seed=1", "train.=1"])
def test_malformed_override(bad: str) -> None:
    message = error_of(overrides=[bad])
    assert message.startswith(f"--set {bad}: ") and "--set section.key=value" in message


def test_override_into_unknown_key() -> None:
    assert error_of(overrides=["trian.lr=1"]) == (
        f"--set trian.lr=1: unknown key 'trian' in the top level; {VALID_TOP} (did you mean 'train'?)")
    message = error_of(overrides=["train.lrr=1"])
    assert message.startswith("--set train.lrr=1: unknown key 'lrr' in section 'train'; valid keys: betas, bf16, ")
    assert message.endswith("(did you mean 'lr'?)")


@pytest.mark.parametrize("override, field, value", [
    ("train.lr=1e-4", "lr", 1e-4), ("train.lr=3E5", "lr", 3e5), ("train.lr=1.0e5", "lr", 1e5),
    ("train.lr=.5e-3", "lr", 5e-4),
    ("train.steps=1e6", "steps", 1_000_000), ("train.steps=1_000", "steps", 1000), ("train.steps=0", "steps", 0),
    ("train.warmup=-0", "warmup", 0)])
def test_numbers_read_as_a_person_writes_them(override: str, field: str, value: Any) -> None:
    """YAML 1.1 reads `1e-4` (no dot) and `1.0e5` (no exponent sign) as text; here they are numbers."""
    got = getattr(load_config(JobConfig, overrides=[override]).train, field)
    assert got == value and type(got) is type(value)


def test_yaml_1_1_number_forms_in_a_recipe_are_refused_by_line(tmp_path: Path) -> None:
    assert error_of(write(tmp_path, """
        train:
          steps: 1:30
        """)) == (f"{tmp_path / 'recipe.yaml'}:2:10: train.steps: 1:30 is YAML 1.1's base-60 notation for 90; write "
                  "the number in decimal, or quote it if you mean text")
    assert error_of(write(tmp_path, """
        seed: 1
        train: {lr: "0.001"}
        """)) == f"{tmp_path / 'recipe.yaml'}:2: train.lr: expected a float, got '0.001' (str); remove the quotes"
    quoted_text = load_config(JobConfig, write(tmp_path, """
        model: {name: "1:30"}
        data: {path: '0x10'}
        """))
    assert (quoted_text.model.name, quoted_text.data.path) == ("1:30", "0x10")  # quoted: text, as written


def test_to_yaml_quotes_text_the_loader_would_read_as_a_number(tmp_path: Path) -> None:
    cfg = load_config(JobConfig, overrides=["model.name='1e5'", "data.path='1:30'", "engine.env.B='0x1f'"])
    assert load_config(JobConfig, write(tmp_path, to_yaml(cfg))) == cfg


@pytest.mark.parametrize("text", ["2024-01-01", '"x"', "'x'", "runs/a #1", "a: b", "- a", "~", "null", "true", "1e5",
                                  "0x10", "1:30", "*a", "&a b", "!tag x", "%x", "[a]", "{a: 1}", "a\\b", "a\tb",
                                  "a\nb", " lead", "trail ", "é/😀", "x" * 300])
def test_quoted_text_reads_back_as_written(text: str) -> None:
    """What `-o DIR` becomes: a folder argument is a path, taken literally."""
    assert load_config(JobConfig, overrides=[f"model.name={quoted(text)}"]).model.name == text


@pytest.mark.parametrize("value", ["", " ", "''", '"  "'])
def test_an_empty_path_is_refused_where_it_is_set(tmp_path: Path, value: str) -> None:
    """An unset shell variable (`--set data.eval_path=$EVAL`) is no path; null is how to unset one."""
    shown = repr(yaml.safe_load(value) if value.strip() else "")
    assert error_of(overrides=[f"data.eval_path={value}"]) == (
        f"--set data.eval_path={value}: data.eval_path: {shown} is an empty path (an unset shell variable?): give "
        "the file or folder, or leave the setting out for its default")
    in_file = value if value.strip() else "''"  # a bare `key:` in a file is null
    assert error_of(write(tmp_path, f"data:\n  eval_path: {in_file}\n")).startswith(
        f"{tmp_path / 'recipe.yaml'}:2: data.eval_path: {shown} is an empty path")
    assert load_config(JobConfig, overrides=["data.eval_path=null"]).data.eval_path is None
    assert load_config(JobConfig, overrides=["data.eval_path=held out.jsonl"]).data.eval_path == "held out.jsonl"


def test_override_with_invalid_yaml_value() -> None:
    assert error_of(overrides=["seed=[1"]).startswith("--set seed=[1: seed: the value is not valid YAML")


# ---------------------------------------------------------------- output: dicts, YAML, docs
def test_to_dict_is_plain_python() -> None:
    plain = to_dict(JobConfig())
    assert plain["train"]["betas"] == [0.9, 0.95] and plain["engine"]["rewards"] == {"math": {"weight": 1.0, "kind": "rule"}}
    assert plain["lora"] is None
    with pytest.raises(TypeError):
        to_dict(JobConfig)


@pytest.mark.parametrize("overrides", [
    [],
    ["train.lr=1e-10", "seed=-3", "data.path='1e-4'", "data.tags=['yes', '3', '']", "lora.rank=2",
     "engine.env={}", "engine.rewards={}", "engine.extra={a: [1, {b: null}]}", "model.name='multi\nline'",
     "engine.size=name", "train.clip=null"],
])
def test_to_yaml_round_trip(overrides: list[str]) -> None:
    cfg = load_config(JobConfig, overrides=overrides)
    assert load_config(JobConfig, data=yaml.safe_load(to_yaml(cfg))) == cfg


def test_field_docs() -> None:
    docs = field_docs(TrainConfig)
    assert docs["lr"] == "Peak learning rate."
    assert docs["lr_scheduler"] == "Learning-rate schedule\nafter warm-up."
    assert set(docs) == {f.name for f in dataclasses.fields(TrainConfig)}
    made = dataclasses.make_dataclass("Made", [("x", int, 1)], frozen=True)
    assert field_docs(made) == {}


def test_describe_has_docs_and_loads_back_to_defaults() -> None:
    text = describe(JobConfig)
    assert "# Peak learning rate.\n  lr: 0.0001\n" in text
    assert "  # Learning-rate schedule\n  # after warm-up.\n  lr_scheduler: cosine\n" in text
    assert "# Optimizer settings.\ntrain:\n" in text
    assert "      weight: 1.0" in text  # dict of sections, nested deeper
    assert load_config(JobConfig, data=yaml.safe_load(text)) == JobConfig()
    cfg = load_config(JobConfig, overrides=["seed=5", "model.name=big"])
    assert load_config(JobConfig, data=yaml.safe_load(describe(cfg))) == cfg


# ---------------------------------------------------------------- junk never escapes as another error
FIELD_NAMES = sorted({f.name for cls in (JobConfig, TrainConfig, DataConfig, EngineConfig, ModelConfig,
                                         RewardConfig, LoraConfig) for f in dataclasses.fields(cls)} | {"math"})
KEYS = st.sampled_from(FIELD_NAMES) | st.text(max_size=6) | st.integers(-3, 3)
SCALARS = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
           | st.sampled_from(["cosine", "1e-4", "rule", "-1", "3.5"]))
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=4),
                    max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(KEYS, JUNK, max_size=6))
def test_junk_either_loads_or_raises_config_error(mapping: dict[Any, Any]) -> None:
    try:
        cfg = from_dict(JobConfig, mapping)
    except ConfigError as err:
        assert str(err).startswith("<dict>")
    else:
        assert isinstance(cfg, JobConfig)
