"""`--set key.path=value`: change a recipe from the command line without editing the file.

Why: CI matrices and quick experiments (`--set quantize.scheme=w4a16`, `--set bench.concurrency=[1,2]`)
should not need a copy of the recipe. Values are parsed as YAML, so `8` is a number, `[1, 2]` a list and
`null` clears a key, exactly as if written in the file. Overrides apply before validation, so a bad
value gets the same message as one in the file, reported at `--set`. Paths use dots between keys and
`[N]` (or `.N`) for list items; missing mappings on the way are created (`--set bench.gates=[...]`
adds a bench section), but a path cannot descend into a scalar or past the end of a list.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

import yaml

from llmopt.recipe.issues import Issue, KeyPath, format_path

_SEGMENT = re.compile(r"([^.\[\]=]+)|\[(\d+)\]")


def parse_key_path(text: str) -> KeyPath:
    """`eval.gates[0]` or `eval.gates.0` -> ('eval', 'gates', 0); ValueError on malformed paths."""
    if not text or text.startswith(".") or text.endswith(".") or ".." in text:
        raise ValueError(f"bad key path {text!r}: use dotted keys such as quantize.scheme or eval.gates[0]")
    parts: list[str | int] = []
    pos = 0
    while pos < len(text):
        if text[pos] == "." and parts:
            pos += 1
        m = _SEGMENT.match(text, pos)
        if not m:
            raise ValueError(f"bad key path {text!r}: use dotted keys such as quantize.scheme or eval.gates[0]")
        key, index = m.groups()
        if index is not None:
            parts.append(int(index))
        else:
            parts.append(int(key) if key.isdigit() and parts else key)
        pos = m.end()
    if not isinstance(parts[0], str):
        raise ValueError(f"bad key path {text!r}: it must start with a key, not a list index")
    return tuple(parts)


def parse_override(item: str) -> tuple[KeyPath, Any]:
    """`KEY.PATH=VALUE` -> (path, YAML-typed value); ValueError with a one-line reason."""
    key, sep, raw = item.partition("=")
    if not sep:
        raise ValueError("expected KEY.PATH=VALUE, e.g. --set quantize.scheme=w4a16")
    path = parse_key_path(key.strip())
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"the value is not valid YAML ({problem}); quote it to pass a string") from None
    return path, value


def _set(data: dict[str, Any], path: KeyPath, value: Any) -> None:
    node: Any = data
    for depth, part in enumerate(path[:-1]):
        here = format_path(path[:depth + 1])
        if isinstance(part, int):
            if not isinstance(node, list):
                raise ValueError(f"{format_path(path[:depth]) or 'the recipe'} is not a list")
            if part >= len(node):
                raise ValueError(f"{here}: index {part} is out of range ({len(node)} item(s))")
            node = node[part]
            continue
        if not isinstance(node, dict):
            raise ValueError(f"{format_path(path[:depth])} is a {type(node).__name__}, not a mapping")
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
    last = path[-1]
    if isinstance(last, int):
        if not isinstance(node, list):
            raise ValueError(f"{format_path(path[:-1])} is not a list")
        if last > len(node):
            raise ValueError(f"{format_path(path)}: index {last} is out of range ({len(node)} item(s))")
        if last == len(node):
            node.append(value)  # one past the end appends
        else:
            node[last] = value
        return
    if not isinstance(node, dict):
        where = format_path(path[:-1])
        raise ValueError(f"{where} is a {type(node).__name__}, not a mapping")
    node[last] = value


def apply_overrides(data: dict[str, Any], items: Sequence[str]) -> tuple[dict[str, Any], set[KeyPath], list[Issue]]:
    """A copy of `data` with every `--set` applied in order, the paths they set, and the problems."""
    out = copy.deepcopy(data)
    done: set[KeyPath] = set()
    issues: list[Issue] = []
    for item in items:
        try:
            path, value = parse_override(item)
            _set(out, path, value)
        except ValueError as e:
            issues.append(Issue(f"{item!r}: {e}", source="--set"))
            continue
        done.add(path)
    return out, done, issues
