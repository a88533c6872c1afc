"""Turning token samples into model batches, with optional sample packing.

Unpacked: one sample per row, right-padded, with an attention mask.
Packed: several samples share a row of `max_length` tokens. The row carries no attention mask;
instead `position_ids` restart at 0 at every sample boundary, from which transformers builds a
block-diagonal causal mask (`masking_utils.find_packed_sequence_indices`), so a token never
attends across samples. Trailing padding forms its own segment and carries no loss.

Labels are already shifted: `labels[t]` is the target for the logits at position t, or -100.

`shard_rows` is how rows are split over workers or ranks, everywhere (evaluation over ranks, Ray
role workers, vLLM engines): contiguous shards whose sizes differ by at most one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hpcrlhf.data.sft import TokenizedSample

IGNORE = -100


def pack_rows(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Group sample indices into rows of at most `max_length` tokens, keeping data order.

    Next-fit (a new row starts when the next sample does not fit) keeps the order of samples, so
    a data position saved in a checkpoint means the same thing after a resume.
    """
    rows: list[list[int]] = []
    used = max_length
    for i, n in enumerate(lengths):
        if n > max_length:
            raise ValueError(f"sample {i} has {n} tokens > max_length {max_length}; truncate first")
        if used + n > max_length:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def collate(rows: Sequence[Sequence[TokenizedSample]], pad_id: int, packed: bool) -> dict[str, torch.Tensor]:
    """Batch tensors for a list of rows (each row one sample, or several when packed)."""
    width = max(sum(len(s.input_ids) for s in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for s in row:
            n = len(s.input_ids)
            ids = torch.tensor(s.input_ids)
            target = torch.where(torch.tensor(s.loss_mask), ids, IGNORE)
            input_ids[r, start : start + n] = ids
            labels[r, start : start + n - 1] = target[1:]  # logits at t predict token t+1
            position_ids[r, start : start + n] = torch.arange(n)
            attention_mask[r, start : start + n] = 1
            start += n
        position_ids[r, start:] = torch.arange(width - start)  # padding: a segment of its own
    batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
    if not packed:
        batch["attention_mask"] = attention_mask
    return batch


def shard_rows(n: int, parts: int, *, pad_to_equal: bool = False) -> list[list[int]]:
    """The row indices of n rows split into `parts` contiguous shards whose sizes differ by at most
    one (the first n % parts shards hold one more). `pad_to_equal`: every shard as long as the
    longest, filled with its own last row (an empty shard with the batch's last): every rank of a
    ZeRO-3 role must run the same number of forward passes; the repeats are dropped when the
    results are joined (`cluster.worker_group.gather_rows`)."""
    size, extra = divmod(n, parts)
    shards, start = [], 0
    for i in range(parts):
        stop = start + size + (i < extra)
        shards.append(list(range(start, stop)))
        start = stop
    if pad_to_equal and n:
        longest = size + (extra > 0)
        shards = [s + [s[-1] if s else n - 1] * (longest - len(s)) for s in shards]
    return shards


class RowList(list):
    """Rows of any kind (the responses a reward worker scores) that split over workers and join
    again like a tensor batch (`shard_rows`)."""

    def split(self, parts: int, *, pad_to_equal: bool = False) -> list[RowList]:
        return [RowList(self[i] for i in rows) for rows in shard_rows(len(self), parts, pad_to_equal=pad_to_equal)]

    @classmethod
    def concat(cls, parts: Sequence[RowList]) -> RowList:
        return cls(row for part in parts for row in part)

    def head(self, n: int) -> RowList:
        return RowList(self[:n])
