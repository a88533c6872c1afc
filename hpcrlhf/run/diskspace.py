"""A full disk ends a run with a message that says so, never with a stranded run folder.

Writers that can hit `ENOSPC` (metrics, TensorBoard, checkpoints, the exported model) run under
`out_of_space_is_an_error`: the failure becomes a `DiskFull` error naming the folder, the space
left and the space the next write needs (the last checkpoint's size when there is one), and how
to go on (free space, rerun the same command: the run resumes from its last intact checkpoint).
torch and DeepSpeed report a failed checkpoint write as a `RuntimeError` from torch's zip writer
("PytorchStreamWriter failed writing file ...", "unexpected pos ..."), not as an OSError, so for
those the free space left decides; safetensors (the exported model) as a `SafetensorError` whose
text carries the errno ("(os error 28)").
"""

from __future__ import annotations

import errno
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterator

from hpcrlhf.errors import HpcrlhfError

LOW_SPACE_BYTES = 64 << 20
"""Less free space than this after a failed write: the write failed for lack of space."""


class DiskFull(HpcrlhfError):
    """A write failed because the filesystem is full; the message names the folder and the space needed."""


def free_bytes(path: Path) -> int:
    """Free space (for this user) on the filesystem holding `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def folder_bytes(folder: Path) -> int:
    """Total size of the files under `folder` (0 when it does not exist)."""
    folder = Path(folder)
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _rust_errno(error: BaseException) -> int | None:
    """The errno in a Rust I/O error's text ("... No space left on device (os error 28)"), as
    safetensors' SafetensorError reports a failed write; None when there is none."""
    try:
        found = re.search(r"\(os error (\d+)\)", str(error))
    except Exception:  # an exception whose text cannot be made
        return None
    return int(found.group(1)) if found else None


def is_out_of_space(error: BaseException, folder: Path) -> bool:
    """Whether `error`, raised while writing into `folder`, was for lack of space."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    if _rust_errno(error) in (errno.ENOSPC, errno.EDQUOT):
        return True
    if not isinstance(error, RuntimeError):
        return False
    # torch's zip writer: "PytorchStreamWriter failed writing file ...", "[enforce fail at
    # inline_container.cc:672] . unexpected pos 3033024 vs 3032912" (a short write)
    if not any(mark in str(error) for mark in ("write", "inline_container", "unexpected pos")):
        return False
    try:
        return free_bytes(folder) < LOW_SPACE_BYTES
    except OSError:
        return False


RESUME_HINT = ": it resumes from its last intact checkpoint"
"""What a run that ran out of space writing its metrics does when rerun."""


@contextmanager
def out_of_space_is_an_error(folder: Path, what: str, *, needs: int | None = None,
                             resume_hint: str = "") -> Iterator[None]:
    """Turn a failure for lack of space while writing `what` into `folder` into `DiskFull`; any
    other failure passes through unchanged. `needs`: bytes the write needs, when known."""
    try:
        yield
    except HpcrlhfError:
        raise
    except Exception as e:
        if not is_out_of_space(e, folder):
            raise
        free = free_bytes(folder)
        need = f"; it needs about {format_bytes(needs)}" if needs else ""
        quota = " (or the quota)" if errno.EDQUOT in (getattr(e, "errno", None), _rust_errno(e)) else ""
        raise DiskFull(f"no space left on the filesystem{quota} of {folder} while writing {what}: "
                       f"{format_bytes(free)} free{need}. Free some space (or move the run to a larger filesystem), "
                       f"then rerun the same command{resume_hint} [{type(e).__name__}: {str(e)[:200]}]") from None
