"""Lazy, by-name access to a checkpoint directory's safetensors tensors, across shards.

Why: the loaders and the streamed quantizer read one module (one decoder layer) at a time, so a tensor is
read from its shard only when it is filled in, and a model never has to be in memory twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from llmopt.errors import LlmoptError

_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def unreadable(path: Path, error: Exception) -> LlmoptError:
    """One line for a safetensors file that cannot be read (truncated, not safetensors at all)."""
    return LlmoptError(f"{path} is not a readable safetensors file: {str(error).strip().splitlines()[0]}")


class CheckpointTensors:
    """Every tensor of `directory`'s *.safetensors files, read on demand."""

    def __init__(self, directory: Path) -> None:
        self.where: dict[str, Path] = {}
        for f in sorted(directory.glob("*.safetensors")):
            try:
                with safe_open(str(f), framework="pt") as st:
                    for k in st.keys():
                        self.where[k] = f
            except (SafetensorError, OSError) as e:
                raise unreadable(f, e) from None

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        with safe_open(str(self.where[name]), framework="pt") as st:
            return st.get_tensor(name)

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for each of `names`, opening each file once: opening per tensor parses the file's
        header again each time, quadratic in the tensors of a shard (thousands in an MoE checkpoint). Each
        call opens the files afresh, so no two calls share a tensor's storage."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.where[name], []).append(name)
        for f, in_file in by_file.items():
            with safe_open(str(f), framework="pt") as st:
                for name in in_file:
                    yield name, st.get_tensor(name)

    def float_dtype(self, name: str) -> torch.dtype | None:
        """The stored dtype of `name` when it is a float one (None otherwise), from its file's header: nothing read."""
        with safe_open(str(self.where[name]), framework="pt") as st:
            return _FLOAT_DTYPES.get(st.get_slice(name).get_dtype())

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self else None
