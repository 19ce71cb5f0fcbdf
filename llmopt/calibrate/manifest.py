"""`manifest.json` of a calibration directory: what data, model, tokenizer and settings made it.

It makes a calibration reproducible and lets `quantize --calib DIR` refuse stats that were measured
on a different model or tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from llmopt._version import __version__
from llmopt.calibrate.sources import DataSource, file_sha256
from llmopt.errors import LlmoptError
from llmopt.models.resolve import ResolvedModel

MANIFEST = "manifest.json"
STATS = "stats.safetensors"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "merges.txt")


class FileHash(BaseModel):
    path: str
    sha256: str


class ModelIdentity(BaseModel):
    """The model a calibration belongs to: its source, config and weights, and its tokenizer."""

    source: str
    config_sha256: str
    weights: list[FileHash]
    tokenizer: list[FileHash]

    @classmethod
    def of(cls, resolved: ResolvedModel, directory: Path) -> ModelIdentity:
        """Hash what is on disk in the weights `directory`, never an in-memory config: the same model
        must get the same identity whichever path built it (a cold GGUF conversion or a warm cache)."""
        return cls(
            source=resolved.source,
            config_sha256=_config_sha256(directory / "config.json"),
            weights=[FileHash(path=f.name, sha256=file_sha256(f)) for f in sorted(directory.glob("*.safetensors"))],
            tokenizer=[FileHash(path=n, sha256=file_sha256(directory / n)) for n in _TOKENIZER_FILES
                       if (directory / n).is_file()],
        )

    def mismatch(self, other: ModelIdentity) -> str | None:
        """Why `other` is not the same model (None when it is)."""
        if self.weights != other.weights or self.config_sha256 != other.config_sha256:
            return "different model weights or config"
        if self.tokenizer != other.tokenizer:
            return "different tokenizer"
        return None


def _config_sha256(path: Path) -> str:
    """sha256 of a config.json's content, key order and whitespace normalized."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LlmoptError(f"cannot read {path}: {e}") from None
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()


class DataRecord(BaseModel):
    source: str
    weight: float
    windows: int
    files: list[FileHash]


class Manifest(BaseModel):
    model_config = ConfigDict(extra="allow")

    kind: str = "llmopt-calibration"
    llmopt_version: str = __version__
    created: str = ""
    model: ModelIdentity
    data: list[DataRecord]
    settings: dict[str, Any]
    num_windows: int
    seq_len: int
    num_tokens: int
    duplicates_dropped: int
    warnings: list[str] = []
    notes: dict[str, str] = {
        "names": "linear inputs use llmopt's fused module names (layers.N.self_attn.qkv_proj is the input "
                 "of q, k and v; layers.N.mlp.gate_up_proj of gate and up)",
        "k_absmax": "measured after RoPE, i.e. exactly what the KV cache stores",
    }

    def write(self, path: Path) -> None:
        self.created = self.created or datetime.now(UTC).isoformat(timespec="seconds")
        path.write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST
        if not path.is_file():
            raise LlmoptError(f"{directory} is not a calibration directory (no {MANIFEST})")
        try:
            return cls.model_validate_json(path.read_text())
        except ValueError as e:
            raise LlmoptError(f"{path} is not a valid calibration manifest: {str(e).splitlines()[0]}") from None


def data_record(source: DataSource, windows: int) -> DataRecord:
    files = source.files() if source.is_local else []
    return DataRecord(source=source.path, weight=source.weight, windows=windows,
                      files=[FileHash(path=str(f), sha256=file_sha256(f)) for f in files])
