"""Planning before running: how much GPU memory a model needs and how to split it over GPUs."""

from llmopt.planning.memory import VramPlanOptions
from llmopt.planning.vram import VramPlan, plan_vram, render_vram_plan

__all__ = ["VramPlan", "VramPlanOptions", "plan_vram", "render_vram_plan"]
