"""What a rule scores: one generated response with its prompt's dataset row (`Response`), and what
every rule is to its callers (`Scorer`: one number per response). The built-in rules and the
function rules (`hpcrlhf.rewards.rules`) both build on these, so they live apart from either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol
from collections.abc import Mapping, Sequence

from hpcrlhf.data.sources import brief
from hpcrlhf.errors import RuleError


@dataclass(frozen=True)
class Response:
    """One generated response, as the reward sources see it."""

    prompt: str
    text: str
    """The decoded response (special tokens removed)."""
    sequence_ids: tuple[int, ...]
    """Prompt + response token ids (EOS included when generated); empty where only the text is
    scored (evaluation metrics)."""
    row: Mapping[str, Any]
    """The prompt's dataset row."""
    origin: str = ""
    """Where that row came from (`prompts.jsonl:17`, `task:arithmetic[eval]: row 3`); empty if unknown."""
    episode: Any = None
    """A multi-turn trajectory's record (`hpcrlhf.agents.record.EpisodeRecord`: its environment's
    rewards, status, turns); None for a single response. `text` is then the whole transcript after
    the prompt, the environment's answers included."""


class Scorer(Protocol):
    """What every rule is to its callers: one number per response."""

    label: str
    """What the errors call it: the config field and the rule (`reward.sources[1].rule 'math'`)."""

    def scores(self, responses: Sequence[Response]) -> list[float]: ...


def row_value(label: str, r: Response, key: str, setting: str) -> Any:
    """Field `key` (named by the setting `setting`) of the row of response `r`; a RuleError naming
    the rule, the row and the field when the row has none."""
    if key not in r.row:
        where = f" ({r.origin})" if r.origin else ""
        raise RuleError(f"{label}: the row of prompt {brief(r.prompt)}{where} has no field {key!r} ({setting}); "
                        f"its fields: {', '.join(map(repr, r.row)) or 'none'}. Add it to every row, or set {setting} to "
                        "the field that holds it")
    return r.row[key]
