"""Parsing and printing byte sizes: `24GiB`, `24GB`, `24G` and plain integers."""

from __future__ import annotations

import re

from llmopt.errors import LlmoptError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """Parse a memory size. A bare `G`/`M`/`K` means binary units (as GPU vendors quote memory)."""
    if isinstance(text, int):
        if text < 0:
            raise LlmoptError(f"memory size must be non-negative, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise LlmoptError(f"cannot parse memory size {text!r}: use e.g. 24GiB, 24GB, 24G or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. `1.00 GiB`."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
