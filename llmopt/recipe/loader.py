"""Read a recipe file into plain data plus a line map, with one-line errors for files that are not a recipe.

YAML errors keep PyYAML's own explanation and its line; an empty file, a file whose top level is not
a mapping, duplicate keys (which PyYAML would silently collapse, last one wins) and keys that are not
names are refused here, before any schema check, because nothing after them would make sense.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmopt.recipe.issues import Issue, RecipeInvalid
from llmopt.recipe.locate import LineMap


@dataclass
class RecipeSource:
    """A recipe as read from disk: its data, where each key is, and the folder its paths are relative to."""

    path: Path
    display: str  # the file as the user named it, used in every message
    data: dict[str, Any]
    lines: LineMap

    @property
    def base_dir(self) -> Path:
        return self.path.resolve().parent


def _yaml_issue(display: str, err: yaml.YAMLError) -> Issue:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    if "<stream end>" in problem and getattr(err, "context_mark", None) is not None:
        mark = err.context_mark  # an unclosed bracket or quote: point where it was opened
    context = getattr(err, "context", None)
    text = " ".join(f"{problem}{f' ({context})' if context else ''}".split())
    return Issue(f"invalid YAML: {text}", source=display, line=None if mark is None else mark.line + 1)


def parse_recipe_text(text: str, display: str, path: Path | None = None) -> RecipeSource:
    """Parse recipe YAML text; `display` names it in messages."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        raise RecipeInvalid([_yaml_issue(display, e)]) from None
    finally:
        loader.dispose()
    if node is None or data is None:
        raise RecipeInvalid([Issue("empty recipe: expected a mapping with at least a `model` key",
                                   source=display, line=1)])
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"a single {type(data).__name__} value"
        raise RecipeInvalid([Issue(f"a recipe must be a mapping of sections (model, calibration, quantize, "
                                   f"...), not {kind}", source=display, line=node.start_mark.line + 1)])
    lines = LineMap(node)
    if lines.problems:
        raise RecipeInvalid([Issue(p.message, p.path, display, p.line) for p in lines.problems])
    return RecipeSource(path=path or Path(display), display=display, data=data, lines=lines)


def load_recipe_file(path: str | Path) -> RecipeSource:
    """Read and parse the recipe at `path` (one-line RecipeInvalid when it cannot be read or parsed)."""
    p = Path(path)
    display = str(path)
    if not p.is_file():
        why = "is a directory" if p.is_dir() else "does not exist"
        raise RecipeInvalid([Issue(f"recipe file {why}", source=display)])
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeInvalid([Issue(f"cannot read the recipe: {e}", source=display)]) from None
    return parse_recipe_text(text, display, p)
