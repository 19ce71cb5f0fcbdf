"""Write a run-directory file all at once (temp file + `os.replace`), so readers (CI, a second run) never
see half of `state.json` or `summary.json` after a crash. Directories use `llmopt.quant.atomic`.

Temp files and directories are created private (0600/0700); what ends up in the run directory gets the
permissions of an ordinary file, so a shared run directory stays readable."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def public_mode(path: Path) -> None:
    """Give a temp file or directory (created 0600/0700) the permissions a plain create would have."""
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~_umask())


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        public_mode(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")
