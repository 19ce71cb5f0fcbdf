"""Writing files and directories all at once, so a reader (CI, a second run, a crash restart) sees the
old content or the new, never half of either.

Every writer builds its result in a temp file or directory beside the target, fsyncs it, moves it
in with `os.replace` and fsyncs the parent directory, so the new name survives a power cut too. On
any failure (an exception, Ctrl-C) the temp is removed and the target is left as it was.

Temp files and directories are created private (0600/0700 by `tempfile`); what ends up at the
target gets the permissions a plain create would have (0666/0777 less the umask), so a shared
output directory stays readable.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from llmopt.errors import LlmoptError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def public_mode(path: str | Path) -> None:
    """Give a temp file or directory (created 0600/0700) the permissions a plain create would have."""
    path = Path(path)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~_umask())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_parent(path: Path) -> None:
    """Make the rename durable. Best effort: the new content is already in place when this runs, and
    some file systems cannot fsync a directory, so failing the write here would misreport it."""
    try:
        _fsync_path(path.parent)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------- files


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Write via `write(fileobj)` (a binary file: `f.write(data)`, `fig.savefig(f, format="png")`, ...)
    into a temp file beside `path`, then move it over `path`. Missing parent folders are created."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        public_mode(tmp)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_parent(out)
    return out


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """Indented JSON with a final newline; values JSON does not know are written as `str(value)`."""
    return write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def unwritable(folder: str | Path, error: OSError) -> str:
    """Why files cannot be made in `folder`: a file where it or a folder above it should be, or the system's
    reason."""
    for path in (Path(folder), *Path(folder).parents):
        if path.exists():
            return str(error.strerror or error) if path.is_dir() else f"{path} is a file, not a folder"
    return str(error.strerror or error)


def check_output_file(path: str | Path, flag: str, *, new_folders: bool = True) -> Path:
    """Refuse, before any work, a path a file cannot be written to, in one line (exit 2): a folder, a parent
    that is a file, or a folder this process cannot create files in (probed with a temp file, which also
    catches what permission bits do not, such as /proc). Missing parent folders are made, as `atomic_write`
    makes them, unless `new_folders` is off (then a typo in a path is not a new folder)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise LlmoptError(f"{flag} {path}: is a folder; give a file name")
    if not p.parent.is_dir():
        if p.parent.exists():
            raise LlmoptError(f"{flag} {path}: {p.parent} is not a folder")
        if not new_folders:
            raise LlmoptError(f"{flag} {path}: folder {p.parent} does not exist")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise LlmoptError(f"{flag} {path}: cannot write there ({unwritable(p.parent, e)})") from None
    return p


# ----------------------------------------------------------------------------------------- directories


def check_output_dir(final: str | Path, overwrite: bool) -> None:
    """One-line error when `final` exists and may not be replaced (checked before any work)."""
    final = Path(final)
    if final.exists() and not overwrite:
        raise LlmoptError(f"{final} already exists; pass --overwrite to replace it")
    if final.exists() and not final.is_dir():
        raise LlmoptError(f"{final} exists and is not a directory")
    try:  # where the temp directory will go: made now, and probed
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=f".{final.name}.probe-", dir=final.parent))
    except OSError as e:
        raise LlmoptError(f"cannot write {final}: {unwritable(final.parent, e)}") from None


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory below `root` (and `root`) to disk, deepest first."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            p = Path(dirpath, name)
            if p.is_file() and not p.is_symlink():
                _fsync_path(p)
        _fsync_path(Path(dirpath))


@contextmanager
def atomic_directory(final: str | Path, overwrite: bool = False, *, keep_existing: bool = False) -> Iterator[Path]:
    """Yield an empty temp dir next to `final`; on success it becomes `final`, on any failure it is removed.

    `final` must not exist unless `overwrite` (checked first, before the caller does any work); an
    existing `final` is moved aside and deleted only after the new one is in place.

    `keep_existing` is for caches that several processes may fill at once: no check up front, and
    if a complete `final` has appeared meanwhile (another process won the race; its copy is as good
    as ours) it is kept and this copy is discarded.
    """
    final = Path(final)
    if not keep_existing:
        check_output_dir(final, overwrite)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        public_mode(tmp)
        if keep_existing:
            try:
                os.replace(tmp, final)
            except OSError:  # `final` exists and is not empty: the other process's copy stays
                shutil.rmtree(tmp, ignore_errors=True)
        elif final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, old / final.name)
            try:
                os.replace(tmp, final)
            except BaseException:  # put the old one back rather than leave no `final` at all
                os.replace(old / final.name, final)
                shutil.rmtree(old, ignore_errors=True)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_parent(final)
