"""The stage interface: what the runner needs from each step of a recipe.

A stage turns its recipe section into the library config of its command (`check` does so with
placeholder output paths during validation, so a bad value fails before any work), lists the inputs
whose content decides its result (`inputs`, hashed for skip-on-unchanged), and runs the same library
function as the CLI command (`run`), writing its artifacts into a directory the runner swaps into
place only on success.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError
from rich.console import Console

from llmopt.errors import LlmoptError
from llmopt.gates import Gate, GateResult, parse_confidence_gate, parse_gate
from llmopt.recipe.issues import Issue, KeyPath
from llmopt.recipe.resolved import ResolvedRecipe
from llmopt.recipe.suggest import closest


@dataclass
class StageContext:
    """What a running stage may use: the recipe, upstream artifacts, where to write, where to print."""

    rr: ResolvedRecipe
    run_dir: Path
    console: Console
    artifacts: dict[str, Path] = field(default_factory=dict)  # upstream stage -> its artifact directory

    def candidate_model(self) -> str:
        """The model later stages measure: the quantized checkpoint when the recipe quantizes."""
        if self.rr.recipe.quantize is not None:
            return str(self.artifacts["quantize"])
        return self.rr.model_ref


@dataclass
class StageOutcome:
    """What a stage measured. `halt` stops the run after this stage (with the reason)."""

    metrics: dict[str, Any] = field(default_factory=dict)
    gates: list[GateResult] = field(default_factory=list)
    halt: str | None = None


class Stage(ABC):
    name: ClassVar[str]
    section: ClassVar[str]
    summary: ClassVar[str]
    # upstream stages whose artifacts this one reads, when the recipe has them
    needs: ClassVar[tuple[str, ...]] = ()
    # whether the stage loads weights (a bare config.json is enough only for the memory plan)
    needs_weights: ClassVar[bool] = True
    # where the stage's device setting is (checked against the machine before a run starts)
    device_key: ClassVar[KeyPath | None] = None

    def enabled(self, rr: ResolvedRecipe) -> bool:
        return getattr(rr.recipe, self.section) is not None

    def upstream(self, rr: ResolvedRecipe, enabled: Callable[[str], bool]) -> list[str]:
        """The upstream stages this one reads in this recipe."""
        return [n for n in self.needs if enabled(n)]

    @abstractmethod
    def check(self, rr: ResolvedRecipe) -> list[Issue]:
        """Every problem with this stage's section, found without running anything heavy."""

    @abstractmethod
    def inputs(self, rr: ResolvedRecipe) -> dict[str, Any]:
        """The stage's resolved config and input files (paths), which the runner hashes into its key."""

    @abstractmethod
    def run(self, ctx: StageContext, out: Path) -> StageOutcome:
        """Do the work and write the artifacts into `out`."""


# ------------------------------------------------------------------------------------- check helpers


def _field_in(message: str, fields: set[str]) -> str | None:
    """The field a library message is about: a CLI flag naming it (`--kv-dtype`), else its bare name."""
    for flag in re.findall(r"--([a-z][a-z0-9-]*)", message):
        if flag.replace("-", "_") in fields:
            return flag.replace("-", "_")
    for name in sorted(fields, key=len, reverse=True):  # e.g. "cannot parse concurrency sweep ..."
        if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", message):
            return name
    return None


def section_issues(rr: ResolvedRecipe, section: KeyPath, exc: Exception, fields: set[str]) -> list[Issue]:
    """Issues from a library config's ValidationError or LlmoptError, located inside `section`.

    The library models use the section's field names, so a ValidationError's location is a key path.
    Cross-field checks (no location) and LlmoptErrors name CLI flags or fields in their message
    (`--act-order applies to --method gptq only`); the first one that is a field of the section locates it.
    """
    if isinstance(exc, ValidationError):
        out = []
        for err in exc.errors():
            loc = tuple(p for p in err.get("loc", ()) if isinstance(p, (str, int)))
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            if not loc and (name := _field_in(msg, fields)):
                loc = (name,)
            out.append(rr.issue((*section, *loc), msg))
        return out
    message = str(exc)
    name = _field_in(message, fields)
    return [rr.issue((*section, name) if name else section, message)]


def build(rr: ResolvedRecipe, section: KeyPath, fields: set[str], make: Callable[[], Any]) -> tuple[Any, list[Issue]]:
    """Run `make()` (a library config constructor); on failure, the located issues instead."""
    try:
        return make(), []
    except (ValidationError, LlmoptError) as e:
        return None, section_issues(rr, section, e, fields)


def gate_issues(rr: ResolvedRecipe, path: KeyPath, texts: list[str], known: list[str] | None,
                where: str, intervals: list[str] | None = None) -> tuple[list[Gate], list[Issue]]:
    """Parse gate expressions; with `known`, refuse metrics the stage does not measure. With `intervals`
    (the metrics the stage measures an interval for), the confidence form `METRIC OP NUMBER@95` is accepted
    on those metrics (llmopt.gates)."""
    gates, issues = [], []
    for i, text in enumerate(texts):
        try:
            if intervals is None:
                g = parse_gate(text)
            else:
                cg = parse_confidence_gate(text)
                g = cg.gate
                if cg.confidence is not None and g.metric in (known or [g.metric]) and g.metric not in intervals:
                    raise LlmoptError(f"{g.metric!r} has no interval in {where}; a confidence (@) applies to "
                                      f"{', '.join(intervals) or 'comparisons with a baseline'}")
        except LlmoptError as e:
            issues.append(rr.issue((*path, i), str(e)))
            continue
        if known is not None and g.metric not in known:
            best = closest(g.metric, known)
            hint = f"; did you mean {best!r}?" if best else f" (known: {', '.join(known)})"
            issues.append(rr.issue((*path, i), f"{where} does not measure {g.metric!r}{hint}"))
            continue
        gates.append(g)
    return gates, issues


def model_fields(model: type[BaseModel]) -> set[str]:
    return set(model.model_fields)
