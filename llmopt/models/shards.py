"""Write a checkpoint's tensors as Hugging Face shards: `model-0000i-of-0000N.safetensors` plus
`model.safetensors.index.json`, or one `model.safetensors` when everything fits in one shard (what
transformers' `save_pretrained` writes, and what transformers, vLLM and our loader read).

Why a writer that takes tensors as they come: a streamed quantizer finishes one decoder layer at a time,
and a shard is written (and its tensors dropped) as soon as it is full, so the whole model never has to
be in memory. Shard names carry the total count, which is known only at the end: shards are written
under temporary names and renamed by `finish`, inside the caller's atomic output directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmopt.errors import LlmoptError
from llmopt.units import parse_bytes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default


def parse_shard_size(text: str | int) -> int:
    """`--max-shard-size` in bytes (`5GB`, `500MB`, `2GiB` or a byte count); at least one byte."""
    size = parse_bytes(text)
    if size < 1:
        raise LlmoptError(f"--max-shard-size must be positive, got {text!r}")
    return size


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


class ShardWriter:
    """Collects tensors into shards of at most `max_bytes` (a tensor larger than that gets a shard of its
    own, as in transformers) and writes each shard when the next tensor would overflow it."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []  # temporary file, its tensor names
        self.total_bytes = 0  # tensor bytes, as the index's metadata counts them

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if name in self._pending or any(name in names for _, names in self._written):
                raise LlmoptError(f"tensor {name!r} written twice")
            size = t.numel() * t.element_size()
            if self._pending and self._pending_bytes + size > self.max_bytes:
                self._flush()
            self._pending[name] = t.detach().contiguous().cpu()
            self._pending_bytes += size
            self.total_bytes += size

    def _flush(self) -> None:
        path = self.directory / f".shard-{len(self._written):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> list[Path]:
        """Write what is left and give every shard its final name (plus the index when there are several);
        returns the shard files."""
        if self._pending or not self._written:
            self._flush()
        n = len(self._written)
        if n == 1:
            final = self.directory / SINGLE_FILE
            self._written[0][0].rename(final)
            return [final]
        weight_map: dict[str, str] = {}
        files = []
        for i, (tmp, names) in enumerate(self._written, start=1):
            final = self.directory / shard_name(i, n)
            tmp.rename(final)
            files.append(final)
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return files
