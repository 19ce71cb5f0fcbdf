"""Calibration text sources: local text/jsonl/csv/parquet files or directories, or a `datasets` name.

Everything is read through `datasets.load_dataset` (the same reader `eval` uses), so one code path
handles every format; a source is `PATH` or `PATH:WEIGHT` (the weight sets its share of the mix).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from llmopt.errors import LlmoptError

# file suffix -> datasets builder
_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
             ".csv": "csv", ".parquet": "parquet"}
TEXT_FIELDS = ("text", "content", "document")


class DataSource(BaseModel):
    """One calibration source and its mixing weight."""

    model_config = ConfigDict(frozen=True)

    path: str
    weight: float = Field(1.0, gt=0)

    @classmethod
    def parse(cls, spec: str) -> DataSource:
        """`PATH` or `PATH:WEIGHT` (a trailing `:number`; Windows drive letters are not a concern here)."""
        head, sep, tail = spec.rpartition(":")
        if sep and head:
            try:
                return cls(path=head, weight=float(tail))
            except ValueError:
                pass
        return cls(path=spec)

    @property
    def is_local(self) -> bool:
        return Path(self.path).expanduser().exists()

    def files(self) -> list[Path]:
        """The data files of a local source (a directory contributes every file of a known format)."""
        p = Path(self.path).expanduser()
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in _BUILDERS)
            if not found:
                raise LlmoptError(f"{p} contains no {'/'.join(sorted(_BUILDERS))} files")
            return found
        if p.suffix.lower() not in _BUILDERS:
            raise LlmoptError(f"{p}: unknown data format {p.suffix!r}; use {', '.join(sorted(_BUILDERS))}")
        return [p]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _load(builder: str, files: list[str] | None = None, name: str | None = None):
    import datasets

    datasets.disable_progress_bars()
    try:
        if name is not None:
            return datasets.load_dataset(name, split="train")
        # a text file is one document: the default line split would cut paragraphs apart
        extra = {"sample_by": "document"} if builder == "text" else {}
        return datasets.load_dataset(builder, data_files=files, split="train", **extra)
    except Exception as e:  # datasets raises many kinds (connection, format, schema)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        where = name if name is not None else ", ".join(files or [])
        if name is not None:
            raise LlmoptError(f"calibration data {name!r} is not a local path and could not be loaded with "
                              f"datasets.load_dataset (offline?): {first}") from None
        raise LlmoptError(f"cannot read {where}: {first}") from None


def _rows_to_texts(ds, where: str, tokenizer=None) -> list[str]:
    cols = set(ds.column_names)
    if "messages" in cols and tokenizer is not None:
        return [tokenizer.apply_chat_template(m, tokenize=False) for m in ds["messages"] if m]
    field = next((f for f in TEXT_FIELDS if f in cols), None)
    if field is None:
        raise LlmoptError(f"{where}: no text column (looked for {', '.join(TEXT_FIELDS)}; found "
                          f"{', '.join(sorted(cols)) or 'none'})")
    return [t for t in ds[field] if isinstance(t, str)]


def load_texts(source: DataSource, tokenizer=None) -> list[str]:
    """All non-empty texts of one source (`messages` rows are rendered with the chat template)."""
    if not source.is_local:
        return [t for t in _rows_to_texts(_load("", name=source.path), source.path, tokenizer) if t.strip()]
    texts: list[str] = []
    for f in source.files():
        builder = _BUILDERS[f.suffix.lower()]
        texts.extend(_rows_to_texts(_load(builder, [str(f)]), str(f), tokenizer))
    return [t for t in texts if t.strip()]
