"""Write a checkpoint's tensors as Hugging Face shards: `model-0000i-of-0000N.safetensors` plus
`model.safetensors.index.json`, or one `model.safetensors` when everything fits in one shard (what
transformers' `save_pretrained` writes, and what transformers, vLLM and our loader read).

Why a writer that takes tensors as they come: a streamed quantizer finishes one decoder layer at a time,
and its tensors go to disk at once (into the open shard's data file), so neither the model nor a shard
is ever held in memory. A safetensors file starts with a header that lists every tensor's offsets, so a
shard's data file is copied behind its header, in chunks, once the shard is full; safetensors itself only
writes whole dicts. Shard names carry the total count, known only at the end: shards are written under
temporary names and renamed by `finish`, inside the caller's atomic output directory.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import BinaryIO

import torch

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


# safetensors' dtype names (the format's spec)
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_COPY_CHUNK = 64 << 20


class ShardWriter:
    """Collects tensors into shards of at most `max_bytes` (a tensor larger than that gets a shard of its
    own, as in transformers). Each tensor is written to disk when added; the caller may drop it then."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._data: BinaryIO | None = None  # the open shard's tensor bytes, in order
        self._entries: dict[str, dict] = {}  # the open shard's header entries
        self._size = 0
        self._written: list[tuple[Path, list[str]]] = []  # temporary file, its tensor names
        self._names: set[str] = set()
        self.total_bytes = 0  # tensor bytes, as the index's metadata counts them

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if name in self._names:
                raise LlmoptError(f"tensor {name!r} written twice")
            if t.dtype not in _ST_DTYPES:
                raise LlmoptError(f"tensor {name!r}: safetensors has no {t.dtype}")
            size = t.numel() * t.element_size()
            if self._entries and self._size + size > self.max_bytes:
                self._close_shard()
            if self._data is None:
                self._data = open(self._tmp(len(self._written)).with_suffix(".data"), "wb")  # noqa: SIM115
            self._data.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            self._entries[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                                   "data_offsets": [self._size, self._size + size]}
            self._names.add(name)
            self._size += size
            self.total_bytes += size

    def _tmp(self, i: int) -> Path:
        return self.directory / f".shard-{i:05d}.safetensors"

    def _close_shard(self) -> None:
        """Header, then the data file copied behind it: one safetensors file."""
        path = self._tmp(len(self._written))
        data = path.with_suffix(".data")
        if self._data is not None:
            self._data.close()
        else:
            data.write_bytes(b"")
        header = json.dumps({"__metadata__": {"format": "pt"}, **self._entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        with open(path, "wb") as out, open(data, "rb") as src:
            out.write(struct.pack("<Q", len(header)) + header)
            shutil.copyfileobj(src, out, _COPY_CHUNK)
        data.unlink()
        self._written.append((path, list(self._entries)))
        self._data, self._entries, self._size = None, {}, 0

    def finish(self) -> list[Path]:
        """Write what is left and give every shard its final name (plus the index when there are several);
        returns the shard files."""
        if self._entries or not self._written:
            self._close_shard()
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
