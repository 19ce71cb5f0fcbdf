"""Write an output directory all at once: build it in a sibling temp dir, then `os.replace` it in.

A crash, an exception or Ctrl-C part-way leaves no OUT_DIR behind (only the temp dir, which is removed
on the way out), so a directory that exists is always complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmopt.errors import LlmoptError


def check_output_dir(final: Path, overwrite: bool) -> None:
    """One-line error when `final` exists and may not be replaced (checked before any work)."""
    if final.exists() and not overwrite:
        raise LlmoptError(f"{final} already exists; pass --overwrite to replace it")
    if final.exists() and not final.is_dir():
        raise LlmoptError(f"{final} exists and is not a directory")


@contextmanager
def atomic_directory(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temp dir next to `final`; on success it becomes `final`, on any failure it is removed."""
    final = Path(final)
    check_output_dir(final, overwrite)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, old / final.name)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
