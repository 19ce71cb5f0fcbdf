"""Lazy, by-name access to a checkpoint directory's safetensors tensors, across shards.

Why: the loaders and the streamed quantizer read one module (one decoder layer) at a time, so a tensor is
read from its shard only when it is filled in, and a model never has to be in memory twice.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointTensors:
    """Every tensor of `directory`'s *.safetensors files, read on demand."""

    def __init__(self, directory: Path) -> None:
        self.where: dict[str, Path] = {}
        for f in sorted(directory.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    self.where[k] = f

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        with safe_open(str(self.where[name]), framework="pt") as st:
            return st.get_tensor(name)

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self else None
