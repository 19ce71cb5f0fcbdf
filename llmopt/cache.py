"""Where llmopt keeps what it derives once and reuses: converted models, built kernels.

`$LLMOPT_CACHE`, else ~/.cache/llmopt. Nothing in it is needed for a run to pass: every entry is
rebuilt when missing."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("LLMOPT_CACHE", Path.home() / ".cache" / "llmopt"))
