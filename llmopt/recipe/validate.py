"""Turn a recipe file (+ environment + `--set` overrides) into a `ResolvedRecipe`, or a list of located issues.

Order, and why:
1. read and parse the YAML (syntax errors, empty file, not a mapping, duplicate keys: nothing else
   makes sense without a mapping);
2. interpolate `${VAR}` from the environment, then apply `--set` (overrides are final values);
3. unknown keys with `did you mean` (a typo explains most of what would follow);
4. the schema (types, bounds, choices), with pydantic's messages made one-line and located;
5. each enabled stage's own checks: the library config of its command is built (all its validators run),
   gate expressions are parsed and their metrics checked, and every file the recipe names must exist.
Steps 1-4 stop at the first step that finds problems; step 5 reports everything it finds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from llmopt.errors import LlmoptError
from llmopt.recipe.files import resolve_model_ref
from llmopt.recipe.interpolate import interpolate
from llmopt.recipe.issues import Issue, KeyPath, RecipeInvalid
from llmopt.recipe.keys import unknown_keys
from llmopt.recipe.loader import RecipeSource, load_recipe_file
from llmopt.recipe.overrides import apply_overrides
from llmopt.recipe.resolved import ResolvedRecipe, locate_issue
from llmopt.recipe.schema import Recipe, empty_sections_filled
from llmopt.recipe.skip_gates import drop_gates
from llmopt.recipe.stages import STAGE_NAMES, STAGES, Stage
from llmopt.recipe.suggest import did_you_mean


def _key_path(data: Any, loc: Sequence[Any]) -> KeyPath:
    """Pydantic's `loc` as a path into the data (dropping union/validator tags that are not keys)."""
    path: list[str | int] = []
    node = data
    for n, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
            path.append(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
            path.append(part)
        elif n == len(loc) - 1 and isinstance(part, str) and isinstance(node, dict):
            path.append(part)  # a missing key
    return tuple(path)


def _message(err: Mapping[str, Any]) -> str:
    kind = err.get("type", "")
    msg = str(err.get("msg", "invalid value"))
    if kind == "missing":
        return "required key missing"
    if kind.startswith("value_error") or kind == "assertion_error":
        return msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    text = msg[:1].lower() + msg[1:]
    value = err.get("input")
    if not isinstance(value, (dict, list)):
        text += f", got {value!r}"
    if kind in ("literal_error", "enum") and isinstance(value, str):
        expected = str((err.get("ctx") or {}).get("expected", ""))
        choices = [c.strip().strip("'") for c in expected.replace(" or ", ",").split(",") if c.strip()]
        text += did_you_mean(value, choices)
    return text


def schema_issues(e: ValidationError, data: dict[str, Any], source: RecipeSource,
                  overridden: set[KeyPath]) -> list[Issue]:
    out = []
    for err in e.errors():
        if err.get("type") == "extra_forbidden":
            continue  # reported by unknown_keys
        out.append(locate_issue(source, overridden, _key_path(data, err.get("loc", ())), _message(err)))
    return out


def _dedupe(issues: list[Issue]) -> list[Issue]:
    seen, out = set(), []
    for i in issues:
        if i.format() not in seen:
            seen.add(i.format())
            out.append(i)
    return out


def resolve_recipe(path: str | Path, overrides: Sequence[str] = (), env: Mapping[str, str] | None = None,
                   skip: Sequence[str] = ()) -> ResolvedRecipe:
    """Steps 1-4: a typed recipe, or RecipeInvalid with every problem of the first failing step."""
    source = load_recipe_file(path)
    env = os.environ if env is None else env
    data, issues = interpolate(empty_sections_filled(source.data), env)
    if issues:
        raise RecipeInvalid([locate_issue(source, set(), i.path, i.message) for i in issues])
    data, overridden, issues = apply_overrides(data, overrides)
    if issues:
        raise RecipeInvalid(issues)
    data, skipped, issues = drop_gates(data, skip)
    if issues:
        raise RecipeInvalid(issues)
    unknown = [locate_issue(source, overridden, i.path, i.message) for i in unknown_keys(data, Recipe)]
    if unknown:
        raise RecipeInvalid(unknown)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeInvalid(_dedupe(schema_issues(e, data, source, overridden))) from None
    try:
        model_ref = resolve_model_ref(recipe.model, source.base_dir)
    except LlmoptError as e:
        raise RecipeInvalid([locate_issue(source, overridden, ("model",), str(e))]) from None
    return ResolvedRecipe(source=source, recipe=recipe, data=data, model_ref=model_ref, overridden=overridden,
                          overrides=list(overrides), skipped_gates=skipped)


def check_model(rr: ResolvedRecipe) -> list[Issue]:
    """The model must be something `llmopt` can read (a config is enough here; weights are checked per stage)."""
    from llmopt.models.resolve import resolve_model

    try:
        resolve_model(rr.model_ref)
    except LlmoptError as e:
        return [rr.issue(("model",), str(e))]
    return []


def enabled_stages(rr: ResolvedRecipe) -> list[Stage]:
    return [s for s in STAGES if s.enabled(rr)]


def check_stages(rr: ResolvedRecipe) -> list[Issue]:
    """Step 5 for every stage the recipe enables."""
    issues = check_model(rr)
    for s in enabled_stages(rr):
        issues += s.check(rr)
    return _dedupe(issues)


def select_stages(rr: ResolvedRecipe, names: str | Sequence[str] | None) -> list[Stage]:
    """The stages to run: all the recipe enables, or those named by `--stages` (in pipeline order)."""
    enabled = enabled_stages(rr)
    if names is None:
        return enabled
    wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    if not wanted:
        raise RecipeInvalid([Issue(f"no stage named; choose from {', '.join(STAGE_NAMES)}", source="--stages")])
    issues = []
    for n in wanted:
        if n not in STAGE_NAMES:
            hint = did_you_mean(n, STAGE_NAMES)
            issues.append(Issue(f"unknown stage {n!r}{hint} (stages: {', '.join(STAGE_NAMES)})", source="--stages"))
        elif not any(s.name == n for s in enabled):
            why = "serve.smoke is not true" if n == "serve" and rr.recipe.serve is not None else \
                f"it has no `{next(s for s in STAGES if s.name == n).section}` section"
            issues.append(Issue(f"stage {n!r} is not part of this recipe ({why})", source="--stages"))
    if issues:
        raise RecipeInvalid(issues)
    return [s for s in enabled if s.name in wanted]


def validate_recipe(path: str | Path, overrides: Sequence[str] = (), env: Mapping[str, str] | None = None,
                    stages: str | Sequence[str] | None = None, skip_gates: Sequence[str] = ()
                    ) -> tuple[ResolvedRecipe, list[Stage]]:
    """Everything `llmopt recipe validate` and `llmopt run` check before any work starts."""
    rr = resolve_recipe(path, overrides, env, skip_gates)
    selected = select_stages(rr, stages)
    issues = check_stages(rr)
    if issues:
        raise RecipeInvalid(issues)
    return rr, selected
