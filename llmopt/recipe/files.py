"""File references in a recipe: relative to the recipe file, and checked to exist before any work.

Why relative to the recipe: a recipe and its data travel together (a repository, a CI checkout), and
the same recipe must behave the same from any working directory. The model is the one exception that
also falls back to the working directory, because it is usually given through a variable
(`${LLAMA_7B_PATH}`) holding a path the user typed relative to where they are.

A calibration source may also be a `datasets` name (read from the local HF cache), so only values
that look like paths (a separator, a leading `.` or `~`, or a data-file suffix) must exist.
"""

from __future__ import annotations

from pathlib import Path

from llmopt.errors import LlmoptError
from llmopt.models.resolve import ALIASES

_DATA_SUFFIXES = (".txt", ".text", ".md", ".jsonl", ".json", ".csv", ".parquet", ".yaml", ".yml")


def resolve_file(base_dir: Path, value: str | Path) -> Path:
    """`value` as an absolute path, relative paths read from `base_dir` (the recipe's folder)."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base_dir / p).resolve()


def looks_like_path(value: str) -> bool:
    """True for values meant as local paths rather than `datasets` names (`org/name` is a name)."""
    v = value.strip()
    return (v.startswith((".", "/", "~")) or v.endswith("/") or v.lower().endswith(_DATA_SUFFIXES) or "\\" in v
            or v.count("/") > 1)


def resolve_model_ref(value: str, base_dir: Path) -> str:
    """An alias as is; a path made absolute (recipe folder first, then the working directory)."""
    if value in ALIASES:
        return value
    p = Path(value).expanduser()
    if p.is_absolute():
        if not p.exists():
            raise LlmoptError(f"model path {p} does not exist")
        return str(p)
    for candidate in (base_dir / p, Path.cwd() / p):
        if candidate.exists():
            return str(candidate.resolve())
    raise LlmoptError(f"model {value!r} not found: not an alias ({', '.join(ALIASES)}), and neither "
                      f"{base_dir / p} nor {Path.cwd() / p} exists")


def existing_file(base_dir: Path, value: str | Path, what: str, *, directory_ok: bool = False) -> Path:
    """The resolved path of a file the recipe names; LlmoptError when it is missing."""
    p = resolve_file(base_dir, value)
    if p.is_file() or (directory_ok and p.is_dir()):
        return p
    if p.is_dir():
        raise LlmoptError(f"{what} {p} is a directory, not a file")
    raise LlmoptError(f"{what} not found: {p} (relative paths are read from the recipe's folder)")
