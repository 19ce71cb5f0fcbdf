"""A recipe after reading, interpolation, overrides and schema validation: what stages are built from.

It keeps the typed `Recipe`, the data it was validated from (for `recipe.resolved.yaml`), where each key
came from (file line or `--set`, for messages) and the folder relative paths are read from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt.recipe.files import existing_file, looks_like_path, resolve_file, resolve_model_ref
from llmopt.recipe.issues import Issue, KeyPath
from llmopt.recipe.loader import RecipeSource
from llmopt.recipe.schema import Recipe


def locate_issue(source: RecipeSource, overridden: set[KeyPath], path: KeyPath, message: str) -> Issue:
    """An Issue at `path`: reported at `--set` when an override wrote it (or a parent), else at its line."""
    if any(path[:len(p)] == p for p in overridden):
        return Issue(message, path, "--set")
    return Issue(message, path, source.display, source.lines.line(path))


@dataclass
class ResolvedRecipe:
    source: RecipeSource
    recipe: Recipe
    data: dict[str, Any]
    model_ref: str  # alias or absolute path
    overridden: set[KeyPath] = field(default_factory=set)
    overrides: list[str] = field(default_factory=list)
    skipped_gates: list[str] = field(default_factory=list)  # `section: gate`, left out by --skip-gate

    @property
    def base_dir(self) -> Path:
        return self.source.base_dir

    def issue(self, path: KeyPath, message: str) -> Issue:
        return locate_issue(self.source, self.overridden, path, message)

    def file(self, value: str | Path, what: str, *, directory_ok: bool = False) -> Path:
        """A file the recipe names, resolved against the recipe's folder; LlmoptError when missing."""
        return existing_file(self.base_dir, value, what, directory_ok=directory_ok)

    def data_source(self, value: str) -> str:
        """A calibration source: an existing local path made absolute, or a `datasets` name as is."""
        p = resolve_file(self.base_dir, value)
        if p.exists():
            return str(p)
        if looks_like_path(value):
            return str(self.file(value, "calibration data", directory_ok=True))  # raises: missing
        return value


def resolved_document(rr: ResolvedRecipe) -> dict[str, Any]:
    """The validated recipe with every default filled in and every path absolute (`recipe.resolved.yaml`).

    It is itself a valid recipe: rerunning it from anywhere repeats the run.
    """
    doc = rr.recipe.model_dump(mode="json", exclude_none=True)
    doc["model"] = rr.model_ref
    cal = doc.get("calibration")
    if cal:
        for src in cal["data"]:
            src["path"] = rr.data_source(src["path"])
        cal["eval_data"] = [str(rr.file(f, "file")) for f in cal.get("eval_data", [])]
    q = doc.get("quantize")
    if q and q.get("eval_data"):
        q["eval_data"] = str(rr.file(q["eval_data"], "file"))
    ev = doc.get("eval")
    if ev:
        if ev.get("ppl_data"):
            ev["ppl_data"] = str(rr.file(ev["ppl_data"], "file"))
        ev["tasks"] = [str(rr.file(t, "file")) for t in ev.get("tasks", [])]
        if ev.get("baseline"):
            ev["baseline"] = resolve_model_ref(ev["baseline"], rr.base_dir)
    bench = doc.get("bench")
    if bench and bench.get("dataset"):
        bench["dataset"] = str(rr.file(bench["dataset"], "file"))
    return doc
