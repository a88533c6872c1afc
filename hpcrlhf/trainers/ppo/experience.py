"""The batch a PPO step passes around (`ExperienceBatch`): a rollout's sequences (`rollout_batch`),
then the roles' numbers for their tokens, then the experience the updates learn from; one
`Experience` per sequence, and the replay buffer that hands them out in mini-batches.

Per-token fields are 1-D tensors aligned with the model's logits (see `data.batching`): position
t holds the numbers of the action "emit token t+1", so `labels[t]` is that token (or -100 where
t+1 is a prompt token or padding) and `action_mask = labels != -100`. The value at t is the
critic's estimate for the state that ends at token t, which is exactly the state the action at t
is taken from.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from collections.abc import Iterator, Sequence

import torch

from hpcrlhf.algos.logprobs import IGNORE
from hpcrlhf.data.batching import shard_rows
from hpcrlhf.data.sft import TokenizedSample
from hpcrlhf.trainers.online import Rollout
from hpcrlhf.trainers.sequences import model_batch


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
    values: torch.Tensor | None = None
    """Critic values when the experience was made (value clipping)."""
    ref_logps: torch.Tensor | None = None
    """Reference log-probs (a KL term in the loss)."""
    is_weights: torch.Tensor | None = None
    """Truncated importance weights of the actions (ppo.tis_cap), multiplying the policy loss."""


@dataclass
class ExperienceBatch:
    """A rollout's sequences as named per-row tensors: the one batch shape that crosses between the
    PPO driver and its roles, growing as the step goes. Token fields are right-padded (B, T)
    tensors aligned with the logits: the forward inputs (`input_ids`, `attention_mask`, `labels`),
    the roles' scores (`old_logps`, `ref_logps`, `values`), the experience (`advantages`,
    `returns`, `is_weights`); per-row numbers are (B,) tensors (a reward worker's scores).
    `lengths` holds each row's tokens. A handful of tensors, not one object per sequence; it
    splits into row shards for a role's ranks (`split`) and joins again (`concat`)."""

    tensors: dict[str, torch.Tensor | None]
    lengths: list[int]

    def __len__(self) -> int:
        return len(self.lengths)

    def rows(self) -> list[Experience]:
        """One Experience per row, trimmed to its length."""
        names = {f.name for f in fields(Experience)}
        return [Experience(**{k: (v[i, :n].clone() if v is not None else None) for k, v in self.tensors.items()
                              if k in names}) for i, n in enumerate(self.lengths)]

    def select(self, rows: Sequence[int]) -> ExperienceBatch:
        """The rows `rows`, in that order (a row may repeat); tensors keep their width."""
        index = torch.tensor(list(rows), dtype=torch.long)
        return ExperienceBatch({k: (v[index] if v is not None else None) for k, v in self.tensors.items()},
                               [self.lengths[i] for i in rows])

    def split(self, parts: int, *, pad_to_equal: bool = False) -> list[ExperienceBatch]:
        """`parts` contiguous row shards (`data.batching.shard_rows`, `pad_to_equal` as there)."""
        return [self.select(rows) for rows in shard_rows(len(self), parts, pad_to_equal=pad_to_equal)]

    def head(self, n: int) -> ExperienceBatch:
        return self.select(range(n))

    @classmethod
    def concat(cls, parts: Sequence[ExperienceBatch]) -> ExperienceBatch:
        """The rows of `parts` in order (shards of one batch: the same fields and width)."""
        return cls({k: (torch.cat([p.tensors[k] for p in parts]) if v is not None else None)
                    for k, v in parts[0].tensors.items()}, [n for p in parts for n in p.lengths])

    def with_tensors(self, **tensors: torch.Tensor | None) -> ExperienceBatch:
        """These rows with more (or replaced) fields."""
        return ExperienceBatch({**self.tensors, **tensors}, self.lengths)


def rollout_batch(rollout: Rollout, pad_id: int) -> ExperienceBatch:
    """The rollout's prompt + response sequences as one right-padded CPU batch of forward inputs
    (`input_ids`, `attention_mask`, `labels`: the model's response tokens only -- not a multi-turn
    trajectory's environment tokens, `Generation.action_mask`)."""
    samples = [TokenizedSample(r.sequence_ids, (False,) * (len(r.sequence_ids) - len(g.response_ids))
                               + (tuple(g.action_mask) if g.action_mask is not None else (True,) * len(g.response_ids)),
                               "rollout")
               for r, g in zip(rollout.responses, rollout.generations)]
    batch = model_batch(samples, pad_id, torch.device("cpu"))
    return ExperienceBatch({k: batch[k] for k in ("input_ids", "attention_mask", "labels")},
                           [len(r.sequence_ids) for r in rollout.responses])


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
