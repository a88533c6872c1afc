"""How an error message quotes a value and a key path: `'fast' (str)`, `optim.betas[1]`.

A message shows at most 80 characters of a value; values from YAML anchors or Python may be huge or
refer to themselves, so they are cut before they are converted (`brief`).
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import math
from collections.abc import Mapping
from typing import Any


def show(value: Any) -> str:
    """A bad value as messages quote it: `'fast' (str)`, `3 (int)`, `null`."""
    if value is None:
        return "null"
    if isinstance(value, (bool, datetime.date)):  # as written in YAML: true, 2024-01-01
        text = str(value).lower() if isinstance(value, bool) else value.isoformat()
    else:
        text = clip(repr(brief(value)))
    kind = "mapping" if isinstance(value, Mapping) else "list" if isinstance(value, list) else type(value).__name__
    return f"{text} ({kind})"


class Shown:
    """Text that stands in for a value in a message (`...` for what `brief` left out)."""

    def __init__(self, text: str = "..."):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def clip(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."


def brief(value: Any, depth: int = 4, width: int = 10) -> Any:
    """`value` as plain Python for a message, cut after `depth` levels and `width` items a level.

    A message shows at most 80 characters of a value, but YAML anchors can make a small recipe
    hold a huge value (each level aliasing the one below several times) or, from Python, a
    self-referencing one: converting all of it first would hang or never end.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**60:
        # Python refuses to print an int of more than 4300 digits (ValueError); 60 are unreadable already
        return Shown(f"<{'minus ' if value < 0 else ''}an integer of {math.floor(math.log10(abs(value))) + 1} digits>")
    if not isinstance(value, (Mapping, list, tuple)):
        return value
    if depth == 0:
        return Shown()
    if isinstance(value, Mapping):
        out: Any = {key: brief(item, depth - 1, width) for key, item in itertools.islice(value.items(), width)}
        if len(value) > width:
            out[Shown()] = Shown()
        return out
    out = [brief(item, depth - 1, width) for item in value[:width]]
    return out + [Shown()] if len(value) > width else out


def dotted(path: tuple[Any, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out
