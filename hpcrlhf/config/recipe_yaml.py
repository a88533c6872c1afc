"""Recipes as YAML: reading a recipe file or a `--set` value, and writing configs back.

* Every failure is a `ConfigError` or a YAML error with its position (`recipe.yaml:3:5`), never a
  traceback: a tag whose text does not fit (`!!float abc`), a control character, a recipe nested
  too deeply, a file that is no regular file or pipe, or larger than `MAX_RECIPE_BYTES`.
* A recipe's mappings and lists remember the line of every key and item (`key_lines`,
  `value_lines`, `lines`), so that `hpcrlhf.config.loader` names the line of a bad value; a key
  written twice is refused (plain YAML keeps the last one).
* Numbers are read as a person writes them, not as YAML 1.1 does: ``1e-4`` is a float (YAML 1.1
  reads it as text: its float pattern needs a dot and a signed exponent), and YAML 1.1's other
  number forms -- base 60 (``1:30`` is 90), hexadecimal (``0x10``), octal (``010`` is 8) and
  binary (``0b11``) -- are refused, with the decimal value they would have read as. `Dumper`
  writes what `SafeLoader` reads back the same (`quoted`, `hpcrlhf.config.loader.to_yaml`).
"""

from __future__ import annotations

import math
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from hpcrlhf.config.messages import clip, dotted, show
from hpcrlhf.errors import ConfigError

# Floats YAML 1.1 leaves as text: an exponent without a dot (`1e-4`, `3E5`) or without a sign (`1.0e5`).
_EXPONENT_FLOAT = re.compile(r"[-+]?([0-9][0-9_]*\.?[0-9_]*|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$")


class _LineDict(dict):
    """A YAML mapping that remembers the line of each key and of each value."""

    key_lines: dict[Any, int]
    value_lines: dict[Any, int]


class _LineList(list):
    """A YAML sequence that remembers the line of each item."""

    lines: list[int]


class _TagError(yaml.constructor.ConstructorError):
    """A tagged scalar PyYAML cannot build (`!!float abc`), with the key path it sits under."""

    def __init__(self, problem: str, mark: yaml.Mark, key_path: tuple[Any, ...]):
        super().__init__(None, None, problem, mark)
        self.key_path = key_path


class NumberFormError(_TagError):
    """A number written in a YAML 1.1 form no one means in a config (`1:30`, `0x10`): valid YAML, refused."""


class SafeLoader(yaml.SafeLoader):
    """SafeLoader whose failures are all YAML errors with a position.

    PyYAML's constructors raise plain ValueError, KeyError, IndexError or AttributeError for a
    tag whose text does not fit it (`!!float abc`, `!!bool maybe`, `!!timestamp x`); those would
    escape as tracebacks. Sequences and mappings are built eagerly, so a self-referencing anchor
    (`&a [*a]`) is refused here instead of looping forever in the checks that print it.
    """

    def __init__(self, stream: Any):
        super().__init__(stream)
        self.key_path: list[Any] = []  # keys (and list indices) above the node being built

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (yaml.YAMLError, ConfigError, RecursionError):
            raise
        except Exception as err:  # noqa: BLE001 - any constructor failure is the text's fault
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            text = clip(repr(node.value)) if isinstance(node, yaml.ScalarNode) else f"this {node.id}"
            detail = f" ({clip(str(err))})" if type(err) is ValueError else ""  # others say only PyYAML internals
            raise _TagError(f"cannot read {text} as {tag}{detail}; remove the tag or fix the value",
                            node.start_mark, tuple(self.key_path)) from None

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = self.construct_scalar(node)
        digits = text.replace("_", "").lstrip("+-")
        kind = ("binary" if digits.startswith("0b") else "hexadecimal" if digits.startswith("0x")
                else "octal" if digits.startswith("0") and digits != "0" else "base-60" if ":" in digits else None)
        return self._decimal_only(node, text, kind, super().construct_yaml_int(node))

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        text = self.construct_scalar(node)
        return self._decimal_only(node, text, "base-60" if ":" in text else None, super().construct_yaml_float(node))

    def _decimal_only(self, node: yaml.ScalarNode, text: str, kind: str | None, value: Any) -> Any:
        """`value`, unless `text` is one of YAML 1.1's number forms no one means in a config: base 60
        (`1:30` is 90, `2:00:00` is 7200), hexadecimal, octal (`010` is 8) or binary."""
        if kind is None:
            return value
        raise NumberFormError(f"{text} is YAML 1.1's {kind} notation for {value}; write the number in decimal, or "
                              "quote it if you mean text", node.start_mark, tuple(self.key_path))

    def construct_eager_list(self, node: yaml.SequenceNode) -> list[Any]:
        return self.construct_sequence(node, deep=True)

    def construct_eager_map(self, node: yaml.MappingNode) -> dict[Any, Any]:
        return self.construct_mapping(node, deep=True)


SafeLoader.add_constructor("tag:yaml.org,2002:seq", SafeLoader.construct_eager_list)
SafeLoader.add_constructor("tag:yaml.org,2002:map", SafeLoader.construct_eager_map)
SafeLoader.add_constructor("tag:yaml.org,2002:int", SafeLoader.construct_yaml_int)
SafeLoader.add_constructor("tag:yaml.org,2002:float", SafeLoader.construct_yaml_float)
SafeLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+.0123456789"))


class Dumper(yaml.SafeDumper):
    """Writes YAML that `SafeLoader` reads back the same: text it would read as a float (`1e-4`) is quoted."""


Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+.0123456789"))


