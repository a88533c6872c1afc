"""The settings reference: each job kind's settings as a markdown page, generated from the typed config.

`hpcrlhf config KIND --markdown` prints one page; `python -m hpcrlhf.config.reference DIR` (or
`make docs`) writes every kind's page and an index into DIR. docs/settings/ holds the pages, and
tests/test_docs.py fails when they differ from what this module generates now, so the reference
cannot drift from the dataclasses. The walk over fields, docs and defaults is `loader.settings`,
the one `describe` (`hpcrlhf config KIND`) prints as commented YAML; this module only lays it out:
one heading per section, one table row per setting (key, type, default, documentation), with the
fields of a list of sections (`reward.sources[].rule`) and of an optional section (generate's
`reward`) as rows of their own.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml

from hpcrlhf.config.loader import NonEmpty, Setting, _plain, settings
from hpcrlhf.config.schema import JOB_CONFIGS, EvalJobConfig, GenerateConfig, ServeRewardConfig

REGENERATE = "python -m hpcrlhf.config.reference docs/settings"
"""The command that rewrites docs/settings/ (named on every page and by the test that checks them)."""


COMMANDS = ("generate", "eval", "serve-reward")
"""The configs of commands of their own, beside `hpcrlhf train KIND`."""


def config_classes() -> dict[str, type]:
    """Every config the CLI builds from a recipe: `hpcrlhf train KIND`, `generate` and `serve-reward`."""
    return {**JOB_CONFIGS, "generate": GenerateConfig, "eval": EvalJobConfig, "serve-reward": ServeRewardConfig}


def command(kind: str) -> str:
    return f"hpcrlhf {kind}" if kind in COMMANDS else f"hpcrlhf train {kind}"


def markdown(kind: str, cfg: Any = None) -> str:
    """The page of `kind`: its declared defaults, or with `cfg` (recipe and `--set` applied) its values."""
    cls = config_classes()[kind]
    column = "default" if cfg is None else "value"
    where = (f"Generated from the typed config by `hpcrlhf config {kind} --markdown`; do not edit by hand: "
             f"`{REGENERATE}` rewrites every page." if cfg is None else
             "The values of the config given by `--config`/`--set`.")
    lines = [f"# `{kind}` settings", "",
             f"Every setting of `{command(kind)}` with its type, {column} and documentation.", "",
             where + " Set one with `--set section.key=value` or in a YAML recipe (`--config`); how settings "
             "combine: [running-jobs.md](../running-jobs.md#settings).", ""]
    sections = _sections(cls, cfg)
    if len(sections) > 1:
        lines += ["Sections: " + ", ".join(f"[`{_key(path)}`](#{_anchor(path)})" for path in sections if path), ""]
    for path, (doc, rows) in sections.items():
        if path:
            lines += ["#" * (len(path) + 1) + f" `{_key(path)}`", ""] + ([_cell(doc), ""] if doc else [])
        elif rows:
            lines += ["## Top level", ""]
        if rows:
            lines += [f"| key | type | {column} | documentation |", "| --- | --- | --- | --- |", *rows, ""]
        elif path:
            lines += ["No settings.", ""]
    return "\n".join(lines)


def index() -> str:
    lines = ["# Settings reference", "",
             "Every setting of every job kind, with its type, default and documentation, generated from the "
             "typed config.", "",
             f"`hpcrlhf config KIND` prints the same as commented YAML, `hpcrlhf config KIND --markdown` as one of "
             f"these pages; `{REGENERATE}` (or `make docs`) rewrites them all. How settings combine (defaults, "
             "recipe, `--set`): [running-jobs.md](../running-jobs.md#settings).", "",
             "| kind | command | what it is |", "| --- | --- | --- |"]
    for kind, cls in config_classes().items():
        summary = " ".join(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].split())
        lines.append(f"| [`{kind}`]({kind}.md) | `{command(kind)}` | {_cell(summary)} |")
    return "\n".join(lines) + "\n"


def pages() -> dict[str, str]:
    """File name -> text of every page of docs/settings/."""
    return {"index.md": index(), **{f"{kind}.md": markdown(kind) for kind in config_classes()}}


def write_pages(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in pages().items():
        (folder / name).write_text(text, encoding="utf-8")
        written.append(folder / name)
    return written


def _sections(cls: type, cfg: Any) -> dict[tuple[str, ...], tuple[str, list[str]]]:
    """Section path -> (its documentation, its table rows), the top level (`()`) first."""
    sections: dict[tuple[str, ...], tuple[str, list[str]]] = {(): ("", [])}
    _add(settings(cls, cfg), sections)
    return sections


def _add(walk: typing.Iterable[Setting], sections: dict[tuple[str, ...], tuple[str, list[str]]]) -> None:
    for setting in walk:
        if setting.section:
            sections[setting.path] = (setting.doc, [])
            continue
        rows = sections[setting.path[:-1]][1]
        rows.append(_row(setting))
        item = _section_in(setting.annotation, (tuple, list))
        if item is not None:  # a list of sections (`reward.sources`): one entry's fields, in the list's table
            entry = setting.path[:-1] + (setting.path[-1] + "[]",)
            rows += [_row(field) for field in settings(item, None, entry) if not field.section]
        optional = _section_in(setting.annotation, (Union, types.UnionType))
        if optional is not None and setting.value is None:  # generate's `reward: null`: its fields when given
            sections[setting.path] = (setting.doc + " Null by default; its settings when given:", [])
            _add(settings(optional, None, setting.path), sections)


def _row(setting: Setting) -> str:
    return (f"| `{_key(setting.path)}` | {_cell(_type(setting.annotation))} | {_code(setting.value)} | "
            f"{_cell(setting.doc)} |")


def _key(path: tuple[str, ...]) -> str:
    return ".".join(path)


def _anchor(path: tuple[str, ...]) -> str:
    """GitHub's anchor of the heading `` `a.b_c` ``: lower case, punctuation but `_` and `-` dropped."""
    return re.sub(r"[^\w-]", "", _key(path).lower())


