"""`${VAR}` and `${VAR:-default}` in recipe string values, from the environment.

Why: one recipe serves several machines and CI jobs (a model path, a GPU size, a sample count), and the
shell's own syntax is what people already know. Semantics follow POSIX sh: `${VAR:-default}` uses the
default when VAR is unset *or empty*; `$$` is a literal `$`. A variable that is unset and has no default
is an error naming the variable and the line, not an empty string that would fail later and obscurely.
Only values are interpolated, never keys; a value that is entirely `${N}` stays a string and the schema
converts it (`"32"` -> 32) like any other YAML string.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from llmopt.recipe.issues import Issue, KeyPath

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def interpolate_string(text: str, env: Mapping[str, str]) -> str:
    """Expand one string; raises ValueError with a one-line reason."""
    out: list[str] = []
    i = 0
    while i < len(text):
        j = text.find("$", i)
        if j < 0:
            out.append(text[i:])
            break
        out.append(text[i:j])
        nxt = text[j + 1:j + 2]
        if nxt == "$":
            out.append("$")
            i = j + 2
            continue
        if nxt != "{":
            out.append("$")  # a lone `$` (e.g. in a regex) is kept as written
            i = j + 1
            continue
        end = text.find("}", j + 2)
        if end < 0:
            raise ValueError(f"unterminated '${{' in {text!r}: write ${{VAR}} or ${{VAR:-default}} ($$ for a literal $)")
        body = text[j + 2:end]
        name, sep, default = body.partition(":-")
        if not _NAME.match(name):
            raise ValueError(f"bad variable reference '${{{body}}}': use ${{NAME}} or ${{NAME:-default}} with "
                             "NAME made of letters, digits and _")
        value = env.get(name)
        if sep:
            out.append(value if value else default)
        elif value is None:
            raise ValueError(f"environment variable {name} is not set (export it, or write ${{{name}:-default}})")
        else:
            out.append(value)
        i = end + 1
    return "".join(out)


def interpolate(data: Any, env: Mapping[str, str], path: KeyPath = ()) -> tuple[Any, list[Issue]]:
    """A copy of `data` with every string value expanded, and the problems found (with their key paths)."""
    issues: list[Issue] = []
    if isinstance(data, str):
        try:
            return interpolate_string(data, env), issues
        except ValueError as e:
            return data, [Issue(str(e), path)]
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            out[k], found = interpolate(v, env, (*path, k))
            issues += found
        return out, issues
    if isinstance(data, list):
        items = []
        for n, v in enumerate(data):
            value, found = interpolate(v, env, (*path, n))
            items.append(value)
            issues += found
        return items, issues
    return data, issues
