"""hpcrlhf.run.files on real files: links, FIFOs, hard links and devices planted where hpcrlhf writes
are refused by name and what they point at is untouched; replaced files and staged folders are whole
or absent; new files get the umask's modes, secrets 0600.

The run-level cases (a planted run.lock, metrics.jsonl, checkpoints/ ... at the CLI) are in
tests/run/test_folder.py; these cover each primitive, including a link planted after a run
has checked its folder.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from hpcrlhf.errors import UnsafeFileError
from hpcrlhf.run.files import append, current_umask, open_in_place, replace_file, replacing, staged_folder, write_secret


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file of the user's that a planted link aims at (~/.bashrc)."""
    path = tmp_path / "bashrc"
    path.write_text("the user's own file\n")
    return path


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


WRITERS = {
    "replace": lambda p: replace_file(p, "new\n"),
    "append": lambda p: append(p, b"new\n"),
    "open in place": lambda p: os.close(open_in_place(p, os.O_RDWR | os.O_CREAT)),
    "secret": lambda p: write_secret(p, "token"),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_link_is_never_written_through(tmp_path, victim, writer):
    link = tmp_path / "run.lock"
    link.symlink_to(victim)
    with pytest.raises(UnsafeFileError) as refused:
        WRITERS[writer](link)
    if writer != "secret":
        assert str(refused.value) == (f"{link} is a symbolic link (to {victim}); hpcrlhf never writes through links: "
                                      "remove it")
    else:
        assert str(refused.value).startswith(f"{link} exists already (a symbolic link)")
    assert victim.read_text() == "the user's own file\n" and link.is_symlink()


@pytest.mark.parametrize("writer", ["append", "open in place"])
def test_a_fifo_neither_blocks_nor_is_written(tmp_path, writer):
    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)
    for with_reader in (False, True):  # no reader: an open would block; a reader would receive the data
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK) if with_reader else None
        raised: list[BaseException] = []
        attempt = threading.Thread(target=_catch, args=(raised, WRITERS[writer], fifo), daemon=True)
        attempt.start()
        attempt.join(10)
        assert not attempt.is_alive(), "blocked on the FIFO"
        assert isinstance(raised[0], UnsafeFileError) and f"{fifo} is a FIFO, not a file" in str(raised[0])
        if reader is not None:
            assert os.read(reader, 100) == b""
            os.close(reader)


def _catch(raised: list[BaseException], fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as e:
        raised.append(e)


def test_a_device_and_a_folder_are_no_files(tmp_path):
    with pytest.raises(UnsafeFileError, match="/dev/full is a character device, not a file"):
        append(Path("/dev/full"), b"x")
    (tmp_path / "run.lock").mkdir()
    with pytest.raises(UnsafeFileError, match="run.lock is a folder, not a file: hpcrlhf writes a file of its own"):
        open_in_place(tmp_path / "run.lock", os.O_RDWR | os.O_CREAT)
    with pytest.raises(UnsafeFileError, match="is a folder, not a file"):
        replace_file(tmp_path / "run.lock", "x")


def test_a_file_written_in_place_must_have_no_other_hard_link(tmp_path, victim):
    linked = tmp_path / "metrics.jsonl"
    os.link(victim, linked)
    with pytest.raises(UnsafeFileError, match="has 2 hard links"):
        append(linked, b"new\n")
    assert victim.read_text() == "the user's own file\n"
    replace_file(linked, "new\n")  # a replaced file is a new one: the other name keeps the old content
    assert linked.read_text() == "new\n" and victim.read_text() == "the user's own file\n"


def test_a_replaced_file_is_whole_or_as_it_was(tmp_path):
    path = tmp_path / "summary.json"
    replace_file(path, "old\n")
    with pytest.raises(RuntimeError):
        with replacing(path) as f:
            f.write(b"half")
            raise RuntimeError("failed mid-write")
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["summary.json"]
    replace_file(path, lambda f: f.write(b"written by a library\n"))
    assert path.read_text() == "written by a library\n"


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_files_get_the_umasks_modes_and_secrets_0600(tmp_path, umask, mask):
    umask(mask)
    assert current_umask() == mask
    replace_file(tmp_path / "config.yaml", "x")
    append(tmp_path / "metrics.jsonl", b"x")
    with staged_folder(tmp_path / "model") as staging:
        (staging / "model.safetensors").write_bytes(b"w")
        (staging / "model.safetensors").chmod(0o600)  # what safetensors does
        assert mode(staging) == 0o700  # private while written
    assert mode(tmp_path / "config.yaml") == mode(tmp_path / "metrics.jsonl") == 0o666 & ~mask
    assert mode(tmp_path / "model" / "model.safetensors") == 0o666 & ~mask and mode(tmp_path / "model") == 0o777 & ~mask
    umask(0)
    write_secret(tmp_path / "token", "secret")
    assert mode(tmp_path / "token") == 0o600


def test_a_secret_is_never_written_into_an_existing_file(tmp_path):
    readable = tmp_path / "token"
    readable.touch()
    readable.chmod(0o666)  # pre-created world-readable by someone else
    with pytest.raises(UnsafeFileError, match="exists already \\(a file\\)"):
        write_secret(readable, "secret")
    assert readable.read_text() == ""


def test_a_staged_folder_replaces_the_old_one_whole_or_leaves_it(tmp_path, victim):
    final = tmp_path / "model"
    with staged_folder(final) as staging:
        (staging / "config.json").write_text("1")
    with pytest.raises(OSError):
        with staged_folder(final) as staging:
            (staging / "config.json").write_text("2")
            raise OSError(28, "No space left on device")
    assert sorted(os.listdir(tmp_path)) == sorted(["model", victim.name])  # no staging folder left
    assert (final / "config.json").read_text() == "1"
    (tmp_path / ".model.partial-killed").mkdir()  # what a writer killed mid-export leaves
    with staged_folder(final) as staging:
        (staging / "config.json").write_text("3")
    assert (final / "config.json").read_text() == "3" and sorted(os.listdir(tmp_path)) == sorted(["model", victim.name])
    aimed = tmp_path / "elsewhere"
    aimed.mkdir()
    (tmp_path / "export").symlink_to(aimed)
    with pytest.raises(UnsafeFileError, match="export is a symbolic link"):
        with staged_folder(tmp_path / "export"):
            pass
    assert os.listdir(aimed) == []
