"""Typed configs: frozen dataclasses <- YAML recipe <- ``data`` mapping <- ``--set`` overrides.

Rules:

* Defaults live only in the dataclasses. A recipe file, then a ``data`` mapping, then each
  ``--set a.b.c=VALUE`` (VALUE read with ``yaml.safe_load``) is applied on top; later wins.
* A mapping given for a nested dataclass is merged into it, so recipes may be partial. A mapping
  given for a ``dict[str, X]`` field replaces the dict (so ``to_yaml`` output loads back
  unchanged), but ``--set field.key=v`` changes only that entry. Lists and scalars replace.
* Every layer is checked first; the layers are then merged and each dataclass is built once, so a
  ``__post_init__`` check sees the final values, never a half-applied recipe.
* Values are checked strictly against the annotations (``typing.get_type_hints``, so string
  annotations work): bool takes only true/false; int rejects bools and 2.5; float takes ints; a
  number in quotes is text, refused where a number is expected; str rejects numbers (quote them);
  ``Literal``, ``X | None``, unions, nested dataclasses, ``tuple[X, ...]`` (stored as a tuple),
  ``list[X]``, ``dict[str, X]`` and ``Any``. ``Annotated[str, NonEmpty()]`` (a path) refuses an
  empty value.
* Numbers are read as a person writes them, not as YAML 1.1 does: ``1e-4`` is a float, and YAML
  1.1's base-60, hexadecimal, octal and binary forms are refused (``hpcrlhf.config.recipe_yaml``
  reads recipes and ``--set`` values, with the line of every key).
* Every user error is a ``ConfigError`` whose message starts with where the value came from
  (``recipe.yaml:12``, ``--set train.lr=abc``, ``<data>``), then the dotted key path.
* The string literal under a field documents it (torchtitan style); ``describe`` prints them.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, TypeVar, Union

import yaml

from hpcrlhf.config.messages import Shown, brief, clip, dotted, show
from hpcrlhf.config.recipe_yaml import Dumper, NumberFormError, SafeLoader, read_recipe, yaml_problem
from hpcrlhf.errors import ConfigError

__all__ = ["load_config", "from_dict", "apply_overrides", "to_dict", "to_yaml", "field_docs", "describe", "settings",
           "Setting", "NonEmpty"]

T = TypeVar("T")
_FORM = "expected the form --set section.key=value"
_NAMES = {bool: "a boolean (true or false)", int: "an int", float: "a float", str: "a string",
          list: "a list", tuple: "a list", dict: "a mapping"}
# A number written as text (in quotes, or from Python): refused where a number is expected.
_NUMBER_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


@dataclasses.dataclass(frozen=True)
class NonEmpty:
    """`Annotated[str, NonEmpty()]`: a setting that names a file or folder. An empty (or blank) value is
    refused where it is set: it is what an unset shell variable gives (`--set data.train_path=$DATA`),
    and read as "unset" it would silently train on something else."""


class _OverridePath(dict):
    """The nested mapping `--set a.b=v` turns into; it updates dict fields instead of replacing them."""


# ---------------------------------------------------------------- messages
def _where(src: str, line: int | None) -> str:
    return f"{src}:{line}" if line else src


def _fail(src: str, line: int | None, path: tuple[Any, ...], message: str) -> NoReturn:
    where = _where(src, line)
    raise ConfigError(f"{where}: {dotted(path)}: {message}" if path else f"{where}: {message}")


def _suggest(word: Any, choices: list[Any]) -> str:
    if not isinstance(word, (str, int, float)) or isinstance(brief(word), Shown):  # no str() of a 5000-digit int
        return ""
    by_text = {str(c): c for c in choices}
    close = difflib.get_close_matches(str(word), list(by_text), n=1)
    return f" (did you mean {by_text[close[0]]!r}?)" if close else ""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _type_name(typing.get_args(tp)[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    return _NAMES.get(origin or tp, f"a {getattr(tp, '__name__', tp)}")


# ---------------------------------------------------------------- checking values
@dataclasses.dataclass
class _Section:
    """A checked mapping for a dataclass (`cls`) or a dict field (`cls` None), built later."""

    cls: type | None
    items: dict[Any, Any]
    path: tuple[Any, ...]
    where: tuple[str, ...]  # every source that set something here, for __post_init__ errors
    merge: bool = True  # False: replaces the current dict instead of updating it


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)  # keeps Annotated marks (NonEmpty)


def _init_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init]  # init=False fields are derived, not set


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _convert(tp: Any, value: Any, src: str, line: int | None, path: tuple[Any, ...]) -> Any:
    """Check `value` against annotation `tp`; return it converted (sections as `_Section`)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object:
        return _plain(value)
    if origin is Annotated:
        checked = _convert(args[0], value, src, line, path)
        if any(isinstance(mark, NonEmpty) for mark in args[1:]) and isinstance(checked, str) and not checked.strip():
            _fail(src, line, path, f"{checked!r} is an empty path (an unset shell variable?): give the file or "
                                   "folder, or leave the setting out for its default")
        return checked
    if origin is Literal:
        if any(value == c and type(value) is type(c) for c in args):  # type check: True == 1
            return value
        shown = "null" if value is None else clip(repr(brief(value)))
        _fail(src, line, path, f"{shown} is not one of {', '.join(map(repr, args))}{_suggest(value, list(args))}")
    if origin in (Union, types.UnionType):
        arms = [a for a in args if a is not type(None)]
        if value is None and len(arms) < len(args):
            return None
        if len(arms) == 1:  # Optional[X]: X's own message is the most precise one
            return _convert(arms[0], value, src, line, path)
        for arm in arms:  # first arm that accepts the value wins, so order `int | float`
            try:
                return _convert(arm, value, src, line, path)
            except ConfigError:
                pass
    elif value is None:
        pass
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return _section(tp, value, src, line, path)
    elif origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, (list, tuple)):
            return _sequence(tp, value, src, line, path)
    elif origin is dict or tp is dict:
        if isinstance(value, Mapping):
            key_tp, value_tp = args or (Any, Any)
            value_lines = getattr(value, "value_lines", {})
            items = {}
            for key, item in value.items():
                key_line = getattr(value, "key_lines", {}).get(key, line)
                checked = key if key_tp is Any else _convert(key_tp, key, src, key_line, path + (key,))
                items[checked] = _convert(value_tp, item, src, value_lines.get(key, line), path + (key,))
            return _Section(None, items, path, (_where(src, line),), merge=isinstance(value, _OverridePath))
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value):  # "12": text, not a number
            _fail(src, line, path, f"expected an int, got {show(value)}; remove the quotes")
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                _fail(src, line, path, f"{show(value)} is too large for a float")
        if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value.strip()):  # "0.001": text, not a number
            _fail(src, line, path, f"expected a float, got {show(value)}; remove the quotes")
    elif tp is str:
        if isinstance(value, str):
            return value
        if not isinstance(value, (Mapping, list, tuple)):  # 3, true, 2024-01-01 would be strings if quoted
            _fail(src, line, path, f"expected a string, got {show(value)}; quote it")
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    _fail(src, line, path, f"expected {_type_name(tp)}, got {show(value)}")