class _Loader(SafeLoader):
    """A `SafeLoader` that records lines and rejects duplicate keys (plain YAML keeps the last one)."""

    source = "<yaml>"

    def construct_line_map(self, node: yaml.MappingNode) -> Iterable[_LineDict]:
        data = _LineDict()
        data.key_lines, data.value_lines = {}, {}
        yield data  # PyYAML's protocol for containers: hand out the object, then fill it
        first: dict[Any, int] = {}
        for key_node, _ in node.value:  # before `<<` merge keys are flattened in: those may repeat
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                hash(key)
            except TypeError:
                raise ConfigError(f"{self.source}:{line}: a key must be a plain value, got {show(key)}") from None
            if key in first:
                raise ConfigError(f"{self.source}:{line}: duplicate key {key!r} (first at line {first[key]}); "
                                  f"YAML would silently keep only the last value")
            first[key] = line
        self.flatten_mapping(node)
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            self.key_path.append(key)
            data[key] = self.construct_object(value_node, deep=True)
            self.key_path.pop()
            data.key_lines[key] = key_node.start_mark.line + 1
            # A block mapping or list starts on the line after its key; the key's line reads better.
            value_mark = value_node if isinstance(value_node, yaml.ScalarNode) else key_node
            data.value_lines[key] = value_mark.start_mark.line + 1

    def construct_line_list(self, node: yaml.SequenceNode) -> Iterable[_LineList]:
        data = _LineList()
        data.lines = [item.start_mark.line + 1 for item in node.value]
        yield data
        for i, item in enumerate(node.value):
            self.key_path.append(i)
            data.append(self.construct_object(item, deep=True))
            self.key_path.pop()


_Loader.add_constructor("tag:yaml.org,2002:map", _Loader.construct_line_map)
_Loader.add_constructor("tag:yaml.org,2002:seq", _Loader.construct_line_list)


def yaml_problem(err: yaml.YAMLError) -> str:
    """The parser's own words, and where it was: `recipe.yaml:3:5: invalid YAML: ...`."""
    if isinstance(err, yaml.reader.ReaderError):  # its str() names "<unicode string>", not the file
        char = f"#x{err.character:04x}" if isinstance(err.character, int) else repr(err.character)
        return f"unacceptable character {char}: {err.reason}; remove it"
    if not isinstance(err, yaml.MarkedYAMLError):
        return str(err)
    return f"{err.problem} ({err.context})" if err.context else str(err.problem)


def _reader_where(name: str, text: str, err: yaml.reader.ReaderError) -> str:
    """`recipe.yaml:LINE:COLUMN` of the character the YAML reader refused."""
    line, start = text.count("\n", 0, err.position) + 1, text.rfind("\n", 0, err.position) + 1
    return f"{name}:{line}:{err.position - start + 1}"


MAX_RECIPE_BYTES = 1 << 20
"""The largest recipe read (1 MiB; the shipped ones are about 1 KB): a recipe is read whole before it is
parsed, and `--config /dev/zero` (or a data file given by mistake) would fill the memory first."""


def _recipe_text(name: str, file: Path) -> str:
    """The text of recipe `file`: a regular file, or a pipe (`--config <(...)`), of at most
    MAX_RECIPE_BYTES of UTF-8. A directory, a device or a socket is refused by what it is."""
    if not file.exists():
        raise ConfigError(f"recipe file {name!r} does not exist")
    if file.is_dir():
        raise ConfigError(f"recipe file {name!r} is a directory, not a YAML file")
    mode = file.stat().st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        kind = "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else "a socket"
        raise ConfigError(f"recipe file {name!r} is {kind}, not a YAML file: give the recipe's file")
    limit = (f"more than the {MAX_RECIPE_BYTES >> 20} MiB a recipe may have (a recipe is a few KB of settings): is it "
             "the right file?")
    if stat.S_ISREG(mode) and file.stat().st_size > MAX_RECIPE_BYTES:
        raise ConfigError(f"recipe file {name!r} is {file.stat().st_size:,} bytes, {limit}")
    try:
        with file.open("rb") as f:
            data = f.read(MAX_RECIPE_BYTES + 1)  # a regular file may grow, a pipe has no size
    except OSError as err:
        raise ConfigError(f"cannot read recipe file {name!r}: {err.strerror or err}") from None
    if len(data) > MAX_RECIPE_BYTES:
        raise ConfigError(f"recipe file {name!r} gives {limit}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{name}: recipe file is not UTF-8 text (byte {err.start})") from None


def read_recipe(path: str | Path) -> Mapping[str, Any]:
    name = str(path)
    text = _recipe_text(name, Path(path))
    loader = None
    try:
        loader = _Loader(text)  # its reader already rejects control characters such as NUL
        loader.source = name
        node = loader.get_single_node()
        data = None if node is None else loader.construct_document(node)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark else name
        if isinstance(err, yaml.reader.ReaderError):
            where = _reader_where(name, text, err)
        if isinstance(err, _TagError) and err.key_path:
            raise ConfigError(f"{where}: {dotted(err.key_path)}: {err.problem}") from None
        raise ConfigError(f"{where}: invalid YAML: {yaml_problem(err)}") from None
    except RecursionError:
        raise ConfigError(f"{name}: invalid YAML: nested too deeply for the parser; a recipe needs only a few "
                          "levels of sections") from None
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:  # an empty recipe (or only comments) changes nothing
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{name}:{node.start_mark.line + 1}: the top level of a recipe must be a "
                          f"mapping of keys to values, got {show(data)}")
    return data


def quoted(text: str) -> str:
    """`text` as a YAML scalar that a recipe or `--set` reads back as exactly that string: what a
    command-line folder argument (`-o 2024-01-01`, `-o '"x"'`) becomes in an override."""
    return yaml.dump(text, Dumper=Dumper, default_style='"', width=math.inf, allow_unicode=True).removesuffix("\n")
