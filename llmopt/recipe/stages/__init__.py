"""The stages of a recipe, in the order they run.

vram_plan → calibrate → quantize → eval → serve (smoke test, only with `serve.smoke: true`) → bench.
Each wraps the library function of one CLI command; see `base.py` for the interface.
"""

from __future__ import annotations

from llmopt.recipe.stages.base import Stage, StageContext, StageOutcome
from llmopt.recipe.stages.bench import BenchStage
from llmopt.recipe.stages.calibrate import CalibrateStage
from llmopt.recipe.stages.eval import EvalStage
from llmopt.recipe.stages.quantize import QuantizeStage
from llmopt.recipe.stages.serve import ServeStage
from llmopt.recipe.stages.vram_plan import VramPlanStage

STAGES: tuple[Stage, ...] = (VramPlanStage(), CalibrateStage(), QuantizeStage(), EvalStage(), ServeStage(),
                             BenchStage())
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)


def stage(name: str) -> Stage:
    return next(s for s in STAGES if s.name == name)


__all__ = ["STAGES", "STAGE_NAMES", "Stage", "StageContext", "StageOutcome", "stage"]