def _section(cls: type, mapping: Mapping[Any, Any], src: str, line: int | None, path: tuple[Any, ...]) -> _Section:
    names = [f.name for f in _init_fields(cls)]
    key_lines, value_lines = getattr(mapping, "key_lines", {}), getattr(mapping, "value_lines", {})
    items = {}
    for key, value in mapping.items():
        if key not in names:
            where = f"section {dotted(path)!r}" if path else "the top level"
            moved = getattr(cls, "MOVED", {}).get(key)
            if moved:
                raise ConfigError(f"{_where(src, key_lines.get(key, line))}: {clip(repr(brief(key)))} in {where} is no "
                                  f"longer a setting: {moved}")
            valid = ", ".join(sorted(names)) or "(none)"
            shown = clip(repr(brief(key)))
            raise ConfigError(f"{_where(src, key_lines.get(key, line))}: unknown key {shown} in {where}; "
                              f"valid keys: {valid}{_suggest(key, names)}")
        items[key] = _convert(_hints(cls)[key], value, src, value_lines.get(key, line), path + (key,))
    return _Section(cls, items, path, (_where(src, line),))


def _sequence(tp: Any, value: list[Any] | tuple[Any, ...], src: str, line: int | None, path: tuple[Any, ...]) -> Any:
    args = typing.get_args(tp)
    if args and args[-1] is not Ellipsis and (typing.get_origin(tp) or tp) is tuple:  # tuple[X, Y]
        if len(value) != len(args):
            _fail(src, line, path, f"expected a list of {len(args)} items, got {show(value)}")
        item_types = list(args)
    else:
        item_types = [args[0] if args else Any] * len(value)
    lines = getattr(value, "lines", [line] * len(value))
    items = [_convert(t, v, src, lines[i], path + (i,)) for i, (t, v) in enumerate(zip(item_types, value))]
    return tuple(items) if (typing.get_origin(tp) or tp) is tuple else items


