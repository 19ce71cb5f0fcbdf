"""The `llmopt run`, `llmopt recipe validate` and `llmopt recipe schema` commands as one library call each,
so cli.py stays a parser: printing, the JSON output and the exit code are decided here."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from rich.console import Console

from llmopt.errors import GateFailed, LlmoptError
from llmopt.recipe.issues import RecipeInvalid
from llmopt.recipe.runner import RunRequest, run_recipe
from llmopt.recipe.summary import RunReport, render_table


def run_command(req: RunRequest, as_json: bool = False, console: Console | None = None,
                err_console: Console | None = None) -> RunReport:
    """Run the recipe; print the summary (table, or JSON on stdout); raise GateFailed (exit 1) on a failed gate.

    Stage output goes to `err_console` with --json (stdout carries only the JSON), else to `console`.
    """
    console = console or Console()
    err_console = err_console or Console(stderr=True)
    report = run_recipe(req, err_console if as_json else console)
    if as_json:
        sys.stdout.write(json.dumps(report.to_json(), indent=2, default=str) + "\n")
    else:
        render_table(report, console)
    message = report.gate_failure()
    if message:
        raise GateFailed(message)
    return report


def _error(console: Console, message: str) -> None:
    console.print("[bold red]error:[/] ", end="")
    console.print(message, markup=False, highlight=False, soft_wrap=True)


def validate_command(recipe: str | Path, overrides: Sequence[str] = (), stages: str | None = None,
                     env: Mapping[str, str] | None = None, console: Console | None = None,
                     err_console: Console | None = None) -> int:
    """Print every problem, one line each (exit 2), or what the recipe would run (exit 0)."""
    from llmopt.recipe.validate import validate_recipe

    console = console or Console()
    err_console = err_console or Console(stderr=True)
    try:
        rr, selected = validate_recipe(recipe, overrides, env, stages)
    except RecipeInvalid as e:
        for issue in e.issues:
            _error(err_console, issue.format())
        return 2
    except LlmoptError as e:
        _error(err_console, str(e))
        return e.exit_code
    names = ", ".join(s.name for s in selected) or "none"
    console.print(f"{recipe}: ok (stages: {names})", markup=False, highlight=False, soft_wrap=True)
    return 0


def schema_text() -> str:
    from llmopt.recipe.schema import recipe_json_schema

    return json.dumps(recipe_json_schema(), indent=2) + "\n"