def _cell(text: str) -> str:
    """`text` in one table cell: lines joined, `|` escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _code(value: Any) -> str:
    """`value` as YAML in a code span (flow style, one line), as a recipe would write it."""
    text = _yaml(_plain(value))
    ticks = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}".replace("|", "\\|")


def _yaml(value: Any) -> str:
    """`value` as one line of flow-style YAML."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, allow_unicode=True, width=10**9).strip()
    return text.removesuffix("...").strip()


def _type(tp: Any) -> str:
    """A reader's name of annotation `tp`: `int or null`, `one of `a`, `b``, `list of str`, `path`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return "path" if any(isinstance(mark, NonEmpty) for mark in args[1:]) else _type(args[0])
    if origin is Literal:
        return "one of " + ", ".join(f"`{_yaml(choice)}`" for choice in args)
    if origin in (Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        text = " or ".join(_type(a) for a in kept)
        return text + " or null" if len(kept) < len(args) else text
    if origin in (tuple, list):
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            if dataclasses.is_dataclass(args[0]):
                return "list of mappings (their keys: the `[]` rows)"
            inner = _type(args[0])
            return f"list of ({inner})" if " " in inner else f"list of {inner}"
        return "[" + ", ".join(_type(a) for a in args) + "]"
    if origin is dict:
        return f"mapping of {_type(args[0])} to {_type(args[1])}"
    if tp is Any:
        return "any"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _section_in(tp: Any, origins: tuple[Any, ...]) -> type | None:
    """The section class X of `tuple[X, ...]`/`list[X]` (origins tuple, list) or `X | None` (a union),
    else None."""
    if typing.get_origin(tp) not in origins:
        return None
    kept = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis]
    return kept[0] if len(kept) == 1 and dataclasses.is_dataclass(kept[0]) else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print(f"usage: python -m hpcrlhf.config.reference DIR  (writes the settings reference pages; "
              f"docs/settings is the checked-in one: {REGENERATE})", file=sys.stderr)
        return 2
    for path in write_pages(Path(args[0])):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
