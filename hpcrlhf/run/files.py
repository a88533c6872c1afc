"""Writing files without being redirected by whatever someone planted at their paths.

A run folder can be writable by others (a project's shared folder), and whatever sits at a name in
it may have been put there by someone else: `run.lock` a symbolic link to the user's ~/.bashrc,
`metrics.jsonl` a FIFO, `checkpoints/` a link to another folder. Every file hpcrlhf writes goes
through this module, which never follows a link at a path it writes and never writes into anything
but a plain file:

- `replacing` / `replace_file`: a new file beside the old one, created exclusively
  (O_CREAT|O_EXCL|O_NOFOLLOW, under a random name), flushed and renamed over it. Readers see the
  old file or the new one whole, never half of one.
- `open_in_place` (and `append`): a file hpcrlhf appends to or rewrites in place (metrics.jsonl,
  run.lock) is opened with O_NOFOLLOW|O_NONBLOCK (a FIFO neither blocks the open nor receives
  anything) and must then be a regular file with one link (a hard link would be written through).
- `write_secret`: a secret (a Ray token) in a new file, exactly 0600, never over anything.
- `staged_folder` (`fresh_folder`, `publish`, `replace_folder`): libraries that take a path, not
  flags (safetensors, torch.save, DeepSpeed, save_pretrained), write into a fresh folder made by
  mkdir (which never follows a link), private (0700) while they write; it then gets the policy's
  modes and is renamed into place.
- `path_problem` / `refuse`: a path about to be written must be absent or a real file (folder);
  anything else is an `UnsafeFileError` naming it, what is there and the fix (exit 2).

Permission policy: what a run writes (metrics, config, checkpoints, the exported model, generated
responses) gets the mode the umask gives any new file: 0644 under the usual umask 022, 0640 under
027. The umask is the setting a site or project already uses to say who reads its files, and the
same weights are then readable alike in a checkpoint and in the exported model (safetensors alone
would make the export 0600). Secrets (Ray's token) are 0600 whatever the umask; staging folders are
0700 until committed.

What no check can do: a check and the write after it are two steps, and libraries write by path, so
someone who can write into the folder could still swap an entry between the two. Only a run folder
no one else can write (or one with the sticky bit, like /tmp) is safe from that.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Literal

from hpcrlhf.errors import ConfigError, UnsafeFileError

Kind = Literal["file", "folder"]
Content = bytes | str | Callable[[IO[bytes]], None]

_KINDS = ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "folder"), (stat.S_ISREG, "file"), (stat.S_ISFIFO, "FIFO"),
          (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))


def kind_of(mode: int) -> str:
    """What a `st_mode` is, in words ("file", "folder", "FIFO", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "special file")


def _problem(path: Path, info: os.stat_result, want: Kind, in_place: bool, fix: str = "remove it") -> str | None:
    have = kind_of(info.st_mode)
    if have == "symbolic link":
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"{path} is a symbolic link (to {target}); hpcrlhf never writes through links: {fix}"
    if have != want:
        return f"{path} is a {have}, not a {want}: hpcrlhf writes a {want} of its own there; {fix}"
    if in_place and info.st_nlink > 1:
        return (f"{path} has {info.st_nlink} hard links: hpcrlhf writes into it in place and never into a file that "
                f"other paths name too; {fix} (or replace it by a copy: cp, then mv over it)")
    return None


def path_problem(path: Path, want: Kind = "file", *, in_place: bool = False, fix: str = "remove it") -> str | None:
    """Why hpcrlhf may not write a `want` at `path` (None: nothing is there, or a real one is), ending
    with `fix`. The last component is looked at itself, never a link's target. `in_place`: the file is
    appended to or rewritten in place (not replaced), so it must also have no other hard link."""
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return _problem(Path(path), info, want, in_place, fix)


def refuse(problems: Iterable[str | None]) -> None:
    """Raise one UnsafeFileError naming every problem found (None entries are no problem)."""
    found = [p for p in problems if p]
    if len(found) == 1:
        raise UnsafeFileError(found[0])
    if found:
        raise UnsafeFileError("\n".join(["nothing was written, because:", *(f"- {p}" for p in found)]))


def require_safe(path: Path, want: Kind = "file", *, in_place: bool = False, fix: str = "remove it") -> None:
    refuse([path_problem(path, want, in_place=in_place, fix=fix)])


# --- files ------------------------------------------------------------------------------------

def open_in_place(path: Path, flags: int, mode: int = 0o666) -> int:
    """A descriptor of `path` opened with `flags` (O_CREAT allowed) that is sure to be a regular file
    with one link, reached without following a link. `mode` is narrowed by the umask (the policy)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:  # ELOOP: a link; EISDIR: a folder; ENXIO: a FIFO without reader, a socket
        problem = path_problem(path, in_place=True) if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO) else None
        if problem:
            raise UnsafeFileError(problem) from None
        raise
    problem = _problem(Path(path), os.fstat(fd), "file", True)
    if problem:
        os.close(fd)
        raise UnsafeFileError(problem)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def append(path: Path, data: bytes) -> None:
    """Append `data` to `path` (created if missing) whole, or leave the file as it was and raise:
    after a failed write (a full disk) the file is cut back to its previous end, so no torn line stays."""
    fd = open_in_place(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        end = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
        except OSError:
            os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def _new_beside(path: Path, mode: int = 0o666) -> tuple[int, Path]:
    """A new file in `path`'s folder under a random hidden name, created exclusively (never an
    existing file, never through a link)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode), tmp
        except FileExistsError:
            continue


