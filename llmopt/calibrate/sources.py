"""Calibration text sources: local text/jsonl/csv/parquet files or directories, or a `datasets` name.

Everything is read through `datasets.load_dataset` (the same reader `eval` uses), so one code path
handles every format; a source is `PATH` or `PATH:WEIGHT` (the weight sets its share of the mix).

In a *directory* source, files without a text column (e.g. the eval sets kept next to the
calibration texts in `calibration_data/`) are skipped with a warning; a file named on its own that has
no text column is an error.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from llmopt.errors import LlmoptError

# file suffix -> datasets builder
_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
             ".csv": "csv", ".parquet": "parquet"}
TEXT_FIELDS = ("text", "content", "document")


def looks_like_data(spec: str) -> bool:
    """Whether `spec` (PATH or PATH:WEIGHT) names calibration data rather than a model: a data-format
    file (not a config.json) or an existing directory without a config.json."""
    p = Path(DataSource.parse(spec).path).expanduser()
    if p.is_dir():
        return not (p / "config.json").is_file()
    return p.suffix.lower() in _BUILDERS and p.name != "config.json"


class DataSource(BaseModel):
    """One calibration source and its mixing weight."""

    model_config = ConfigDict(frozen=True)

    path: str
    weight: float = Field(1.0, gt=0)

    @classmethod
    def parse(cls, spec: str) -> DataSource:
        """`PATH` or `PATH:WEIGHT` (a trailing `:number`; Windows drive letters are not a concern here). A
        weight that is not a positive number is an error (it used to make PATH:0 a path that was not found);
        a file whose name itself ends in `:number` is read as it is."""
        head, sep, tail = spec.rpartition(":")
        if not (sep and head):
            return cls(path=spec)
        try:
            weight = float(tail)
        except ValueError:
            return cls(path=spec)
        if Path(spec).expanduser().exists():
            return cls(path=spec)
        if not (math.isfinite(weight) and weight > 0):
            raise LlmoptError(f"{spec}: the weight after ':' must be a positive number, got {tail}")
        return cls(path=head, weight=weight)

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


class NoTextColumn(LlmoptError):
    """A tabular file without any of TEXT_FIELDS (or `messages` with a chat template)."""


def _rows_to_texts(ds, where: str, tokenizer=None) -> list[str]:
    cols = set(ds.column_names)
    if "messages" in cols and tokenizer is not None:
        return [tokenizer.apply_chat_template(m, tokenize=False) for m in ds["messages"] if m]
    field = next((f for f in TEXT_FIELDS if f in cols), None)
    if field is None:
        raise NoTextColumn(f"{where}: no text column (looked for {', '.join(TEXT_FIELDS)}; found "
                           f"{', '.join(sorted(cols)) or 'none'})")
    return [t for t in ds[field] if isinstance(t, str)]


def _print_warning(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[yellow]warning:[/] {msg}", highlight=False, soft_wrap=True)


def load_texts(source: DataSource, tokenizer=None, warn: Callable[[str], None] | None = None) -> list[str]:
    """All non-empty texts of one source (`messages` rows are rendered with the chat template).

    Files of a directory source that have no text column are skipped, each with one `warn(message)`
    (default: a warning line on stderr); an explicitly named file without one raises.
    """
    if not source.is_local:
        return [t for t in _rows_to_texts(_load("", name=source.path), source.path, tokenizer) if t.strip()]
    in_dir = Path(source.path).expanduser().is_dir()
    texts: list[str] = []
    files = source.files()
    skipped = 0
    for f in files:
        builder = _BUILDERS[f.suffix.lower()]
        try:
            texts.extend(_rows_to_texts(_load(builder, [str(f)]), str(f), tokenizer))
        except NoTextColumn as e:
            if not in_dir:
                raise
            skipped += 1
            (warn or _print_warning)(f"{e}; skipped (a directory source uses only its files with text)")
    if in_dir and skipped == len(files):
        raise LlmoptError(f"{source.path}: none of its {len(files)} data files has a text column "
                          f"({', '.join(TEXT_FIELDS)})")
    return [t for t in texts if t.strip()]
