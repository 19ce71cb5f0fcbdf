"""`versions.json`: the software a run was made with, so a result can be reproduced or explained later."""

from __future__ import annotations

import platform
from importlib import metadata
from typing import Any

from llmopt._version import __version__


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "llmopt": __version__,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
    }
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out
