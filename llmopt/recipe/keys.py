"""Unknown keys, found by walking the recipe data alongside the schema, with `did you mean` hints.

Pydantic reports an unknown key as `extra_forbidden` at the key's path but does not know which names
were meant; walking the data next to the model classes gives both the path (hence the line) and the
field names that were valid at that spot, so `quantize.sheme` can suggest `scheme`. Unknown keys are
reported before any type error, since a misspelled key usually explains the "missing key" that follows.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel

from llmopt.recipe.issues import Issue, KeyPath
from llmopt.recipe.suggest import did_you_mean


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModel classes an annotation admits (through Optional / Union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _models_in(a)]
    return []


def _item_annotation(annotation: Any, container: type) -> Any | None:
    """`X` of `list[X]` (container=list) or of `dict[str, X]` (container=dict), through Optional."""
    origin = typing.get_origin(annotation)
    if origin is container:
        args = typing.get_args(annotation)
        return args[-1] if args else None
    if origin in (typing.Union, types.UnionType):
        for a in typing.get_args(annotation):
            found = _item_annotation(a, container)
            if found is not None:
                return found
    return None


def _field_names(model: type[BaseModel]) -> dict[str, str]:
    """Accepted key -> field name (aliases included)."""
    names = {}
    for name, info in model.model_fields.items():
        names[name] = name
        if info.alias:
            names[info.alias] = name
    return names


def unknown_keys(data: Any, model: type[BaseModel], path: KeyPath = ()) -> list[Issue]:
    """Every key in `data` that `model` (recursively) does not define."""
    if not isinstance(data, dict):
        return []
    names = _field_names(model)
    issues: list[Issue] = []
    for key, value in data.items():
        field = names.get(key) if isinstance(key, str) else None
        if field is None:
            hint = did_you_mean(str(key), list(names))
            if not hint:
                hint = f" (allowed: {', '.join(model.model_fields)})"
            issues.append(Issue(f"unknown key{hint}", (*path, key)))
            continue
        issues += _walk_value(value, model.model_fields[field].annotation, (*path, key))
    return issues


def _walk_value(value: Any, annotation: Any, path: KeyPath) -> list[Issue]:
    if isinstance(value, dict):
        models = _models_in(annotation)
        if len(models) == 1:
            return unknown_keys(value, models[0], path)
        item = _item_annotation(annotation, dict)
        if item is not None:
            return [i for k, v in value.items() for i in _walk_value(v, item, (*path, k))]
        return []
    if isinstance(value, list):
        item = _item_annotation(annotation, list)
        if item is None:
            return []
        return [i for n, v in enumerate(value) for i in _walk_value(v, item, (*path, n))]
    return []
