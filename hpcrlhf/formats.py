"""Cheap structural checks of the binary files hpcrlhf loads: safetensors weights and torch.save
archives (checkpoint shards, pytorch_model.bin).

A file cut short (a copy or a save interrupted, a full disk, a node that died while writing)
otherwise fails deep inside safetensors' or torch's C++ with no file name (`invalid header
length`, `failed finding central directory`). These checks read only headers and directories,
so they cost milliseconds on files of any size; they catch truncation, not altered bytes (the
checkpoint manifest's SHA-256 is for that).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file (None: its header is whole and its tensors fit in it):
    8 bytes of header length, the JSON header, then the tensor data the header's offsets describe."""
    size = path.stat().st_size
    if size < 8:
        return "is empty" if size == 0 else f"has {size} bytes, fewer than a safetensors header takes"
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if 8 + header_len > size:
            return f"is cut short: {size:,} bytes, but its header alone takes {8 + header_len:,}"
        try:
            header = json.loads(f.read(header_len))
            end = max((t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "has no readable safetensors header"
    if 8 + header_len + end > size:
        return f"is cut short: {size:,} bytes, but its tensors end at byte {8 + header_len + end:,}"
    return None


def torch_file_problem(path: Path) -> str | None:
    """What is wrong with a torch.save file (None: nothing seen). torch writes a zip archive whose
    directory sits at the end, so a file cut short has none; files in torch's legacy pickle format
    (not zips, from before torch 1.6) are only checked for being empty."""
    size = path.stat().st_size
    if size == 0:
        return "is empty"
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":
        return None  # the legacy format: nothing cheap to check
    try:
        with zipfile.ZipFile(path) as archive:
            end = max((i.header_offset + i.compress_size for i in archive.infolist()), default=0)
    except (zipfile.BadZipFile, OSError, ValueError):
        return f"is cut short or damaged: {size:,} bytes without the archive's closing directory"
    if end > size:
        return f"is cut short: {size:,} bytes, but its entries end at byte {end:,}"
    return None


def file_problem(path: Path) -> str | None:
    """The problem `safetensors_problem` or `torch_file_problem` finds in `path`, by its suffix
    (None for other files)."""
    if path.suffix == ".safetensors":
        return safetensors_problem(path)
    if path.suffix in TORCH_SUFFIXES:
        return torch_file_problem(path)
    return None
