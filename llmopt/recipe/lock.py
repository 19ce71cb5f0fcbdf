"""One `llmopt run` per run folder at a time: an exclusive, non-blocking flock on RUN_DIR/.lock.

Two runs writing the same folder would interleave stage artifacts and state. The lock dies with its
process (the kernel drops it), so a crashed run never leaves the folder locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from llmopt.errors import LlmoptError
from llmopt.io import unwritable

LOCK_NAME = ".lock"


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold the run folder's lock for the block; fail at once if another run holds it."""
    path = run_dir / LOCK_NAME
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")  # noqa: SIM115 (closed by the with below)
    except OSError as e:
        raise LlmoptError(f"cannot use {run_dir} as the run folder: {unwritable(run_dir, e)}") from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise LlmoptError(f"{run_dir} is in use by another `llmopt run` (pid {holder}); wait for it to "
                              "finish or pass --out DIR") from None
        try:
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
