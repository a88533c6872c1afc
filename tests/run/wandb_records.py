"""Read what W&B's offline mode wrote: the records of a `run-<id>.wandb` file.

The file is a log in the block format of LevelDB's write-ahead log (as W&B documents its
`.wandb` transaction log): a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then 32 KiB blocks of
chunks, each with a 7-byte header (CRC-32C, length, type: full, first, middle, last) and a payload;
a block whose tail is shorter than a chunk header is padded. The payloads of a record's chunks, joined,
are one `wandb.proto.wandb_internal_pb2.Record`. Written for the tests from that description and
checked against files W&B 0.30 writes."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK, CHUNK_HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[object]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path} is not a W&B log ({ident!r}, {magic:#x}, {version})"
    pos, parts = 7, b""
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # padding at a block's end
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEADER])
        if kind == 0:  # zeros: the rest of the block is unused
            pos += left
            continue
        parts += data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def history(path: Path) -> tuple[str, list[dict[str, float]]]:
    """(the run id, its history rows: `_step` and the metrics logged, W&B's own `_timestamp`/`_runtime` left out)."""
    run_id, rows = "", []
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.append({k: v for k, v in row.items() if k not in ("_timestamp", "_runtime")})
    return run_id, rows
