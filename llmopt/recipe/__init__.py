"""Recipes: one YAML file that describes an optimization job end to end, and the runner behind `llmopt run`.

A recipe names a model and, per stage, the options of the command that stage runs (vram_plan,
calibration, quantize, eval, serve, bench). `llmopt run RECIPE.yaml` validates everything first (one
located line per problem, exit 2), then runs the stages in order into a run directory, skipping those
whose inputs did not change, and exits 1 when a gate fails. See docs/RECIPES.md.

Modules: loader (YAML + line map via locate), interpolate (${VAR}), overrides (--set), keys (unknown
keys), schema (the sections, derived from the library configs), validate, resolved, files, stages/
(one per stage), hashing and state (skip-on-unchanged), runner, summary, environment (versions.json),
command (the CLI entry points).
"""

from __future__ import annotations

__all__ = ["RunRequest", "run_recipe", "validate_recipe"]


def __getattr__(name: str):
    # lazy: `llmopt --help` must not import torch through the stage configs
    if name in ("RunRequest", "run_recipe"):
        from llmopt.recipe import runner

        return getattr(runner, name)
    if name == "validate_recipe":
        from llmopt.recipe.validate import validate_recipe

        return validate_recipe
    raise AttributeError(name)