@contextmanager
def replacing(path: Path) -> Iterator[IO[bytes]]:
    """A binary file to write `path`'s new content into: a new file beside it, renamed over it once
    the block ends (flushed to disk first); when the block fails it is removed and `path` is as it
    was. A link, folder or special file at `path` is refused, not replaced."""
    path = Path(path)
    require_safe(path)
    fd, tmp = _new_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def replace_file(path: Path, content: Content) -> None:
    """`path` replaced by `content` (text is written as UTF-8; a callable writes into the binary
    file it is given, e.g. `lambda f: torch.save(obj, f)`), atomically (`replacing`)."""
    with replacing(path) as f:
        if callable(content):
            content(f)
        else:
            f.write(content.encode() if isinstance(content, str) else content)


def write_secret(path: Path, text: str) -> None:
    """`text` in a new file at `path`, readable and writable by its owner only (0600 from the start,
    whatever the umask). Anything already at `path` (a file someone made readable to all, a link)
    is refused: a secret is never written into a file this process did not just create."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        there = kind_of(os.lstat(path).st_mode)
        raise UnsafeFileError(f"{path} exists already (a {there}): a secret is written only into a new file of its "
                              "own; remove it") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # the umask can only narrow 0600; make it exactly that
        f.write(text)


# --- folders ----------------------------------------------------------------------------------

def current_umask() -> int:
    """This process's umask, read without changing it (os.umask would, for a moment, in every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def ensure_folder(path: Path) -> Path:
    """`path` as a real folder: made when missing (its parent must exist), refused when a link or
    anything but a folder is there."""
    require_safe(path, "folder")
    try:
        os.mkdir(path)
    except FileExistsError:
        require_safe(path, "folder")  # appeared meanwhile
    return path


def fresh_folder(path: Path) -> Path:
    """An empty private folder (0700) at `path`, made now by this process. A real folder there is
    removed first (what an interrupted write of this run left); a link or anything else is refused."""
    require_safe(path, "folder")
    if os.path.lexists(path):
        shutil.rmtree(path)
    os.mkdir(path, 0o700)
    return path


def publish(folder: Path) -> None:
    """Give `folder` and all in it the policy's modes: what the umask gives new files and folders.
    Links are left alone (none is made by the writers of a private staging folder)."""
    mask = current_umask()
    for root, dirs, files in os.walk(folder):
        for name in files + dirs:
            p = os.path.join(root, name)
            info = os.lstat(p)
            if not stat.S_ISLNK(info.st_mode):
                os.chmod(p, (0o777 if stat.S_ISDIR(info.st_mode) else 0o666) & ~mask)
    os.chmod(folder, 0o777 & ~mask)


def replace_folder(staging: Path, final: Path) -> None:
    """Rename `staging` to `final`. A real folder at `final` is moved aside first and removed after
    (put back if the rename fails); a link there is refused."""
    require_safe(final, "folder")
    old = final.with_name(f".{final.name}.old-{secrets.token_hex(4)}") if os.path.lexists(final) else None
    if old is not None:
        os.rename(final, old)
    try:
        os.rename(staging, final)
    except BaseException:
        if old is not None:
            os.rename(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_folder(final: Path, *, keep_existing: bool = False) -> Iterator[Path]:
    """A fresh private folder beside `final` to write into (for libraries that write by path). When
    the block ends it gets the policy's modes and becomes `final`: an older `final` is replaced, or
    with `keep_existing` (a cache entry built by two processes at once) kept, ours discarded. When
    the block fails it is removed and `final` is as it was. A link at `final` is refused. Without
    `keep_existing` the writer is the only one (a run folder has one job): staging folders a killed
    writer left beside `final` are removed first."""
    final = Path(final)
    require_safe(final, "folder")
    final.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{final.name}.partial-"
    if not keep_existing:
        for left in final.parent.glob(prefix + "*"):
            if left.is_dir() and not left.is_symlink():
                shutil.rmtree(left, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))  # mkdir, 0700
    try:
        yield staging
        publish(staging)
        if not keep_existing:
            replace_folder(staging, final)
            return
        try:
            os.rename(staging, final)
        except OSError:  # `final` exists already (a rename onto a non-empty folder fails): keep theirs
            if path_problem(final, "folder") is not None or not final.is_dir():
                raise
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# --- folders the user names ---------------------------------------------------------------------

def os_error_reason(error: OSError, path: Path) -> str:
    """Why an operation on `path` failed, in words for an error message."""
    if error.errno == errno.ENOTDIR:
        part = next((p for p in Path(path).parents if p.exists() and not p.is_dir()), None)
        return f"{part} is a file, not a folder" if part else "a part of the path is not a folder"
    return {errno.EROFS: "the filesystem is read-only", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied", errno.ENOSPC: "no space left on the filesystem",
            errno.EDQUOT: "the disk quota is exhausted", errno.EEXIST: "something that is not a folder is there",
            errno.ENAMETOOLONG: "the name is too long"}.get(error.errno or 0, error.strerror or str(error))


def make_folders(path: Path, option: str) -> None:
    """Create the folder a user named with `option` (and its parents), or raise ConfigError naming
    the option, the path and why not."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{option} {path}: cannot create it ({os_error_reason(e, Path(path))}); name a folder you "
                          "can write") from None
