"""Problems found while building a node map: collected, never raised one at a time, so a user
fixing a layout sees everything wrong with it at once."""

from __future__ import annotations

from dataclasses import dataclass

from hpcrlhf.errors import PlacementError


@dataclass(frozen=True)
class Problem:
    """One reason a node map cannot work: the setting at fault, its value, why, and the fix."""

    key: str
    """The config field (`placement.vllm.engines`) or `placement` for the layout as a whole."""
    value: object
    """Its value as shown (paths quoted by the caller: `'meta-llama/Llama-2-7b-hf'`)."""
    reason: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key} = {self.value}: {self.reason}; fix: {self.fix}"


def raise_problems(problems: list[Problem], where: str = "", *, title: str = "") -> None:
    """Raise one PlacementError listing every problem (nothing when there are none), under `title`
    (default: the node map for `where` cannot work)."""
    if not problems:
        return
    title = title or f"the node map for {where} cannot work"
    lines = [f"{title} ({len(problems)} problem{'s' * (len(problems) > 1)}):"]
    for i, problem in enumerate(problems, 1):
        lines += [f"{i}. {problem.key} = {problem.value}: {problem.reason}", f"   fix: {problem.fix}"]
    raise PlacementError("\n".join(lines), tuple(str(p) for p in problems))
