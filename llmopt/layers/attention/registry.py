"""The attention backends by name; the engine builder takes the first that supports its device."""

from __future__ import annotations

import torch

from llmopt.layers.attention.backend import AttentionBackend
from llmopt.layers.attention.head_major import HeadMajorBackend

# in order of preference: a device-specific backend goes before the portable head-major one
BACKENDS: dict[str, type[AttentionBackend]] = {HeadMajorBackend.name: HeadMajorBackend}


def get_backend(device: torch.device, block_size: int, allow_compiled: bool = True,
                name: str | None = None) -> AttentionBackend:
    """The named backend, or the first registered one that runs on `device`."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    dev = torch.device(device)
    cls = BACKENDS[name] if name is not None else next(c for c in BACKENDS.values() if c.supports(dev))
    return cls(block_size, dev, allow_compiled)
