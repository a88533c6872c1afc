"""Malformed user input fails with an hpcrlhf error that names the field, never a library traceback.

Issue 9: every recipe, `--set` string and dataset row a user can get wrong must be reported by
one of hpcrlhf's own errors (`HpcrlhfError`), with a message that says where (recipe file, `--set`
string, data file:line), which field, and how to fix it. The property tests below feed random
broken input through the very entry points the CLI and the trainers use (`load_config`,
`apply_overrides`, and each trainer's data loading, no model and no training) and check only
*how* a failure looks: valid input that happens to be generated may load. The data property also
checks the converse, that a malformed row the loader reaches is never silently accepted; the
config properties, that a float field set to NaN or +/-Inf never loads.

The plain tests at the end pin each bug these properties found, with its exact input and message.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tempfile
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import pytest
import yaml
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from hpcrlhf.config.loader import apply_overrides, load_config
from hpcrlhf.config.schema import JOB_CONFIGS, GenerateConfig
from hpcrlhf.errors import ConfigError, HpcrlhfError

KINDS: dict[str, type] = {**JOB_CONFIGS, "generate": GenerateConfig}
"""Every config the CLI loads from a recipe: `train KIND` and `generate`."""

PROPERTY = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
"""Deterministic in CI (derandomize), and quick: ~150 examples a property."""


# ---------------------------------------------------------------- the fields of every config
def _section_class(tp: Any) -> type | None:
    """The dataclass a field holds (also inside `X | None`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return inner[0] if inner else None
    return None


def _catalogue(cls: type, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """(path, annotation) of every field and section of `cls`, sections before their fields."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path = prefix + (f.name,)
        out.append((path, hints[f.name]))
        inner = _section_class(hints[f.name])
        if inner is not None:
            out += _catalogue(inner, path)
    return out


FIELDS = {kind: _catalogue(cls) for kind, cls in KINDS.items()}
SECTIONS = {kind: [()] + [path for path, tp in fields if _section_class(tp)] for kind, fields in FIELDS.items()}
DOTTED = {kind: sorted({".".join(path) for path, _ in fields}, key=len, reverse=True) for kind, fields in FIELDS.items()}


def _mentions(message: str, name: str) -> bool:
    """`name` appears in `message` as a whole word or dotted key (not inside a longer name)."""
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message) is not None


# ---------------------------------------------------------------- value strategies
_keys = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789-", min_size=1, max_size=12)
HUGE = 10**5000
"""An int Python refuses to print (more than 4300 digits): any message quoting it must cope."""
huge = st.sampled_from([1, -1]).map(lambda sign: sign * HUGE)  # built after drawing: hypothesis cannot repr it
_scalars = (st.none() | st.booleans() | st.integers() | st.just(10**400) | huge | st.floats()
            | st.text(max_size=12) | st.dates() | st.datetimes() | st.binary(max_size=4))
garbage = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(_keys | st.integers() | st.booleans(), inner, max_size=3), max_leaves=6)
"""Anything a recipe mapping can hold: scalars of every type, huge and non-finite numbers, dates,
bytes (!!binary), and nested lists and mappings of them."""


def near_values(tp: Any) -> st.SearchStrategy[Any]:
    """Values close to valid for annotation `tp`: the right type out of range, the wrong type,
    numbers written as text, near-miss choices."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    section = _section_class(tp)
    if section is not None:
        names = [f.name for f in dataclasses.fields(section)]
        return st.dictionaries(st.sampled_from(names) | _keys, garbage, max_size=3) | garbage
    if origin is Literal:
        return st.sampled_from(args) | st.sampled_from([str(a).upper() + " " for a in args]) | st.integers(-1, 4)
    if origin in (Union, types.UnionType):
        return st.one_of([st.none()] + [near_values(a) for a in args if a is not type(None)])
    if origin is tuple:
        items = [a for a in args if a is not Ellipsis]
        if len(items) == 1 and _section_class(items[0]):
            fields = [f.name for f in dataclasses.fields(items[0])]
            return st.lists(st.dictionaries(st.sampled_from(fields) | _keys, garbage | st.text(max_size=8), max_size=3),
                            max_size=3) | garbage
        return st.lists(st.one_of([near_values(a) for a in items]), max_size=4) | garbage
    if tp is bool:
        return st.booleans() | st.sampled_from(["yes", "no", "True", 0, 1, 2])
    if tp is int:
        return (st.integers(-3, 9) | st.integers() | st.just(10**400) | huge | st.floats(-5, 5) | st.floats()
                | st.sampled_from(["12", "1e3", "0x10", " 4"]))
    if tp is float:
        return (st.floats() | st.integers(-3, 3) | st.sampled_from([10**400, -(10**400)]) | huge
                | st.sampled_from([math.nan, math.inf, -math.inf])
                | st.sampled_from(["1e-4", "1e999", "-1e999", "-0.5", "nan", "abc", ".inf"]))
    if tp is str:
        return st.text(max_size=12) | st.integers() | st.booleans() | st.dates()
    return garbage


@dataclass(frozen=True)
class Edit:
    """One change a broken recipe makes: a value at a known path, or an unknown key."""

    path: tuple[Any, ...]
    value: Any
    unknown: bool = False


@st.composite
def broken_recipes(draw, kind: str, string_keys: bool = False) -> list[Edit]:
    """A few edits of `kind`'s config: known keys set to near-valid or garbage values, whole
    sections replaced, and unknown keys (non-string ones too unless `string_keys`)."""
    edits = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.integers(0, 4)) == 0:
            section = draw(st.sampled_from(SECTIONS[kind]))
            key = draw(_keys if string_keys else _keys | st.integers() | st.booleans() | st.none())
            known = {p[-1] for p, _ in FIELDS[kind] if p[:-1] == section}
            if key not in known:
                edits.append(Edit(section + (key,), draw(garbage), unknown=True))
            continue
        path, tp = draw(st.sampled_from(FIELDS[kind]))
        edits.append(Edit(path, draw(near_values(tp) | garbage)))
    return edits


def nest(edits: list[Edit]) -> tuple[dict[Any, Any], list[Edit]]:
    """The recipe mapping of `edits`, and the edits still in it (a later edit can replace a
    section an earlier one wrote into)."""
    root: dict[Any, Any] = {}
    for e in edits:
        node = root
        for part in e.path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[e.path[-1]] = e.value
    kept = []
    for e in edits:
        node: Any = root
        for part in e.path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(e.path[-1], object()) is e.value:
            stored = next(k for k in node if k == e.path[-1])  # 0 and False are one key: the first stays
            kept.append(dataclasses.replace(e, path=e.path[:-1] + (stored,)))
    return root, kept


def names_a_field(message: str, kind: str, edits: list[Edit]) -> bool:
    """Whether `message` names a field one of `edits` got wrong: its dotted path; for an unknown
    key, the key itself; for a cross-field check, the edited key next to the dotted key the check
    reports (e.g. `train.global_batch_size: ... (rollout.prompts_per_step 3 x samples_per_prompt 4)`)."""
    for e in edits:
        if e.unknown:
            if f"unknown key {e.path[-1]!r}" in message:
                return True
            continue
        if _mentions(message, ".".join(e.path)):
            return True
        if _mentions(message, e.path[-1]) and any(_mentions(message, d) for d in DOTTED[kind] if "." in d):
            return True
    return False


def check_config_error(err: BaseException, kind: str, edits: list[Edit], sources: list[str]) -> None:
    """The failure is a ConfigError that starts with where the value came from and names a field."""
    assert isinstance(err, ConfigError), f"{type(err).__name__} escaped: {err!r}"
    message = str(err)
    assert message.startswith(tuple(sources)), f"message does not start with its source {sources}: {message}"
    rest = message
    for source in sorted(sources, key=len, reverse=True):  # a --set string holds its own key: skip it
        rest = rest.replace(source, "<source>")
    assert names_a_field(rest, kind, edits), f"message names none of {[e.path for e in edits]}: {message}"


def _is_float(tp: Any) -> bool:
    """`float` or `float | None`."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)] == [float]
    return tp is float


FLOAT_FIELDS = {kind: {path for path, tp in fields if _is_float(tp)} for kind, fields in FIELDS.items()}
_NUMBER_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
"""Text the loader reads as a float (YAML 1.1 leaves `1e999` a string; float() makes it inf)."""


def _non_finite(value: Any) -> bool:
    """Whether a float field given `value` holds NaN or +/-Inf once loaded."""
    if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value):
        value = float(value)
    return isinstance(value, float) and not math.isfinite(value)


def check_non_finite_refused(kind: str, edits: list[Edit]) -> None:
    """The config loaded: then none of `edits` gave a float field NaN or +/-Inf (range checks let
    Inf through, fields without one NaN too; training then turns every loss into NaN)."""
    bad = [e for e in edits if not e.unknown and e.path in FLOAT_FIELDS[kind] and _non_finite(e.value)]
    assert not bad, f"a non-finite float loaded silently: {[(e.path, e.value) for e in bad]}"


def check_load(kind: str, edits: list[Edit], sources: list[str], *args: Any, **kw: Any) -> None:
    """`load_config(KINDS[kind], *args, **kw)` of a recipe broken by `edits`: it fails with a
    ConfigError naming a broken field (and its source), or loads only what was valid."""
    try:
        load_config(KINDS[kind], *args, **kw)
    except Exception as err:  # noqa: BLE001 - the property is about which exceptions escape
        check_config_error(err, kind, edits, sources)
    else:
        check_non_finite_refused(kind, edits)


def _dump(value: Any, **kw: Any) -> str:
    """`value` as YAML; an example holding an int too long to print as text cannot be written."""
    try:
        return yaml.safe_dump(value, allow_unicode=True, sort_keys=False, **kw)
    except ValueError:
        reject()


def _flow(value: Any) -> str:
    """`value` as one YAML flow value for `--set key=VALUE`."""
    text = _dump(value, default_flow_style=True, width=10**6)
    return text.removesuffix("\n").removesuffix("\n...").removesuffix("...")


# ---------------------------------------------------------------- properties: recipes and --set
@PROPERTY
@given(data=st.data())
def test_broken_recipe_mappings_fail_with_the_field(data):
    """`load_config(cls, data=MAPPING)`: the mapping a recipe parses to, given directly."""
    kind = data.draw(st.sampled_from(sorted(KINDS)))
    recipe, edits = nest(data.draw(broken_recipes(kind)))
    check_load(kind, edits, ["<data>"], data=recipe)


@PROPERTY
@given(data=st.data())
def test_broken_recipe_files_fail_with_the_field(data):
    """`load_config(cls, recipe.yaml)`: the same edits written as a YAML recipe file."""
    kind = data.draw(st.sampled_from(sorted(KINDS)))
    recipe, edits = nest(data.draw(broken_recipes(kind)))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_text(_dump(recipe), encoding="utf-8")
        check_load(kind, edits, [str(path)], path)


@PROPERTY
@given(data=st.data())
def test_broken_overrides_fail_with_the_field(data):
    """`load_config(cls, overrides=["a.b=VALUE", ...])`: each edit as a `--set` string."""
    kind = data.draw(st.sampled_from(sorted(KINDS)))
    _, edits = nest(data.draw(broken_recipes(kind, string_keys=True)))
    texts = [".".join(map(str, e.path)) + "=" + _flow(e.value) for e in edits]
    check_load(kind, edits, [f"--set {t}" for t in texts], overrides=texts)


@PROPERTY
@given(data=st.data())
def test_non_finite_floats_never_load(data):
    """A float field set to NaN or +/-Inf, in a recipe mapping, a recipe file or a `--set`, fails
    with a ConfigError that names the field and the value, whatever its own range check is."""
    kind = data.draw(st.sampled_from(sorted(KINDS)))
    path = data.draw(st.sampled_from(sorted(FLOAT_FIELDS[kind])))
    value = data.draw(st.sampled_from([math.nan, math.inf, -math.inf, "1e999", "-1e999"]))
    shown = repr(float(value))
    how = data.draw(st.sampled_from(["data", "file", "set"]))
    if how == "data":  # "1e999" is text the YAML of a file or --set reads as a number; from Python it is text
        value = float(value)
    recipe, edits = nest([Edit(path, value)])
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "recipe.yaml"
        file.write_text(_dump(recipe), encoding="utf-8")
        source = {"data": "<data>", "file": str(file), "set": f"--set {'.'.join(path)}={_flow(value)}"}[how]
        with pytest.raises(ConfigError) as info:
            if how == "data":
                load_config(KINDS[kind], data=recipe)
            elif how == "file":
                load_config(KINDS[kind], file)
            else:
                load_config(KINDS[kind], overrides=[source.removeprefix("--set ")])
    check_config_error(info.value, kind, edits, [source])
    assert f": {shown} is invalid: use a finite number" in str(info.value), str(info.value)


_YAML_TOKENS = ["\n", "  ", "- ", ": ", "? ", "{", "}", "[", "]", ",", "'", '"', "#", "&a ", "*a", "<<: ", "!!float ",
                "!!int ", "!!bool ", "!!timestamp ", "!!binary ", "!!str ", "!!set ", "!!omap ", "!!python/tuple ",
                "!x ", "%YAML 1.1\n", "---\n", "...\n", "|\n", ">\n", "\t", "@", "`", "%", "abc", "1e-4", "0x1f",
                "1.5", "-3", "10000000000000000000000000", "9" * 5000, ".nan", ".inf", "null", "~", "yes", "2024-01-01",
                "optim", "lr", "train", "epochs", "data", "max_length", "reward", "sources", "rule", "placement",
                "colocate", "model", "path", "seed", "output_dir", "\x00", "\ufeff", "\x85", "\u2028", "é"]
_SYNTAX_PROBLEMS = ("invalid YAML", "not UTF-8", "the top level of a recipe", "duplicate key", "a key must be a plain value",
                    "nested too deeply")


@PROPERTY
@given(kind=st.sampled_from(sorted(KINDS)), tokens=st.lists(st.sampled_from(_YAML_TOKENS), max_size=30),
       raw=st.binary(max_size=3))
def test_random_recipe_text_fails_cleanly(kind, tokens, raw):
    """Arbitrary YAML-ish text (tags, anchors, merge keys, odd bytes) as a recipe file: a syntax
    error is named by file:line:column, anything else by the key it concerns."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_bytes("".join(tokens).encode("utf-8") + raw)
        try:
            load_config(KINDS[kind], path)
        except Exception as err:  # noqa: BLE001
            assert isinstance(err, ConfigError), f"{type(err).__name__} escaped: {err!r}"
            message = str(err)
            assert re.match(rf"{re.escape(str(path))}(:\d+){{0,2}}: \S", message), message
            assert (any(p in message for p in _SYNTAX_PROBLEMS) or "unknown key" in message
                    or any(_mentions(message, d) for d in DOTTED[kind])), message


_SET_TOKENS = ["=", ".", " ", "optim", "lr", "train", "epochs", "rollout", "samples_per_prompt", "reward", "sources", "0",
               "model", "rule", "data", "max_length", "placement", "colocate", "seed", "[", "]", "{", "}", ": ", ",",
               "-", "!!float ", "!!int ", "!!bool ", "!!timestamp ", "&a ", "*a", "'", '"', "null", "abc", "1e-4",
               "1.0e-4", "3", "-1", "true", "\n", "#", "%", "@", "\t", "é"]


@st.composite
def set_strings(draw, kind: str) -> str:
    """`--set` strings: a real or mangled dotted key, `=`, and YAML-ish value text (tags, anchors,
    unclosed brackets, control characters), or token soup with no structure at all."""
    junk = st.lists(st.sampled_from(_SET_TOKENS), max_size=12).map("".join)
    if draw(st.integers(0, 3)) == 0:
        return draw(junk)
    key = draw(st.sampled_from(DOTTED[kind]) | junk)
    return f"{key}={''.join(draw(st.lists(st.sampled_from(_YAML_TOKENS), max_size=8)))}"


@PROPERTY
@given(data=st.data())
def test_random_set_strings_fail_cleanly(data):
    """Arbitrary `--set` strings on a loaded config (`apply_overrides`): malformed ones say the
    form to use, the others name the key."""
    kind = data.draw(st.sampled_from(sorted(KINDS)))
    text = data.draw(set_strings(kind))
    try:
        apply_overrides(KINDS[kind](), [text])
    except Exception as err:  # noqa: BLE001
        assert isinstance(err, ConfigError), f"{type(err).__name__} escaped: {err!r}"
        message = str(err)
        assert message.startswith(f"--set {text}"), message
        rest = message[len(f"--set {text}"):]
        key = ".".join(part.strip() for part in text.partition("=")[0].split("."))
        assert ("--set section.key=value" in rest or "unknown key" in rest or rest.startswith(f": {key}: ")
                or any(_mentions(rest, d) for d in DOTTED[kind])), message


# ---------------------------------------------------------------- dataset rows
ROLES: dict[str, tuple[str, ...]] = {
    "sft": ("prompt", "response"), "rm": ("prompt", "chosen", "rejected"), "dpo": ("prompt", "chosen", "rejected"),
    "kto": ("prompt", "completion", "label"), "csft": ("prompt", "response", "reward"), "ppo": ("prompt",),
    "rs": ("prompt",),
}
"""The fields each job kind reads from a row (rm and dpo may add a margin)."""
NUMBER_ROLES, LABEL_ROLES = {"reward", "margin"}, {"label"}
_FIELD_NAMES = ["prompt", "response", "chosen", "rejected", "completion", "label", "reward", "margin", "q", "text"]

json_garbage = st.recursive(st.none() | st.booleans() | st.integers() | st.just(10**400) | st.floats() | st.text(max_size=8),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=3),
                            max_leaves=6)
