"""Experience: what one rollout leaves for the PPO updates, one sequence at a time, and the
replay buffer that hands it out in mini-batches.

Per-token fields are 1-D tensors aligned with the model's logits (see `data.batching`): position
t holds the numbers of the action "emit token t+1", so `labels[t]` is that token (or -100 where
t+1 is a prompt token or padding) and `action_mask = labels != -100`. The value at t is the
critic's estimate for the state that ends at token t, which is exactly the state the action at t
is taken from.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator, Optional

import torch

from hpcrlhf.algos.logprobs import IGNORE


@dataclass
class Experience:
    input_ids: torch.Tensor
    """Prompt + response tokens (L,)."""
    labels: torch.Tensor
    """The action taken at each position (L,), -100 where none."""
    old_logps: torch.Tensor
    """Actor log-probs of the actions when the experience was made (the PPO ratio's denominator)."""
    advantages: torch.Tensor
    returns: torch.Tensor
    """Value targets (critic) -- for critic-free estimators the same as the advantages."""
    values: Optional[torch.Tensor] = None
    """Critic values when the experience was made (value clipping)."""
    ref_logps: Optional[torch.Tensor] = None
    """Reference log-probs (a KL term in the loss)."""
    is_weights: Optional[torch.Tensor] = None
    """Truncated importance weights of the actions (ppo.tis_cap), multiplying the policy loss."""


@dataclass
class ExperienceBatch:
    """Experiences as right-padded (B, T) tensors, one per `Experience` field, plus each row's
    length: how a rollout's experience is made and how it crosses between processes (a handful of
    tensors, not one object per sequence)."""

    tensors: dict[str, Optional[torch.Tensor]]
    lengths: list[int]

    def __len__(self) -> int:
        return len(self.lengths)

    def rows(self) -> list[Experience]:
        """One Experience per row, trimmed to its length."""
        names = {f.name for f in fields(Experience)}
        return [Experience(**{k: (v[i, :n].clone() if v is not None else None) for k, v in self.tensors.items()
                              if k in names}) for i, n in enumerate(self.lengths)]

    def shard(self, start: int, stop: int) -> "ExperienceBatch":
        """Rows [start, stop), padding cut to their longest row."""
        lengths = self.lengths[start:stop]
        width = max(lengths, default=0)
        return ExperienceBatch({k: (v[start:stop, :width].clone() if v is not None else None)
                                for k, v in self.tensors.items()}, lengths)


def collate_experience(items: list[Experience], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded batch of experiences: model inputs plus every per-token field."""
    width = max(len(e.input_ids) for e in items)
    out: dict[str, torch.Tensor] = {}
    for f in fields(Experience):
        if getattr(items[0], f.name) is None:
            continue
        fill = pad_id if f.name == "input_ids" else IGNORE if f.name == "labels" else 0
        first = getattr(items[0], f.name)
        t = torch.full((len(items), width), fill, dtype=first.dtype)
        for i, e in enumerate(items):
            v = getattr(e, f.name)
            t[i, : len(v)] = v
        out[f.name] = t.to(device)
    lengths = torch.tensor([len(e.input_ids) for e in items])
    out["attention_mask"] = (torch.arange(width)[None, :] < lengths[:, None]).long().to(device)
    out["action_mask"] = out["labels"] != IGNORE
    return out


class ReplayBuffer:
    """This rank's experiences. `limit` = 0 keeps only the latest rollout; a larger limit keeps
    that many most recent sequences, so older experience is replayed next to the new."""

    def __init__(self, limit: int = 0):
        self.limit = limit
        self.items: list[Experience] = []

    def add(self, items: list[Experience]) -> None:
        self.items = items if self.limit == 0 else (self.items + items)[-max(self.limit, len(items)) :]

    def __len__(self) -> int:
        return len(self.items)

    def minibatches(self, num_batches: int, batch_rows: int, generator: torch.Generator) -> Iterator[list[Experience]]:
        """`num_batches` mini-batches of `batch_rows` experiences, drawn without replacement from
        the buffer (a random permutation, so every rank's batches have the same size)."""
        order = torch.randperm(len(self.items), generator=generator).tolist()
        for b in range(num_batches):
            yield [self.items[i] for i in order[b * batch_rows : (b + 1) * batch_rows]]

    def save(self, folder: Path, rank: int) -> None:
        """Into a checkpoint folder (kept only when the buffer outlives a rollout, limit > 0)."""
        if self.limit:
            torch.save(self.state_dict(), folder / f"replay_rank{rank}.pt")

    def load(self, folder: Path, rank: int) -> None:
        path = folder / f"replay_rank{rank}.pt"
        if self.limit and path.exists():
            self.load_state_dict(torch.load(path, weights_only=False))

    def state_dict(self) -> dict:
        return {"limit": self.limit, "items": [vars(e) for e in self.items]}

    def load_state_dict(self, state: dict) -> None:
        self.limit = state["limit"]
        self.items = [Experience(**d) for d in state["items"]]
