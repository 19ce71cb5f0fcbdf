"""llmopt.io: atomic file and directory writes (content, permissions, fsync order, cleanup on failure)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from llmopt import io
from llmopt.errors import LlmoptError


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def _entries(folder):
    return sorted(p.name for p in folder.iterdir())


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


class Boom(Exception):
    pass


# ---------------------------------------------------------------------------------------------- files


def test_text_bytes_json_and_callback_content(tmp_path):
    assert io.write_text_atomic(tmp_path / "a.md", "héllo\n") == tmp_path / "a.md"
    assert (tmp_path / "a.md").read_text(encoding="utf-8") == "héllo\n"
    io.write_bytes_atomic(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    io.write_json_atomic(tmp_path / "c.json", {"x": 1, "p": tmp_path})
    text = (tmp_path / "c.json").read_text()
    assert text == json.dumps({"x": 1, "p": str(tmp_path)}, indent=2) + "\n"
    io.atomic_write(tmp_path / "d.txt", lambda f: (f.write(b"one "), f.write(b"two")))
    assert (tmp_path / "d.txt").read_bytes() == b"one two"
    assert _entries(tmp_path) == ["a.md", "b.bin", "c.json", "d.txt"]


def test_creates_missing_parent_folders(tmp_path):
    io.write_text_atomic(tmp_path / "x" / "y" / "z.txt", "z")
    assert (tmp_path / "x" / "y" / "z.txt").read_text() == "z"


def test_file_gets_the_umask_mode_not_the_private_temp_mode(tmp_path, umask_027):
    io.write_text_atomic(tmp_path / "f.txt", "x")
    assert _mode(tmp_path / "f.txt") == 0o640
    io.write_text_atomic(tmp_path / "f.txt", "y")  # replacing keeps the same rule
    assert _mode(tmp_path / "f.txt") == 0o640


def test_replaces_an_existing_file(tmp_path):
    (tmp_path / "f.txt").write_text("old")
    io.write_text_atomic(tmp_path / "f.txt", "new")
    assert (tmp_path / "f.txt").read_text() == "new"
    assert _entries(tmp_path) == ["f.txt"]


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_failing_writer_leaves_no_temp_and_no_file(tmp_path, exc):
    def write(f):
        f.write(b"half")
        raise exc()

    with pytest.raises(exc):
        io.atomic_write(tmp_path / "f.txt", write)
    assert _entries(tmp_path) == []


def test_failing_writer_leaves_the_old_file_intact(tmp_path):
    (tmp_path / "f.txt").write_text("old")

    def write(f):
        f.write(b"new but half")
        raise Boom()

    with pytest.raises(Boom):
        io.atomic_write(tmp_path / "f.txt", write)
    assert (tmp_path / "f.txt").read_text() == "old"
    assert _entries(tmp_path) == ["f.txt"]


def test_failing_replace_removes_the_temp(tmp_path, monkeypatch):
    def no_replace(src, dst):
        raise OSError("disk said no")

    monkeypatch.setattr(io.os, "replace", no_replace)
    with pytest.raises(OSError, match="disk said no"):
        io.write_text_atomic(tmp_path / "f.txt", "x")
    assert _entries(tmp_path) == []


def test_fsyncs_the_file_before_replace_and_the_folder_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst):
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(io.os, "fsync", fsync)
    monkeypatch.setattr(io.os, "replace", replace)
    io.write_text_atomic(tmp_path / "f.txt", "x")
    assert events == ["fsync file", "replace", "fsync dir"]


# ----------------------------------------------------------------------------------------- directories


def test_directory_appears_whole(tmp_path, umask_027):
    final = tmp_path / "out"
    with io.atomic_directory(final) as tmp:
        assert tmp.parent == tmp_path and tmp != final and not final.exists()
        (tmp / "a.txt").write_text("a")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text("b")
    assert (final / "a.txt").read_text() == "a" and (final / "sub" / "b.txt").read_text() == "b"
    assert _mode(final) == 0o750  # not mkdtemp's 0700
    assert _entries(tmp_path) == ["out"]


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_failing_directory_leaves_nothing(tmp_path, exc):
    with pytest.raises(exc):
        with io.atomic_directory(tmp_path / "out") as tmp:
            (tmp / "a.txt").write_text("half")
            raise exc()
    assert _entries(tmp_path) == []


def test_existing_directory_without_overwrite_fails_before_any_work(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("keep")
    ran = False
    with pytest.raises(LlmoptError, match="already exists; pass --overwrite"):
        with io.atomic_directory(tmp_path / "out"):
            ran = True
    assert not ran
    assert _entries(tmp_path / "out") == ["keep.txt"] and _entries(tmp_path) == ["out"]


def test_existing_file_is_not_replaced_by_a_directory(tmp_path):
    (tmp_path / "out").write_text("a file")
    with pytest.raises(LlmoptError, match="is not a directory"):
        with io.atomic_directory(tmp_path / "out", overwrite=True):
            pass
    assert (tmp_path / "out").read_text() == "a file"


def test_overwrite_replaces_the_whole_directory(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with io.atomic_directory(tmp_path / "out", overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert _entries(tmp_path / "out") == ["new.txt"]
    assert _entries(tmp_path) == ["out"]  # no .tmp- or .old- left


def test_failing_overwrite_leaves_the_old_directory_intact(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with pytest.raises(Boom):
        with io.atomic_directory(tmp_path / "out", overwrite=True) as tmp:
            (tmp / "new.txt").write_text("half")
            raise Boom()
    assert _entries(tmp_path / "out") == ["old.txt"]
    assert _entries(tmp_path) == ["out"]


def test_keep_existing_installs_when_absent_and_discards_when_another_copy_won(tmp_path):
    with io.atomic_directory(tmp_path / "cache", keep_existing=True) as tmp:
        (tmp / "mine.txt").write_text("first")
    assert _entries(tmp_path / "cache") == ["mine.txt"]

    with io.atomic_directory(tmp_path / "cache", keep_existing=True) as tmp:
        (tmp / "late.txt").write_text("second")  # the race loser: its copy goes, the winner's stays
    assert _entries(tmp_path / "cache") == ["mine.txt"]
    assert _entries(tmp_path) == ["cache"]