"""What a JSON value can be, nested (NaN and Infinity included, as Python's json writes them)."""
_text = st.text(max_size=10).filter(lambda s: s.strip())
_blank = st.sampled_from(["", " ", "\t\n", "\u3000"])
_not_text = (st.none() | st.booleans() | st.integers() | st.floats() | st.lists(json_garbage, max_size=2)
             | st.dictionaries(_keys, json_garbage, max_size=2))
_BAD_LINES = [b'{"prompt": "1+2="', b"{prompt: 1}", b"nope", b"[1, 2", b'{"prompt": "a",}', b'{"prompt": "\x01"}',
              b"\xff\xfe{}", b'{"prompt": "\xc3"}', b"1" * 5000, b'{"margin": ' + b"1" * 5000 + b"}",
              b"[" * 100_000, b"\x00", b"[]", b"3", b'"text"', b"null", b"true", b'[{"prompt": "1+2="}]']
"""Lines that are not a JSON object: broken JSON, bytes that are not UTF-8, an integer too long
for Python to parse, nesting too deep for the parser, JSON values other than objects."""


def good_value(role: str) -> st.SearchStrategy[Any]:
    if role in NUMBER_ROLES:
        return st.integers(-5, 5) | st.floats(-1e6, 1e6)
    if role in LABEL_ROLES:
        return st.booleans() | st.sampled_from([0, 1])
    return _text


