"""lm-eval's prompt fields, rendered exactly as lm-evaluation-harness renders them.

A task's `doc_to_text`, `doc_to_target` and `doc_to_choice` may each be a field name of the document,
a Jinja2 template, or a literal (int, list, dict). lm-eval renders templates with a strict-undefined
environment that keeps the trailing newline and adds a `regex_replace` filter, and then *re-parses*
some results: a target that renders to digits becomes an int index when the task has choices, a
bracketed target becomes a list, and `doc_to_choice` templates are `ast.literal_eval`-ed into a list.
Reproducing those rules (lm_eval/api/task.py, lm_eval/utils.py in lm-eval 0.4.x) is what makes our
accuracies comparable with the harness. Templates are compiled once, when the task is loaded, so a
syntax error is reported before any model runs.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import jinja2
from jinja2 import BaseLoader, Environment, StrictUndefined

from llmopt.errors import LlmoptError


def _regex_replace(string: str, pattern: str, repl: str, count: int = 0) -> str:
    return re.sub(pattern, repl, string, count=count)


_ENV = Environment(loader=BaseLoader(), undefined=StrictUndefined, keep_trailing_newline=True)
_ENV.filters["regex_replace"] = _regex_replace


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class Field:
    """One doc_to_* setting of a task: a field name, a Jinja template, or a literal value."""

    def __init__(self, task: str, key: str, spec: Any):
        self.task, self.key, self.spec = task, key, spec
        self._template: jinja2.Template | None = None
        if isinstance(spec, str):
            try:
                self._template = _ENV.from_string(spec)
            except jinja2.TemplateSyntaxError as e:
                raise LlmoptError(f"task {task}: bad template in {key}: {_one_line(e)} "
                                  f"(line {e.lineno})") from None
        elif not isinstance(spec, (int, list, dict)) or isinstance(spec, bool):
            raise LlmoptError(f"task {task}: {key} must be a field name, a Jinja template, an int or a list, "
                              f"not {type(spec).__name__}")

    def render(self, doc: dict[str, Any]) -> str:
        assert self._template is not None
        try:
            return self._template.render(**doc)
        except jinja2.TemplateError as e:
            raise LlmoptError(f"task {self.task}: cannot render {self.key} for doc {_doc_id(doc)}: "
                              f"{_one_line(e)}") from None
        except Exception as e:  # errors raised by expressions inside the template (e.g. a bad index)
            raise LlmoptError(f"task {self.task}: cannot render {self.key} for doc {_doc_id(doc)}: "
                              f"{type(e).__name__}: {_one_line(e)}") from None

    def is_field(self, doc: dict[str, Any]) -> bool:
        return isinstance(self.spec, str) and self.spec in doc


def _doc_id(doc: dict[str, Any]) -> str:
    for k in ("id", "idx", "doc_id"):
        if k in doc:
            return repr(doc[k])
    return "(no id field)"


class DocRenderer:
    """doc_to_text / doc_to_target / doc_to_choice with lm-eval's exact conversion rules."""

    def __init__(self, task: str, doc_to_text: Any, doc_to_target: Any, doc_to_choice: Any | None):
        self.task = task
        self.text = Field(task, "doc_to_text", doc_to_text)
        self.target = Field(task, "doc_to_target", doc_to_target)
        self.choice = Field(task, "doc_to_choice", doc_to_choice) if doc_to_choice is not None else None

    def doc_to_text(self, doc: dict[str, Any]) -> str | int:
        f = self.text
        if isinstance(f.spec, int):
            return f.spec
        if f.is_field(doc):
            return doc[f.spec]
        s = f.render(doc)
        if s.isdigit() and self.choice is not None:
            return ast.literal_eval(s)
        return s

    def doc_to_target(self, doc: dict[str, Any]) -> int | str | list:
        f = self.target
        if isinstance(f.spec, (int, list)):
            return f.spec
        if isinstance(f.spec, dict):
            raise LlmoptError(f"task {self.task}: doc_to_target cannot be a mapping")
        if f.is_field(doc):
            return doc[f.spec]
        s = f.render(doc)
        if s.isdigit() and self.choice is not None:
            return ast.literal_eval(s)
        if len(s) >= 2 and s[0] == "[" and s[-1] == "]":
            try:
                return ast.literal_eval(s)
            except (SyntaxError, ValueError):
                return s
        return s

    def doc_to_choice(self, doc: dict[str, Any]) -> list[str]:
        f = self.choice
        if f is None:
            raise LlmoptError(f"task {self.task}: doc_to_choice is required for multiple_choice")
        if isinstance(f.spec, list):
            choices: Any = f.spec
        elif isinstance(f.spec, dict):
            choices = list(f.spec.values())
        elif f.is_field(doc):
            choices = doc[f.spec]
        else:
            rendered = f.render(doc)
            try:
                choices = ast.literal_eval(rendered)
            except (SyntaxError, ValueError):
                raise LlmoptError(f"task {self.task}: doc_to_choice rendered {rendered[:60]!r} for doc "
                                  f"{_doc_id(doc)}, which is not a Python list literal") from None
        if not isinstance(choices, (list, tuple)) or not all(isinstance(c, str) for c in choices):
            raise LlmoptError(f"task {self.task}: doc_to_choice must give a list of strings for doc {_doc_id(doc)}")
        return list(choices)
