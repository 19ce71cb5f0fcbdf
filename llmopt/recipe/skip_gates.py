"""`llmopt run --skip-gate NAME`: leave named gates out of a run, and say so in its summary.

Why: a recipe is kept in git with the gates its real model must pass; a run on a stand-in (random weights
of the real shape, to check memory and that every stage works) cannot pass the quality ones. Skipping them
by name keeps the recipe as it is and the skip visible, unlike editing the gate lists with --set.
A NAME is a gate's metric (`kb_mc.acc_drop`, every gate on it) or its whole expression; one that matches
no gate is an error, so a typo never skips nothing silently.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from llmopt.recipe.issues import Issue

# the recipe sections that hold gate lists
GATED_SECTIONS = ("vram_plan", "eval", "bench")
_OP = re.compile(r"\s*(>=|<=|==|!=|>|<)")


def _metric(gate: str) -> str:
    return _OP.split(gate, maxsplit=1)[0].strip()


def drop_gates(data: dict[str, Any], names: Sequence[str]) -> tuple[dict[str, Any], list[str], list[Issue]]:
    """(recipe data without the named gates, the skipped gates as `section: gate`, issues)."""
    if not names:
        return data, [], []
    wanted = {n.strip() for n in names}
    hit: set[str] = set()
    skipped: list[str] = []
    out = dict(data)
    for section in GATED_SECTIONS:
        body = data.get(section)
        if not isinstance(body, dict) or not isinstance(body.get("gates"), list):
            continue
        kept = []
        for gate in body["gates"]:
            text = str(gate)
            match = {text.strip(), _metric(text)} & wanted
            if match:
                hit |= match
                skipped.append(f"{section}: {text}")
            else:
                kept.append(gate)
        out[section] = {**body, "gates": kept}
    every = [str(g) for s in GATED_SECTIONS if isinstance(data.get(s), dict)
             for g in (data[s].get("gates") or [])]
    issues = [Issue(f"--skip-gate {n!r} matches no gate of this recipe (gates: {', '.join(every) or 'none'})",
                    source="--skip-gate") for n in sorted(wanted - hit)]
    return out, skipped, issues
