"""Building node maps from shipped recipes (or defaults) with overrides, and reading the problems
of a rejected one."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.errors import PlacementError
from hpcrlhf.placement import NodeMap, build_node_map

RECIPES = Path(__file__).resolve().parents[2] / "hpcrlhf" / "recipes"


def config(recipe: str | None = None, *overrides: str) -> PPOConfig:
    return load_config(PPOConfig, RECIPES / f"{recipe}.yaml" if recipe else None, overrides)


def plan(recipe: str | None = None, *overrides: str, nodes: int | None = None, gpus: int | None = None) -> NodeMap:
    return build_node_map(config(recipe, *overrides), nodes, gpus)


def problems(recipe: str | None = None, *overrides: str, nodes: int | None = None,
             gpus: int | None = None) -> tuple[str, ...]:
    """The problems a layout is rejected with (one line each: `key = value: reason; fix: ...`)."""
    with pytest.raises(PlacementError) as info:
        plan(recipe, *overrides, nodes=nodes, gpus=gpus)
    assert len(info.value.problems) >= 1
    for i, problem in enumerate(info.value.problems, 1):  # the message lists every one of them
        assert f"{i}. {problem.partition(': ')[0]}" in str(info.value)
    return info.value.problems


def find(found: tuple[str, ...], start: str, *needles: str) -> str:
    """The one problem starting with `start` (its key = value) that contains every needle."""
    matches = [p for p in found if p.startswith(start) and all(n in p for n in needles)]
    assert matches, f"no problem starting {start!r} with {needles}; problems:\n" + "\n".join(found)
    return matches[0]
