"""A located problem in a recipe, and the error that carries a list of them.

Recipes are edited by hand and run in CI, so every problem is reported as one line that says where it
is (`recipe.yaml:14`, or `--set` for a command-line override) and which key it concerns
(`quantize.scheme`), so the fix is obvious without a traceback. `llmopt recipe validate` prints them all;
`llmopt run` stops on the first (and says how many more there are).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmopt.errors import LlmoptError

KeyPath = tuple[str | int, ...]


def format_path(path: KeyPath) -> str:
    """`('eval', 'gates', 0)` -> `eval.gates[0]`: how a user would point at the key in the YAML."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


@dataclass(frozen=True)
class Issue:
    """One problem: where (file and line, or `--set`), which key, and what is wrong."""

    message: str
    path: KeyPath = ()
    source: str = ""  # the recipe file as the user named it, or "--set"
    line: int | None = None  # 1-based

    def format(self) -> str:
        where = self.source
        if self.line is not None and self.source != "--set":
            where = f"{where}:{self.line}"
        key = format_path(self.path)
        parts = [p for p in (where, key) if p]
        return ": ".join([*parts, self.message])


class RecipeInvalid(LlmoptError):
    """The recipe (or an override, or an input it names) is wrong; exit code 2 before any work starts."""

    def __init__(self, issues: Sequence[Issue]):
        if not issues:
            raise ValueError("RecipeInvalid needs at least one issue")
        self.issues = list(issues)
        more = len(self.issues) - 1
        tail = f" (and {more} more problem{'s' if more > 1 else ''}; `llmopt recipe validate` lists them)" if more else ""
        super().__init__(self.issues[0].format() + tail)
