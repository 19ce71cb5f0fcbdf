"""`did you mean ...?` for misspelled keys, stage names and choices.

difflib's ratio catches typos (`sheme` -> `scheme`); a prefix test catches abbreviations that are too
short for the ratio (`sym` -> `symmetric`).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The most likely intended choice for `word`, or None when nothing is close."""
    options = [c for c in choices if c != word]
    found = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    if found:
        return found[0]
    prefixed = [c for c in options if len(word) >= 3 and (c.startswith(word) or word.startswith(c))]
    return prefixed[0] if len(prefixed) == 1 else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`; did you mean 'scheme'?` or an empty string."""
    best = closest(word, choices)
    return f"; did you mean {best!r}?" if best else ""
