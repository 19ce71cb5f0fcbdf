"""Content fingerprints of stage inputs and artifacts, and the stage key built from them.

A stage is skipped when its key is unchanged: the key hashes the stage's resolved config, the content of
every input file, the model, the fingerprints of the upstream artifacts it reads, and the llmopt source.
Files up to `CONTENT_HASH_LIMIT` are hashed by content; larger ones (model weights, checkpoints: reading
13 GB of a 7B model on every run would cost a minute) by size and modification time, which changes
whenever such a file is rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from llmopt._version import __version__

CONTENT_HASH_LIMIT = 64 * 1024**2
CHUNK = 1 << 20


def file_fingerprint(path: Path) -> str:
    st = path.stat()
    if st.st_size > CONTENT_HASH_LIMIT:
        return f"stat:{st.st_size}:{st.st_mtime_ns}"
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def tree_fingerprint(path: Path) -> str:
    """A file's fingerprint, or one over a directory's files (names and fingerprints, sorted)."""
    if path.is_file():
        return file_fingerprint(path)
    if not path.is_dir():
        return f"missing:{path}"
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path).as_posix()}\0{file_fingerprint(f)}\n".encode())
    return "tree:" + h.hexdigest()


def input_fingerprint(value: str) -> str:
    """An input that may be a local path (fingerprinted) or a name such as a `datasets` id (kept as is)."""
    p = Path(value)
    return tree_fingerprint(p) if p.exists() else f"name:{value}"


def model_fingerprint(model_ref: str) -> str:
    """The model's files: for an alias, the file it resolves to; for a path, its contents."""
    from llmopt.models.resolve import ALIASES, resolve_model

    if model_ref in ALIASES:
        return f"{model_ref}:{file_fingerprint(resolve_model(model_ref).path)}"
    return input_fingerprint(model_ref)


@functools.cache
def code_fingerprint() -> str:
    """The llmopt source that would run: a changed quantizer must not be skipped as "unchanged".

    The version number alone is not enough between releases (a development checkout, a CI run of a
    pull request), and hashing ~100 small files costs milliseconds.
    """
    package = Path(__file__).resolve().parents[1]  # llmopt/
    h = hashlib.sha256()
    for f in sorted(package.rglob("*.py")):
        h.update(f"{f.relative_to(package).as_posix()}\0".encode() + f.read_bytes())
    return h.hexdigest()


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


# what a changed part is called when a stage reruns ("inputs changed: options, data files")
PART_NAMES = {"options": "options", "files": "data files", "models": "model", "upstream": "upstream artifacts",
              "code": "llmopt version or source"}


def stage_key(stage: str, inputs: dict[str, Any], model_ref: str | None, upstream: dict[str, str]
              ) -> tuple[str, dict[str, str]]:
    """The hash that decides whether `stage` must run again, and the hashes of its parts (to say why).

    `inputs` is the stage's resolved config; its `files` (paths) and `models` (model refs) entries are
    replaced by their fingerprints: editing a file (or the model) reruns the stage, while moving the
    recipe with its data (another checkout, a CI cache restored elsewhere) does not.
    """
    options = {k: v for k, v in inputs.items() if k not in ("files", "models")}
    models = [model_fingerprint(m) for m in inputs.get("models", [])]
    if model_ref:
        models.insert(0, model_fingerprint(model_ref))
    parts = {
        "options": _digest({"stage": stage, **options}),
        "files": _digest([input_fingerprint(f) for f in inputs.get("files", [])]),
        "models": _digest(models),
        "upstream": _digest(upstream),
        "code": _digest([__version__, code_fingerprint()]),
    }
    return _digest(parts), parts


def changed_parts(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Names of the parts that differ (all of them when the old record has none)."""
    return [PART_NAMES[k] for k in new if old.get(k) != new[k]]
