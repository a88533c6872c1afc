"""Reading rows from data files, dataset folders and hub datasets.

Every row keeps its origin (`train.jsonl:17`, `data.parquet: row 17`) so that a bad row is
reported where the user can find it. Field checks (`require_text`) happen once, up front, before
any model is loaded.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from collections.abc import Iterable, Sequence

from hpcrlhf.errors import DataError
from hpcrlhf.hub import hub_problem, is_hub_id

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


@dataclass(frozen=True)
class Row:
    """One data row and where it came from."""

    data: dict[str, Any]
    origin: str


def rows_from_records(records: Iterable[dict], source: str) -> list[Row]:
    """Wrap in-memory records (e.g. the bundled task's) as rows numbered from 1."""
    return [Row(dict(r), f"{source}: row {i}") for i, r in enumerate(records, start=1)]


def read_rows(spec: str, *, split: str = "train", limit: int | None = None) -> list[Row]:
    """Rows of a local file, a `datasets` folder, or a hub dataset name.

    JSON Lines is read line by line so errors name the line; other formats go through `datasets`
    and name the row number.
    """
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix == ".jsonl":
            rows = _read_jsonl(path, limit)
        elif path.suffix == ".json":
            rows = _read_json(path)
        elif path.suffix in FILE_FORMATS:
            rows = _read_with_datasets(FILE_FORMATS[path.suffix], str(path), str(path), split="train")
        else:
            raise DataError(f"{path}: unknown data file type '{path.suffix}'; use one of {', '.join(FILE_FORMATS)}")
    elif path.is_dir():
        rows = _read_saved_dataset(path, split)
    elif path.exists():  # a device, a pipe or a socket: nothing hpcrlhf reads rows from
        raise DataError(f"data path '{spec}' is not a regular file or a folder; give a data file "
                        f"({', '.join(FILE_FORMATS)}) or a dataset folder")
    elif _looks_local(spec):
        raise DataError(f"data path '{spec}' does not exist")
    else:
        rows = _read_hub(spec, split)
    if not rows:
        raise DataError(f"{spec}: no rows found")
    return rows[:limit] if limit is not None else rows


def require_text(rows: Sequence[Row], keys: Sequence[str], *, key_option: dict[str, str] | None = None) -> None:
    """Check that every row has a non-empty string for each key; report the first bad row.

    `key_option` maps a key to the config option that names it, so the error can say how to
    point hpcrlhf at the right field.
    """
    key_option = key_option or {}
    for row in rows:
        for key in keys:
            hint = f" (or set {key_option[key]} to the field that holds it)" if key in key_option else ""
            if key not in row.data:
                have = ", ".join(sorted(row.data)) or "none"
                raise DataError(f"{row.origin}: field '{key}' is missing; the row has: {have}{hint}")
            value = row.data[key]
            if not isinstance(value, str):
                raise DataError(f"{row.origin}: field '{key}' must be a string, got {brief(value)} ({type(value).__name__})")
            if not value.strip():
                raise DataError(f"{row.origin}: field '{key}' is empty; remove the row or fill it in")
            _require_encodable(row, key, value)


def _require_encodable(row: Row, key: str, value: str) -> None:
    """Reject text with a lone UTF-16 surrogate (JSON allows `"\\ud800"`): it is no character,
    and a tokenizer fails on it deep inside its Rust code with a TypeError."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{row.origin}: field '{key}' holds {value[e.start]!r} at character {e.start + 1}, half of a "
                        "UTF-16 surrogate pair and no text; fix the text (its writer split an emoji or similar) "
                        "or remove the row") from None


def require_number(rows: Sequence[Row], key: str, *, option: str) -> None:
    """Check that every row has a finite number (not a bool) under `key`."""
    for row in rows:
        value = row.data.get(key)
        if key not in row.data:
            raise DataError(f"{row.origin}: field '{key}' is missing (set by {option}); the row has: "
                            f"{', '.join(sorted(row.data)) or 'none'}")
        if not _is_finite_number(value):
            raise DataError(f"{row.origin}: field '{key}' ({option}) must be a finite number, got {brief(value)}")


def _is_finite_number(value: Any) -> bool:
    """An int or float that is finite as a float: JSON integers have no size limit, and one past
    1.8e308 would overflow wherever rewards or margins become floats."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def brief(value: Any) -> str:
    """A bad value as a message shows it: its repr, cut to 60 characters (a field may hold a
    whole document, and a JSON integer thousands of digits)."""
    if isinstance(value, int) and abs(value) >= 10**60:
        return f"an integer of {math.floor(math.log10(abs(value))) + 1} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def require_label(rows: Sequence[Row], key: str, *, option: str) -> None:
    """Check that every row has a boolean label (true/false, or 1/0) under `key`."""
    for row in rows:
        if key not in row.data:
            raise DataError(f"{row.origin}: field '{key}' is missing (set by {option}); the row has: "
                            f"{', '.join(sorted(row.data)) or 'none'}")
        if row.data[key] not in (True, False):  # 1 and 0 compare equal to True and False
            raise DataError(f"{row.origin}: field '{key}' ({option}) must be true or false (desirable or not), "
                            f"got {brief(row.data[key])}")


def require_distinct(rows: Sequence[Row], a: str, b: str) -> None:
    """Check that fields `a` and `b` differ in every row (a preference pair needs two answers)."""
    for row in rows:
        if row.data[a].strip() == row.data[b].strip():
            raise DataError(f"{row.origin}: '{a}' and '{b}' are identical ({row.data[a]!r}); a preference pair "
                            "needs two different responses: fix or remove the row")


def _looks_local(spec: str) -> bool:
    """Hub names are `name` or `org/name` (`hpcrlhf.hub.is_hub_id`); anything else that does not exist
    is a missing path."""
    return spec.startswith(("/", ".", "~")) or Path(spec).suffix in FILE_FORMATS or not is_hub_id(spec)


MAX_LINE_CHARS = 1 << 26
"""The longest JSON Lines row read (64 Mi characters): a line is read whole before it is parsed, and one
row is one example (a prompt and its responses), far shorter. A file without line breaks would fill the
memory first."""


def _read_jsonl(path: Path, limit: int | None) -> list[Row]:
    rows = []
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE_CHARS + 1), ""), start=1):
                if len(line) > MAX_LINE_CHARS and not line.endswith("\n"):
                    raise DataError(f"{path}:{lineno}: a line of more than {MAX_LINE_CHARS:,} characters; a "
                                    "JSON Lines row is one example, far shorter: is it a JSON Lines file (one object "
                                    "per line)?")
                if not line.strip():
                    continue
                obj = _parse_json(line, path, lineno)
                if not isinstance(obj, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object per line, got {type(obj).__name__}")
                rows.append(Row(obj, f"{path}:{lineno}"))
                if limit is not None and len(rows) >= limit:
                    break
    except OSError as e:
        raise DataError(f"{path}: cannot read the data file: {e.strerror or e}") from None
    return rows


def _open_text(path: Path) -> TextIO:
    """`path` as text in which a byte that is not UTF-8 becomes a lone surrogate (U+DC80-U+DCFF).

    A strict decoder fails on a whole block of the file, before the lines in it are read, with a
    UnicodeDecodeError that names no line; escaped, the byte is found on its line by
    `_parse_json`. (A JSON escape such as `\\udcff` is six characters of text, not a surrogate.)
    """
    return path.open(encoding="utf-8-sig", errors="surrogateescape")


_UNDECODED = re.compile("[\udc80-\udcff]")


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """json's `object_pairs_hook`: an object as a dict, refusing a key it holds twice (json would keep only the
    last value, and a row's `prompt` or `chosen` would silently be the other one)."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)  # built once: a decoder per line costs more than the line


def _row_holding_twice(text: str) -> int | None:
    """The number of the row of a whole .json file (a list, or {"data": [...]}) whose object holds a key
    twice: read again, only once a duplicate was found, marking each such object."""
    twice: list[dict] = []

    def mark(pairs: list[tuple[str, Any]]) -> dict:
        obj = dict(pairs)
        if len(obj) < len(pairs):
            twice.append(obj)
        return obj

    value = json.loads(text, object_pairs_hook=mark)
    rows = value.get("data") if isinstance(value, dict) else value
    return next((i for i, row in enumerate(rows, 1) if _holds(row, twice[0])), None) if isinstance(rows, list) else None


def _holds(value: Any, target: dict) -> bool:
    """Whether `value` is `target` or holds it (at any depth)."""
    if value is target:
        return True
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return any(_holds(item, target) for item in items)


def _parse_json(text: str, path: Path, lineno: int | None = None) -> Any:
    """The JSON value of `text`, or a DataError naming the file and the line: `lineno` for a
    line of a JSON Lines file, else the line of the whole file where reading failed.

    Besides malformed JSON, Python's parser refuses an integer of more than 4300 digits
    (ValueError) and nesting deeper than its recursion limit (RecursionError).
    """
    undecoded = _UNDECODED.search(text)
    if undecoded:
        line = lineno or text.count("\n", 0, undecoded.start()) + 1
        byte = bytes([ord(undecoded.group()) - 0xDC00])
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {byte!r}); save the file as UTF-8")
    where = f"{path}:{lineno}" if lineno else str(path)
    try:
        return _DECODER.decode(text)
    except _DuplicateKey as e:
        row = None if lineno else _row_holding_twice(text)
        raise DataError(f"{where}{f': row {row}' if row else ''}: duplicate key {e.key!r} (JSON would silently keep "
                        "only its last value); remove one of them") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno or e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    except ValueError as e:  # an integer literal too long for Python to convert
        raise DataError(f"{where}: invalid JSON ({e}); write the number with fewer digits, or as a string") from None
    except RecursionError:
        raise DataError(f"{where}: invalid JSON (nested too deeply to parse); flatten the value") from None


def _read_json(path: Path) -> list[Row]:
    try:
        with _open_text(path) as f:
            text = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read the data file: {e.strerror or e}") from None
    obj = _parse_json(text, path)
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):
        obj = obj["data"]
    if not isinstance(obj, list):
        raise DataError(f"{path}: expected a JSON list of objects (or {{\"data\": [...]}}), got {type(obj).__name__}")
    rows = []
    for i, item in enumerate(obj, start=1):
        if not isinstance(item, dict):
            raise DataError(f"{path}: row {i}: expected an object, got {type(item).__name__}")
        rows.append(Row(item, f"{path}: row {i}"))
    return rows


def _read_with_datasets(kind: str, data_files: str, label: str, split: str) -> list[Row]:
    import datasets

    try:
        ds = datasets.load_dataset(kind, data_files=data_files, split=split)
    except Exception as e:  # datasets raises many types for unreadable files
        raise DataError(f"{label}: cannot read as {kind}: {e}") from None
    return rows_from_records(ds, label)


def _read_saved_dataset(path: Path, split: str) -> list[Row]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(f"{path}: not a dataset folder saved by `datasets.save_to_disk` ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: split '{split}' not found; available: {', '.join(ds)} (set data.split)")
        ds = ds[split]
    return rows_from_records(ds, f"{path}[{split}]")


def _read_hub(name: str, split: str) -> list[Row]:
    """A hub dataset, once `hpcrlhf.hub` says the hub can provide it: datasets would otherwise retry an
    unreachable hub for about 30 s before an error that no longer says `name` was also no local path."""
    why = hub_problem(name, "dataset")
    if why:
        raise DataError(f"data '{name}' is neither a local file or folder (nothing at {Path(name).absolute()}) nor a "
                        f"hub dataset: {why}; give the path of a data file ({', '.join(FILE_FORMATS)}) or a dataset "
                        "folder (copy hub datasets to shared storage first), or a hub name where the hub can be reached")
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:
        raise DataError(f"data '{name}' is not a local file or folder and could not be loaded from the hub: {e}") from None
    return rows_from_records(ds, f"{name}[{split}]")