# ---------------------------------------------------------------- merging layers and building
def _merge(old: Any, new: Any) -> Any:
    """Lay section `new` over `old`: later keys win, nested sections merge key by key."""
    if isinstance(new, _Section) and new.cls and isinstance(old, new.cls):  # from_dict(..., {"x": X(...)})
        old = _Section(new.cls, {f.name: getattr(old, f.name) for f in _init_fields(new.cls)}, new.path, ())
    if isinstance(old, _Section) and isinstance(new, _Section) and new.merge and old.cls is new.cls:
        items = dict(old.items)
        for key, value in new.items.items():
            items[key] = _merge(items[key], value) if key in items else value
        return _Section(old.cls, items, old.path, old.where + new.where, old.merge)
    return new


def _build(current: Any, patch: Any) -> Any:
    """Turn a checked patch into values, on top of `current` (the value it replaces, or None)."""
    if type(patch) in (list, tuple):  # a list of sections (e.g. tuple[Stage, ...]) is built item by item
        return type(patch)(_build(None, item) for item in patch)
    if not isinstance(patch, _Section):
        return patch
    if patch.cls is None:  # a dict field; copied, so defaults are never mutated
        out = dict(current) if patch.merge and isinstance(current, dict) else {}
        for key, value in patch.items.items():
            out[key] = _build(out.get(key), value)
        return out
    where, section = ", ".join(dict.fromkeys(patch.where)) or "<defaults>", dotted(patch.path)
    existing = isinstance(current, patch.cls)
    # A new section starts from the field defaults, so `--set env.B=x` updates the default dict.
    bases = {f.name: getattr(current, f.name) if existing else _default(f)
             for f in _init_fields(patch.cls) if f.name in patch.items}
    changes = {key: _build(bases[key], value) for key, value in patch.items.items()}
    missing = [f.name for f in _init_fields(patch.cls) if f.name not in changes and not existing
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        inside = f"section {section!r}" if section else "the top level"
        raise ConfigError(f"{where}: missing required key(s) {', '.join(missing)} in {inside}")
    try:
        return dataclasses.replace(current, **changes) if existing else patch.cls(**changes)
    except ConfigError as err:
        # The check may already name the key ("optim.lr: ..."); then only the location is added.
        text = str(err)
        named = not section or text.startswith((f"{section}.", f"{section}:"))
        raise ConfigError(f"{where}: {text}" if named else f"{where}: {section}: {text}") from err


def _root(cls: type, mapping: Any, src: str) -> _Section:
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{src}: the top level must be a mapping of keys to values, got {show(mapping)}")
    return _section(cls, mapping, src, None, ())


def _override(cls: type, text: Any) -> _Section:
    """Check one `a.b.c=VALUE` override and return it as a section of `cls`."""
    if not isinstance(text, str):
        raise ConfigError(f"--set {text!r}: an override must be a string; {_FORM}")
    key, sep, raw = text.partition("=")
    parts = [part.strip() for part in key.split(".")]
    if not sep:
        raise ConfigError(f"--set {text}: no '=' in the override; {_FORM}")
    if not all(parts):
        raise ConfigError(f"--set {text}: empty key {key.strip()!r}; {_FORM}")
    try:  # a bare `key=` means the empty string; yaml.safe_load("") would give null
        value: Any = yaml.load(raw, Loader=SafeLoader) if raw.strip() else ""
    except NumberFormError as err:  # valid YAML, but not what a person means
        raise ConfigError(f"--set {text}: {'.'.join(parts)}: {err.problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {text}: {'.'.join(parts)}: the value is not valid YAML: {yaml_problem(err)}") from None
    except RecursionError:
        raise ConfigError(f"--set {text}: {'.'.join(parts)}: the value is nested too deeply for the YAML parser; "
                          "give a plain value or a short list") from None
    for part in reversed(parts):
        value = _OverridePath({part: value})
    return _root(cls, value, f"--set {text}")


def _finish(cls: type[T], current: T | None, layers: list[_Section]) -> T:
    patch = _Section(cls, {}, (), ())
    for layer in layers:
        patch = _merge(patch, layer)
    return _build(current, patch)


def _overrides(cls: type, overrides: Iterable[str]) -> list[_Section]:
    if isinstance(overrides, str):  # one override passed on its own, not a string to iterate
        overrides = (overrides,)
    return [_override(cls, text) for text in overrides]


# ---------------------------------------------------------------- public API
def load_config(cls: type[T], path: str | Path | None = None, overrides: Iterable[str] = (), *,
                data: Mapping[str, Any] | None = None, base: tuple[Mapping[str, Any], str] | None = None) -> T:
    """Defaults of `cls`, then `base` (settings read from a file, and its name: `hpcrlhf eval --run`'s from
    the run's config.yaml), then the recipe at `path`, then `data`, then each `--set` override."""
    layers = [] if base is None else [_root(cls, base[0], base[1])]
    if path is not None:
        layers.append(_root(cls, read_recipe(path), str(path)))
    if data is not None:
        layers.append(_root(cls, data, "<data>"))
    return _finish(cls, None, layers + _overrides(cls, overrides))


def from_dict(cls: type[T], mapping: Mapping[str, Any], *, source: str = "<dict>") -> T:
    """Build `cls` from its defaults and a (possibly partial, nested) mapping."""
    return _finish(cls, None, [_root(cls, mapping, source)])


def apply_overrides(cfg: T, overrides: Iterable[str]) -> T:
    """A new config: `cfg` with `a.b.c=VALUE` overrides applied (same rules as `load_config`)."""
    return _finish(type(cfg), cfg, _overrides(type(cfg), overrides))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in _init_fields(type(value))}
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def to_dict(cfg: Any) -> dict[str, Any]:
    """`cfg` as plain Python: sections become dicts, tuples become lists."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"to_dict needs a dataclass instance, got {type(cfg).__name__}")
    return _plain(cfg)


def flat_settings(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A settings tree (`to_dict`'s) as dotted setting -> its value; lists are values (pure)."""
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in flat_settings(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def to_yaml(cfg: Any) -> str:
    """`cfg` as YAML that `load_config(type(cfg), data=yaml.safe_load(...))` turns back into `cfg`."""
    return yaml.dump(to_dict(cfg), Dumper=Dumper, sort_keys=False, allow_unicode=True)


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # built at run time, or source not shipped
        return {}
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.ClassDef):
        return {}
    docs = {}
    for stmt, after in zip(node.body, node.body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal under it in the class body (base classes included)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    return docs


@dataclasses.dataclass(frozen=True)
class Setting:
    """One field of a config tree, as `describe` and the settings reference (`hpcrlhf.config.reference`) show it."""

    path: tuple[str, ...]
    """Keys from the top (`("placement", "actor", "nodes")`)."""
    doc: str
    """The string literal under the field (`field_docs`)."""
    annotation: Any
    """The field's type annotation, `Annotated` marks kept."""
    value: Any
    """The config's value, or the field's declared default when the walk has no config."""
    section: bool
    """A nested config section: its own fields follow it in the walk."""


def settings(cls: type, cfg: Any = None, prefix: tuple[str, ...] = ()) -> Iterator[Setting]:
    """Every field of config class `cls`, depth first in declaration order: a section, then its
    fields. Values are `cfg`'s, or without `cfg` the declared defaults (a section's default is
    built, and its fields read from it). `prefix` is put before every path."""
    docs, hints = field_docs(cls), _hints(cls)
    for f in _init_fields(cls):
        value = getattr(cfg, f.name) if cfg is not None else _default(f)
        section = dataclasses.is_dataclass(value) and not isinstance(value, type)
        yield Setting(prefix + (f.name,), docs.get(f.name, ""), hints[f.name], value, section)
        if section:
            yield from settings(type(value), value, prefix + (f.name,))


def describe(cls_or_cfg: Any) -> str:
    """Commented YAML of every field (the defaults of a class, or the values of an instance)."""
    cfg = cls_or_cfg() if isinstance(cls_or_cfg, type) else cls_or_cfg
    walk, lines = list(settings(type(cfg), cfg)), []
    for i, setting in enumerate(walk):
        depth = len(setting.path) - 1
        pad, name = "  " * depth, setting.path[-1]
        if depth == 0 and lines:
            lines.append("")
        lines += [f"{pad}# {doc}".rstrip() for doc in setting.doc.splitlines()]
        if setting.section:
            empty = i + 1 == len(walk) or walk[i + 1].path[:depth + 1] != setting.path
            lines.append(f"{pad}{name}:" + (" {}" if empty else ""))
        else:  # dumping a one-key mapping gives valid YAML, also for lists and multi-line strings
            dumped = yaml.safe_dump({name: _plain(setting.value)}, sort_keys=False, allow_unicode=True, width=1000)
            lines += [pad + text for text in dumped.splitlines()]
    return "\n".join(lines) + "\n"