def bad_value(role: str) -> st.SearchStrategy[Any]:
    if role in NUMBER_ROLES:
        return (st.none() | st.booleans() | st.text(max_size=5) | st.sampled_from([math.nan, math.inf, -math.inf, 10**400])
                | st.lists(json_garbage, max_size=2) | st.dictionaries(_keys, json_garbage, max_size=2))
    if role in LABEL_ROLES:
        return (st.none() | st.text(max_size=5) | st.integers().filter(lambda i: i not in (0, 1))
                | st.floats().filter(lambda f: f not in (0, 1)) | st.lists(json_garbage, max_size=2))
    return _not_text | _blank | _text.map(lambda s: s + "\ud800") | st.just("\udfff")


@st.composite
def data_lines(draw, names: dict[str, str]) -> list[bytes]:
    """Lines of a JSONL file with rows for the role -> field `names`; some rows broken."""
    lines = []
    for _ in range(draw(st.integers(0, 6))):
        how = draw(st.sampled_from(["good", "good", "good", "field", "missing", "identical", "line", "blank"]))
        if how == "line":
            lines.append(draw(st.sampled_from(_BAD_LINES)))
            continue
        if how == "blank":
            lines.append(draw(st.sampled_from([b"", b"  ", b"\t"])))
            continue
        row = {field: draw(good_value(role)) for role, field in names.items()}
        if how == "field":
            role = draw(st.sampled_from(sorted(names)))
            row[names[role]] = draw(bad_value(role))
        elif how == "missing":
            del row[names[draw(st.sampled_from(sorted(names)))]]
        elif how == "identical" and "rejected" in names:
            row[names["rejected"]] = str(row[names["chosen"]]) + draw(st.sampled_from(["", " "]))
        row.update(draw(st.dictionaries(st.sampled_from(["extra", "difficulty", "id"]), json_garbage, max_size=2)))
        ascii_only = draw(st.booleans())
        # Written without escapes, a lone surrogate becomes bytes that are not UTF-8.
        lines.append(json.dumps(row, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass"))
    return lines


# The oracle: what is wrong with each line, as the documented rules say (sources.require_*).
def _text_ok(value: Any) -> bool:
    if not isinstance(value, str) or not value.strip():
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _number_ok(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def row_problems(obj: Any, names: dict[str, str]) -> set[str]:
    """The fields of row `obj` that are wrong ("<line>": the line is no JSON object at all)."""
    if not isinstance(obj, dict):
        return {"<line>"}
    bad = set()
    for role, field in names.items():
        if field not in obj:
            bad.add(field)
        elif role in NUMBER_ROLES:
            if not _number_ok(obj[field]):
                bad.add(field)
        elif role in LABEL_ROLES:
            if obj[field] not in (True, False):
                bad.add(field)
        elif not _text_ok(obj[field]):
            bad.add(field)
    if "rejected" in names and not bad & {names["chosen"], names["rejected"]}:
        if obj[names["chosen"]].strip() == obj[names["rejected"]].strip():
            bad |= {names["chosen"], names["rejected"]}
    return bad


def _parse_line(raw: bytes, first: bool) -> Any:
    """The JSON value of one line, or a marker that it has none (a BOM may open the file)."""
    try:
        return json.loads(raw.decode("utf-8-sig" if first else "utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return "<invalid line>"


def reached_problems(lines: list[bytes], names: dict[str, str], limit: int | None) -> tuple[dict[int, set[str]], bool]:
    """(line number -> problems of every line a loader reads with `limit`, whether it has rows)."""
    problems, rows = {}, 0
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        obj = _parse_line(raw, first=lineno == 1)
        problems[lineno] = row_problems(obj, names)
        if "<line>" in problems[lineno]:
            break  # the loader stops at the first line that is not an object
        rows += 1
        if limit is not None and rows >= limit:
            break
    return problems, rows > 0


def own_data_sections(kind: str) -> dict[str, Any]:
    """Config sections of a job on the user's data: no task, and for online jobs a reward of the
    user's own (the default `task` rule needs the task; the rule is not imported by data loading)."""
    return {"task": {"name": None}, **({"reward": {"sources": [{"rule": "own.rules:score"}]}} if kind in ("ppo", "rs") else {})}


def load_kind(kind: str, cfg: Any, tokenizer: Any) -> None:
    """Load and tokenise `cfg`'s data as the `kind` trainer does, without a model."""
    if kind == "sft":
        from hpcrlhf.trainers.sft import build_sft_data, load_sft_rows

        build_sft_data(cfg, tokenizer, *load_sft_rows(cfg))
    elif kind in ("rm", "dpo"):
        from hpcrlhf.data.preference import load_pairs

        load_pairs(cfg.data, cfg.task, tokenizer)
    elif kind == "kto":
        from hpcrlhf.data.preference import load_unpaired

        load_unpaired(cfg.data, cfg.task, tokenizer)
    elif kind == "csft":
        from hpcrlhf.trainers.csft import CSFTTrainer

        trainer = CSFTTrainer.__new__(CSFTTrainer)  # only what build_data reads: no run folder, no model
        trainer.cfg, trainer.tokenizer = cfg, tokenizer
        trainer.build_data()
    else:
        from hpcrlhf.data.prompts import load_prompts

        load_prompts(cfg, tokenizer)


_DATASET_LEVEL = ("data.max_length", "at least 2 rows", "data.reward_key")
"""Problems of a whole dataset that valid rows can cause: truncation that makes a pair identical or
a prompt too long, too few rows for KTO, rewards that are all equal for conditional SFT."""


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from hpcrlhf.models.loading import load_tokenizer

    return load_tokenizer(tiny_llama)


@PROPERTY
@given(data=st.data())
def test_malformed_rows_fail_with_file_line_and_field(tokenizer, data):
    """Rows through each trainer's own loading: a failure names the file and line of a broken
    row and its field; a broken row the loader reaches never loads silently."""
    kind = data.draw(st.sampled_from(sorted(ROLES)), label="kind")
    roles = ROLES[kind] + (("margin",) if kind in ("rm", "dpo") and data.draw(st.booleans()) else ())
    names = dict(zip(roles, data.draw(st.permutations(_FIELD_NAMES))))
    train = data.draw(data_lines(names), label="train")
    evals = data.draw(st.none() | data_lines(names), label="eval")
    limit = data.draw(st.none() | st.integers(1, 4), label="max_samples")
    settings_ = {"max_length": data.draw(st.integers(8, 48)), "apply_chat_template": data.draw(st.booleans())}
    settings_.update({f"{role}_key": field for role, field in names.items()})
    if kind == "sft":
        settings_["packing"] = data.draw(st.booleans())
    with tempfile.TemporaryDirectory() as tmp:
        files = {Path(tmp) / "train.jsonl": train}
        if evals is not None:
            files[Path(tmp) / "eval.jsonl"] = evals
        for path, lines in files.items():
            bom = data.draw(st.sampled_from([b"", b"", b"\xef\xbb\xbf"]))
            path.write_bytes(bom + b"\n".join(lines) + data.draw(st.sampled_from([b"", b"\n"])))
        cfg = load_config(KINDS[kind], data={**own_data_sections(kind), "data": {
            **settings_, "train_path": str(Path(tmp) / "train.jsonl"), "max_samples": limit,
            "eval_path": str(Path(tmp) / "eval.jsonl") if evals is not None else None}})
        problems = {}
        must_fail = False
        for path, lines in files.items():
            found, has_rows = reached_problems(lines, names, limit if path.name == "train.jsonl" else None)
            problems[str(path)] = found
            must_fail |= not has_rows or any(found.values())
        try:
            load_kind(kind, cfg, tokenizer)
        except Exception as err:  # noqa: BLE001
            assert isinstance(err, HpcrlhfError), f"{type(err).__name__} escaped: {err!r}"
            message = str(err)
            refs = [(p, int(n)) for p in problems for n in re.findall(rf"{re.escape(p)}:(\d+)\b", message)]
            if any(level in message for level in _DATASET_LEVEL):
                return
            assert refs or any(p in message for p in problems), f"names no data file: {message}"
            for path, lineno in refs:
                bad = problems[path].get(lineno, set())
                assert bad, f"blames line {lineno}, which is fine: {message}"
                assert "<line>" in bad or any(f"'{field}'" in message for field in bad), \
                    f"names none of the bad fields {bad}: {message}"
        else:
            assert not must_fail, f"a broken row loaded silently: {problems}"


# ---------------------------------------------------------------- the bugs the properties found
def _error(call, *args, **kwargs) -> str:
    """The message of the HpcrlhfError `call(*args, **kwargs)` raises."""
    with pytest.raises(HpcrlhfError) as info:
        call(*args, **kwargs)
    return str(info.value)


_FIX = "remove the tag or fix the value"


@pytest.mark.parametrize("kind, text, expected", [
    # Each escaped from PyYAML's constructors: ValueError, IndexError, KeyError, AttributeError.
    ("sft", "optim:\n  lr: !!float abc\n", f"2:7: optim.lr: cannot read 'abc' as !!float (could not convert string to "
                                           f"float: 'abc'); {_FIX}"),
    ("sft", "optim:\n  lr: !!float\n", f"2:7: optim.lr: cannot read '' as !!float; {_FIX}"),
    ("sft", "log:\n  progress: !!bool maybe\n", f"2:13: log.progress: cannot read 'maybe' as !!bool; {_FIX}"),
    ("sft", "output_dir: !!timestamp x\n", f"1:13: output_dir: cannot read 'x' as !!timestamp; {_FIX}"),
    ("ppo", "reward:\n  sources:\n    - rule: task\n      weight: !!float x\n",
     f"4:15: reward.sources[0].weight: cannot read 'x' as !!float (could not convert string to float: 'x'); {_FIX}"),
])
def test_recipe_tag_that_cannot_be_built_names_the_key(tmp_path, kind, text, expected):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    assert _error(load_config, KINDS[kind], path) == f"{path}:{expected}"


def test_override_tag_that_cannot_be_built_names_the_key():
    assert _error(load_config, KINDS["sft"], overrides=["train.epochs=!!int abc"]) == (
        "--set train.epochs=!!int abc: train.epochs: the value is not valid YAML: cannot read 'abc' as !!int "
        f"(invalid literal for int() with base 10: 'abc'); {_FIX}")


def test_recipe_control_character_is_named_by_line_and_column(tmp_path):
    path = tmp_path / "recipe.yaml"  # was a yaml.reader.ReaderError naming "<unicode string>", position 7
    path.write_bytes(b"seed: 1\x00\n")
    assert _error(load_config, KINDS["sft"], path) == (
        f"{path}:1:8: invalid YAML: unacceptable character #x0000: special characters are not allowed; remove it")


def test_nesting_too_deep_for_the_parser(tmp_path):
    path = tmp_path / "recipe.yaml"  # both were RecursionErrors
    path.write_text("seed: " + "[" * 5000)
    assert _error(load_config, KINDS["sft"], path) == (
        f"{path}: invalid YAML: nested too deeply for the parser; a recipe needs only a few levels of sections")
    text = "optim.lr=" + "[" * 5000
    assert _error(load_config, KINDS["sft"], overrides=[text]) == (
        f"--set {text}: optim.lr: the value is nested too deeply for the YAML parser; give a plain value or a short list")


def test_self_referencing_values_are_refused():
    # Both were RecursionErrors: from the override's anchor, and from printing the list in the message.
    assert _error(load_config, KINDS["sft"], overrides=["optim.lr=&a [*a]"]) == (
        "--set optim.lr=&a [*a]: optim.lr: the value is not valid YAML: found unconstructable recursive node")
    loop: list[Any] = []
    loop.append(loop)
    assert _error(load_config, KINDS["sft"], data={"optim": {"lr": loop}}) == (
        "<data>: optim.lr: expected a float, got [[[[...]]]] (list)")


@pytest.mark.parametrize("kind, recipe, expected", [
    # Printed in full (401 digits) before:
    ("sft", {"optim": {"lr": 10**400}}, "optim.lr: <an integer of 401 digits> (int) is too large for a float"),
    # ValueError "Exceeds the limit (4300 digits) for integer string conversion" before:
    ("ppo", {"rollout": {"top_k": -HUGE}}, "rollout.top_k: <minus an integer of 5001 digits> is invalid: use 0 (off) or a "
                                           "positive k"),
    ("sft", {"model": {"attn_implementation": HUGE}}, "model.attn_implementation: <an integer of 5001 digits> is not one "
                                                      "of 'auto', 'sdpa', 'eager', 'flash_attention_2'"),
    ("sft", {"train": {"epochs": [HUGE]}}, "train.epochs: expected an int, got [<an integer of 5001 digits>] (list)"),
    ("sft", {"optim": {HUGE: 1}}, "unknown key <an integer of 5001 digits> in section 'optim'; valid keys: betas, eps, lr, "
                                  "max_grad_norm, min_lr_ratio, scheduler, warmup_ratio, weight_decay"),
])
def test_huge_integers_are_shown_by_their_size(kind, recipe, expected):
    assert _error(load_config, KINDS[kind], data=recipe) == f"<data>: {expected}"


@pytest.mark.parametrize("override, expected", [
    # Loaded, then failed in data loading naming no config field ("unknown task 'foo'", "n=-1 is invalid",
    # "ArithmeticTask.max_operand=0 is invalid"), or mid-training (ZeroDivisionError for log.every_steps=0
    # and eval.batch_size=0).
    ("task.name=foo", "task.name: 'foo' is invalid: use auto (the default), a bundled task (arithmetic, calculator), or null to train "
                      "on data.train_path"),
    ("task.max_operand=0", "task.max_operand: 0 is invalid: use at least 1, e.g. 99"),
    ("task.train_size=-1", "task.train_size: -1 is invalid: use at least 1 row"),
    ("task.eval_size=-1", "task.eval_size: -1 is invalid: use 0 (no held-out rows) or more"),
    ("data.max_samples=-2", "data.max_samples: -2 is invalid: use at least 1 row, or null for all of them"),
    ("log.every_steps=0", "log.every_steps: 0 is invalid: use at least 1 (every step)"),
    ("eval.every_steps=-1", "eval.every_steps: -1 is invalid: use 0 (only at the end) or a step count"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens: 0 is invalid: use at least 1, or null for the task's default"),
    ("eval.score_prompts=-1", "eval.score_prompts: -1 is invalid: use 0 (no task score) or more"),
    ("eval.batch_size=0", "eval.batch_size: 0 is invalid: use at least 1"),
    # loaded, then refused by torch's AdamW with a bare ValueError when the engine starts
    ("optim.betas=[0.9, 1.0]", "optim.betas: [0.9, 1.0] is invalid: use two numbers in [0, 1), e.g. [0.9, 0.95]"),
    ("optim.eps=-1.0", "optim.eps: -1.0 is invalid: use a small finite number >= 0, e.g. 1e-8"),
    ("optim.weight_decay=-0.1", "optim.weight_decay: -0.1 is invalid: use a finite number >= 0"),
    ("optim.lr=-1.0", "optim.lr: -1.0 is invalid: the learning rate must be a finite number > 0"),
    ("train.max_consecutive_skips=-1", "train.max_consecutive_skips: -1 is invalid: use >= 0 (0 stops at the first "
                                       "skipped step)"),
])
def test_out_of_range_values_fail_when_the_config_loads(override, expected):
    assert _error(load_config, KINDS["sft"], overrides=[override]) == f"--set {override}: {expected}"


def _float_leaves(cfg: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path of every float field in config `cfg`, also in its sections, in the items of a
    fixed-size float list (`optim.betas`, path (..., 0)) and in the sections of a list
    (`reward.sources`, path (..., 0, "weight"))."""
    out: list[tuple[Any, ...]] = []
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        tp, value, here = hints[f.name], getattr(cfg, f.name), path + (f.name,)
        if _is_float(tp):
            out.append(here)
        elif dataclasses.is_dataclass(value):
            out += _float_leaves(value, here)
        elif isinstance(value, tuple):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    out += _float_leaves(item, here + (i,))
                elif isinstance(item, float):
                    out.append(here + (i,))
    return out


def _non_finite_override(cfg: Any, path: tuple[Any, ...], value: float) -> str:
    """`--set KEY=VALUE` giving the float at `path` of `cfg` the value `value` (a whole list when
    the float sits in one, other items as they are)."""
    split = next((i for i, part in enumerate(path) if isinstance(part, int)), len(path))
    node: Any = cfg
    for part in path[:split]:
        node = getattr(node, part)
    if split == len(path):
        return f"{'.'.join(path)}={_flow(value)}"
    items = [dataclasses.asdict(item) if dataclasses.is_dataclass(item) else item for item in node]
    if split + 1 == len(path):
        items[path[split]] = value
    else:
        items[path[split]][path[split + 1]] = value
    return f"{'.'.join(path[:split])}={_flow(items)}"


def _float_fields_of_every_kind() -> list[tuple[str, tuple[Any, ...]]]:
    """(kind, path) of every float field of every config, each dotted path once."""
    seen, out = set(), []
    for kind in sorted(KINDS):
        for path in _float_leaves(KINDS[kind]()):
            if path not in seen:
                seen.add(path)
                out.append((kind, path))
    return out


def _dotted(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" if i else p for i, p in enumerate(path))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("kind, path", _float_fields_of_every_kind(),
                         ids=lambda x: x if isinstance(x, str) else _dotted(x))
def test_every_float_field_refuses_nan_and_inf(kind, path, value):
    # Loaded before wherever no range check caught them (reward.sources[0].weight, reward.missing_eos_penalty,
    # rs.min_score: any; lora.alpha, ppo.kl_target, optim.max_grad_norm, ...: inf), and turned losses into NaN.
    text = _non_finite_override(KINDS[kind](), path, value)
    tail = f"{value!r} is invalid: use a finite number"
    named = [f"{_dotted(path)}: {tail}"]
    if path[:2] == ("critic", "optim"):  # OptimConfig names its fields optim.*; the loader adds the section
        named.append(f"critic.optim: {_dotted(path[1:])}: {tail}")
    message = _error(load_config, KINDS[kind], overrides=[text])
    assert message in [f"--set {text}: {n}" for n in named]


def test_non_finite_floats_are_refused_wherever_they_come_from(tmp_path):
    fix = "is invalid: use a finite number"
    assert _error(load_config, KINDS["ppo"], overrides=["reward.missing_eos_penalty=.nan"]) == (
        f"--set reward.missing_eos_penalty=.nan: reward.missing_eos_penalty: nan {fix}")
    assert _error(load_config, KINDS["rs"], overrides=["rs.min_score=-1e999"]) == (  # text YAML leaves a string
        f"--set rs.min_score=-1e999: rs.min_score: -inf {fix}")
    assert _error(load_config, KINDS["sft"], data={"lora": {"alpha": math.inf}}) == f"<data>: lora.alpha: inf {fix}"
    path = tmp_path / "recipe.yaml"
    path.write_text("reward:\n  sources:\n    - rule: task\n      weight: .nan\n")
    assert _error(load_config, KINDS["ppo"], path).endswith(f": reward.sources[0].weight: nan {fix}")
    assert _error(load_config, KINDS["ppo"], path).startswith(str(path))
    from hpcrlhf.config.schema import RewardConfig, RewardSourceConfig

    with pytest.raises(ConfigError, match=r"^reward\.sources\[1\]\.weight: -inf is invalid"):  # built in Python
        RewardConfig(sources=(RewardSourceConfig(rule="task"), RewardSourceConfig(rule="task", weight=-math.inf)))


def test_task_too_small_for_its_splits_names_task_max_operand():
    from hpcrlhf.data.tasks import build_task

    cfg = load_config(KINDS["sft"], overrides=["task.max_operand=2"])  # was "ArithmeticTask with max_operand=2, ..."
    message = _error(build_task, cfg.task, cfg.data)
    assert message.startswith("task.max_operand: 2 is too small for task 'arithmetic' with task.seed 0 (")
    assert message.endswith("); raise task.max_operand, e.g. to 99")


_TEMPLATE_FIX = "the template must contain both {bucket} and {prompt}, and write a literal brace as {{ or }}"


@pytest.mark.parametrize("template, problem", [
    ("<{bucket}> {prompt} {x}", "unknown placeholder {x}"),  # loaded, then KeyError: 'x' in CSFTTrainer.condition
    ("{bucket} {prompt} {", "Single '{' encountered in format string"),  # loaded, then ValueError
    ("{{bucket}} {prompt}", "no {bucket} placeholder"),  # loaded, and never wrote the bucket into a prompt
    ("{bucket}{prompt:d}", "Unknown format code 'd' for object of type 'str'"),
])
def test_csft_template_is_checked_when_the_config_loads(template, problem):
    assert _error(load_config, KINDS["csft"], data={"csft": {"template": template}}) == (
        f"<data>: csft.template: {template!r} is invalid: {problem}; {_TEMPLATE_FIX}")


GOOD_PAIR = b'{"prompt": "1+2=", "chosen": "3", "rejected": "4"}\n'


def _rows_error(tmp_path: Path, name: str, content: bytes) -> tuple[Path, str]:
    from hpcrlhf.data.sources import read_rows

    path = tmp_path / name
    path.write_bytes(content)
    return path, _error(read_rows, str(path))


def test_bytes_that_are_not_utf8_are_named_by_line(tmp_path):
    # UnicodeDecodeError before, for the whole read (a text-mode reader decodes blocks, not lines).
    path, message = _rows_error(tmp_path, "pairs.jsonl", GOOD_PAIR + b'{"prompt": "\xff"}\n')
    assert message == f"{path}:2: not UTF-8 text (byte b'\\xff'); save the file as UTF-8"
    path, message = _rows_error(tmp_path, "pairs.json", b'[\n{"prompt": "\xff"}]')
    assert message == f"{path}:2: not UTF-8 text (byte b'\\xff'); save the file as UTF-8"


def test_json_python_cannot_parse_is_named_by_line(tmp_path):
    path, message = _rows_error(tmp_path, "long.jsonl", GOOD_PAIR + b'{"m": ' + b"1" * 5000 + b"}\n")  # was ValueError
    assert message.startswith(f"{path}:2: invalid JSON (Exceeds the limit (4300 digits) for integer string conversion")
    assert message.endswith("); write the number with fewer digits, or as a string")
    path, message = _rows_error(tmp_path, "deep.jsonl", GOOD_PAIR + b"[" * 100_000 + b"\n")  # was RecursionError
    assert message == f"{path}:2: invalid JSON (nested too deeply to parse); flatten the value"


def _load(tmp_path: Path, kind: str, lines: list[bytes], tokenizer: Any, **data: Any) -> str:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"".join(lines))
    cfg = load_config(KINDS[kind], data={**own_data_sections(kind), "data": {"train_path": str(path), **data}})
    return _error(load_kind, kind, cfg, tokenizer)


def test_lone_surrogate_is_named_by_file_line_and_field(tmp_path, tokenizer):
    # TypeError "TextEncodeInput must be Union[...]" from the Rust tokenizer before.
    message = _load(tmp_path, "dpo", [GOOD_PAIR, b'{"prompt": "1+2=\\ud800", "chosen": "3", "rejected": "4"}\n'], tokenizer)
    assert message == (f"{tmp_path / 'data.jsonl'}:2: field 'prompt' holds '\\ud800' at character 5, half of a UTF-16 "
                       "surrogate pair and no text; fix the text (its writer split an emoji or similar) or remove the row")


@pytest.mark.parametrize("kind, lines, option", [
    # OverflowError "int too large to convert to float" before (the margin, and the CSFT reward buckets).
    ("dpo", [b'{"prompt": "1+2=", "chosen": "3", "rejected": "4", "m": 1}\n',
             b'{"prompt": "1+2=", "chosen": "3", "rejected": "4", "m": 1' + b"0" * 400 + b"}\n"],
     {"margin_key": "m"}),
    ("csft", [b'{"prompt": "1+2=", "response": "3", "reward": 1}\n',
              b'{"prompt": "1+2=", "response": "4", "reward": 1' + b"0" * 400 + b"}\n"], {}),
])
def test_numbers_too_large_for_a_float_are_rejected(tmp_path, tokenizer, kind, lines, option):
    field = option.get("margin_key", "reward")
    assert _load(tmp_path, kind, lines, tokenizer, **option) == (
        f"{tmp_path / 'data.jsonl'}:2: field '{field}' (data.{'margin' if option else 'reward'}_key) must be a finite "
        "number, got an integer of 401 digits")


def test_csft_rewards_all_equal_names_the_file(tmp_path, tokenizer):
    # "data.reward_key 'reward': every reward is 1: ..." before: no file, so no way to tell which data.
    lines = [b'{"prompt": "1+2=", "response": "3", "reward": 1}\n',
             b'{"prompt": "2+2=", "response": "4", "reward": 1}\n']
    assert _load(tmp_path, "csft", lines, tokenizer) == (
        f"{tmp_path / 'data.jsonl'}: data.reward_key 'reward': every reward is 1: conditioning needs rewards "
        "that differ")


def test_kto_with_one_row_names_its_file(tmp_path, tokenizer):
    # "KTO needs at least 2 rows ..., got 1" before: no file, so no way to tell train from eval data.
    message = _load(tmp_path, "kto", [b'{"prompt": "1+2=", "completion": "3", "label": true}\n'], tokenizer)
    assert message == (f"{tmp_path / 'data.jsonl'}:1: the only row of its dataset; KTO needs at least 2 rows to pair "
                       "prompts with unrelated completions, got 1: add rows (or raise data.max_samples, task.train_size "
                       "or task.eval_size to 2 or more)")


def test_chat_template_asked_of_a_tokenizer_without_one(tmp_path, tokenizer):
    import copy

    base = copy.deepcopy(tokenizer)  # a base model's tokenizer: transformers raised a ValueError
    base.chat_template = None
    message = _load(tmp_path, "sft", [b'{"prompt": "1+2=", "response": "3"}\n'], base, apply_chat_template=True)
    assert message == (f"data.apply_chat_template: true, but the tokenizer of {base.name_or_path} has no chat template; "
                       "set data.apply_chat_template=false for a base model, or use a chat model")


PATH_SETTINGS = [(kind, key) for kind in sorted(JOB_CONFIGS)
                 for key in ("model.path", "data.train_path", "data.eval_path", "checkpoint.resume", "output_dir")]
PATH_SETTINGS += [("dpo", "reference.path"), ("ppo", "reference.path"), ("ppo", "critic.path"),
                  ("ppo", "reward.sources[0].model"), ("generate", "model.path"), ("generate", "data.train_path"),
                  ("generate", "output")]


@pytest.mark.parametrize("kind, key", PATH_SETTINGS)
def test_every_path_setting_refuses_an_empty_value(kind, key):
    """`--set data.train_path=$DATA` with DATA unset trained on the bundled task, rc=0 (issue 36)."""
    section, _, field = key.partition("[0].")
    override = "reward.sources=[{model: ''}]" if field else f"{key}="
    assert _error(load_config, KINDS[kind], overrides=[override]) == (
        f"--set {override}: {key}: '' is an empty path (an unset shell variable?): give the file or folder, or leave "
        "the setting out for its default")


def test_an_empty_data_path_stops_train_before_the_run_folder(tmp_path, capsys):
    from hpcrlhf.cli import main

    run = tmp_path / "run"
    assert main(["train", "sft", "--set", "data.train_path=", "-o", str(run)]) == 2
    assert "data.train_path: '' is an empty path (an unset shell variable?)" in capsys.readouterr().err
    assert not run.exists()


@pytest.mark.parametrize("make, expected", [
    (lambda tmp: "/dev/zero", "recipe file '/dev/zero' is a character device, not a YAML file: give the recipe's file"),
    (lambda tmp: _file(tmp / "big.yaml", b"#" * (2 << 20)),
     "is 2,097,152 bytes, more than the 1 MiB a recipe may have (a recipe is a few KB of settings): is it the right "
     "file?"),
    (lambda tmp: _pipe(tmp / "pipe.yaml", b"#" * (2 << 20)),
     "gives more than the 1 MiB a recipe may have (a recipe is a few KB of settings): is it the right file?"),
])
def test_a_recipe_is_read_only_up_to_its_bound(tmp_path, capsys, make, expected):
    """`--config /dev/zero` read until the memory ran out (issue 36)."""
    from hpcrlhf.cli import main

    assert main(["config", "sft", "--config", make(tmp_path)]) == 2
    assert expected in capsys.readouterr().err


def test_a_recipe_through_a_pipe_still_loads(tmp_path):
    """`--config <(generate-recipe)`: a pipe has no size, and is read up to the bound."""
    assert load_config(KINDS["sft"], _pipe(tmp_path / "pipe.yaml", b"seed: 7\n")).seed == 7


def _file(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _pipe(path: Path, data: bytes) -> str:
    """A named pipe a thread writes `data` into (it stops when the reader closes the pipe early)."""
    import os
    import threading

    os.mkfifo(path)

    def feed() -> None:
        try:
            with open(path, "wb") as f:
                f.write(data)
        except BrokenPipeError:
            pass

    threading.Thread(target=feed, daemon=True).start()
    return str(path)
