"""The checks every config section runs in its `__post_init__`, and the helpers they share.

A failed check is a `ConfigError` naming the dotted key, the value (cut to 80 characters) and the
fix: `require(ok, key, value, fix)`. The loader adds where the value came from (recipe line,
`--set`), so every message reads `recipe.yaml:12: optim.lr: -1.0 is invalid: ...`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import fields, is_dataclass
from typing import Annotated

from hpcrlhf.config.loader import NonEmpty
from hpcrlhf.errors import ConfigError

PathText = Annotated[str, NonEmpty()]
"""A setting that names a file or folder: the loader refuses an empty value (an unset shell variable)."""


def require(ok: bool, key: str, value: object, fix: str) -> None:
    """Unless `ok`: the ConfigError `KEY: VALUE is invalid: FIX`."""
    if not ok:
        raise ConfigError(f"{key}: {shown(value)} is invalid: {fix}")


def shown(value: object) -> str:
    """`repr(value)` for a message, cut to 80 characters. An int from a recipe has no size limit,
    and Python refuses to print one of more than 4300 digits (ValueError)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**60:
        return f"<{'minus ' if value < 0 else ''}an integer of {math.floor(math.log10(abs(value))) + 1} digits>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def require_finite(section: object, key: str) -> None:
    """Every float of config dataclass `section` (dotted name `key`) is finite, also inside its
    lists (`optim.betas[1]`) and the sections of its lists (`reward.sources[0].weight`: a source
    does not know its index). Range checks let Inf through (`inf > 0`), fields without one NaN
    too. Called first in the `__post_init__` of each section with float fields, so NaN and Inf get
    this message; nested sections check their own fields."""
    for f in fields(section):
        require_finite_value(getattr(section, f.name), f"{key}.{f.name}")


def require_finite_value(value: object, key: str) -> None:
    if isinstance(value, float):
        require(math.isfinite(value), key, value, "use a finite number")
    elif isinstance(value, tuple):
        for i, item in enumerate(value):
            if is_dataclass(item):
                require_finite(item, f"{key}[{i}]")
            else:
                require_finite_value(item, f"{key}[{i}]")


def require_timeout(value: float, key: str) -> None:
    require_finite_value(value, key)
    require(value > 0, key, value, "use a positive number of seconds, e.g. 300")


def largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of `n` (>= 1) that is at most `cap`."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def fill_derived(cfg: object, section: str, **values: object) -> None:
    """Fill derived values into a section of a config being built (its `__post_init__`): the section
    is rebuilt (and checked again) with them; values equal to the section's are left alone."""
    current = getattr(cfg, section)
    changed = {k: v for k, v in values.items() if getattr(current, k) != v}
    if changed:
        object.__setattr__(cfg, section, dataclasses.replace(current, **changed))
