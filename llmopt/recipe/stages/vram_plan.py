"""The `vram_plan` stage: `llmopt vram-plan` for the deployment the recipe describes; stops the run when
the model does not fit, before hours of calibration and quantization are spent on it.

When the section leaves `weight_dtype` / `kv_dtype` at `auto`, the plan follows the rest of the recipe:
the quantize scheme (w8a16 -> int8, w4a16 -> int4, fp8, w8a8 -> int8, with its group size) and
`serve.engine.kv_cache_dtype`, so the plan is of what the recipe will actually serve.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmopt.errors import LlmoptError
from llmopt.gates import Gate, GateResult, check_gates
from llmopt.planning.vram import VramPlan, VramPlanOptions, plan_vram, render_vram_plan
from llmopt.recipe.issues import Issue
from llmopt.recipe.resolved import ResolvedRecipe
from llmopt.recipe.stages.base import Stage, StageContext, StageOutcome, build, gate_issues, model_fields
from llmopt.units import parse_bytes

SCHEME_WEIGHT_DTYPE = {"w8a16": "int8", "w4a16": "int4", "fp8": "fp8", "w8a8": "int8"}
# numbers of the plan (VramPlan.to_json) that `vram_plan.gates` may check
GATE_METRICS = (
    "fits", "params", "weights_bytes", "kv_bytes_per_token", "kv_bytes_per_sequence", "kv_bytes_total",
    "activation_bytes", "reserve_bytes", "total_bytes", "free_bytes", "max_concurrent_sequences",
    "max_seq_len_at_batch",
)
PLAN_FILE = "plan.json"


def plan_options(rr: ResolvedRecipe) -> tuple[VramPlanOptions, dict[str, str]]:
    """The library options, and which `auto` dtypes were taken from the rest of the recipe (and why)."""
    s = rr.recipe.vram_plan
    assert s is not None
    kw: dict[str, Any] = s.model_dump(exclude={"gpu_memory", "gates"})
    kw["gpu_memory_bytes"] = parse_bytes(s.gpu_memory)
    inferred: dict[str, str] = {}
    q = rr.recipe.quantize
    if str(kw["weight_dtype"]).lower() == "auto" and q is not None and q.scheme == "auto":
        # each linear's precision is chosen at quantize time: plan the narrowest dtype the budget cannot exceed
        bits = q.target_bits or 16.0
        kw["weight_dtype"] = "int4" if bits <= 4.5 else "int8" if bits <= 8.25 else "bf16"
        if kw["weight_dtype"] == "int4" and kw["group_size"] is None:
            kw["group_size"] = 32  # 4.5 bits per weight, the most an int4 choice costs
        inferred["weight_dtype"] = (f"{kw['weight_dtype']} (at least quantize.target_bits {bits:g} of "
                                    "quantize.scheme auto)")
    elif str(kw["weight_dtype"]).lower() == "auto" and q is not None:
        kw["weight_dtype"] = SCHEME_WEIGHT_DTYPE[q.scheme]
        inferred["weight_dtype"] = f"{kw['weight_dtype']} (from quantize.scheme {q.scheme})"
        if kw["group_size"] is None and q.group_size is not None and q.scheme in ("w8a16", "w4a16"):
            kw["group_size"] = q.group_size
    engine = rr.recipe.serve.engine if rr.recipe.serve is not None else None
    if str(kw["kv_dtype"]).lower() == "auto" and engine is not None and engine.kv_cache_dtype in ("int8", "fp8"):
        kw["kv_dtype"] = engine.kv_cache_dtype
        inferred["kv_dtype"] = f"{engine.kv_cache_dtype} (from serve.engine.kv_cache_dtype)"
    return VramPlanOptions(**kw), inferred


def plan_fits(plan: VramPlan) -> bool:
    """On one GPU, or as a tensor/pipeline-parallel replica when num_gpus > 1."""
    return plan.fits or (plan.parallel is not None and plan.parallel.fits)


class VramPlanStage(Stage):
    name = "vram_plan"
    section = "vram_plan"
    summary = "memory plan (llmopt vram-plan)"
    needs_weights = False

    def check(self, rr: ResolvedRecipe) -> list[Issue]:
        s = rr.recipe.vram_plan
        assert s is not None
        try:
            parse_bytes(s.gpu_memory)
        except LlmoptError as e:
            return [rr.issue(("vram_plan", "gpu_memory"), str(e))]
        _, issues = build(rr, ("vram_plan",), model_fields(type(s)), lambda: plan_options(rr))
        issues += gate_issues(rr, ("vram_plan", "gates"), s.gates, list(GATE_METRICS), "the memory plan")[1]
        return issues

    def inputs(self, rr: ResolvedRecipe) -> dict[str, Any]:
        opts, _ = plan_options(rr)
        return {"options": opts.model_dump(mode="json")}

    def run(self, ctx: StageContext, out: Path) -> StageOutcome:
        from llmopt.models.resolve import resolve_model

        s = ctx.rr.recipe.vram_plan
        assert s is not None
        opts, inferred = plan_options(ctx.rr)
        for key, why in inferred.items():
            ctx.console.print(f"[dim]vram_plan.{key}: {why}[/]")
        resolved = resolve_model(ctx.rr.model_ref)
        plan = plan_vram(resolved.spec, opts, model_name=ctx.rr.recipe.model)
        render_vram_plan(plan, ctx.console)
        data = plan.to_json()
        (out / PLAN_FILE).write_text(json.dumps(data, indent=2, default=str) + "\n")
        fits = plan_fits(plan)
        values = {k: (float(data[k]) if k != "fits" else float(fits)) for k in GATE_METRICS}
        fit_gate = GateResult(gate=Gate(metric="fits", op="==", threshold=1), value=float(fits), passed=fits)
        user = check_gates(gate_issues(ctx.rr, ("vram_plan", "gates"), s.gates, None, "")[0], values.get)
        metrics = {"weight_dtype": data["weight_dtype"], "kv_dtype": data["kv_dtype"], "seq_len": data["seq_len"],
                   "batch": data["batch"], "num_gpus": data["num_gpus"], "total_bytes": data["total_bytes"],
                   "gpu_memory_bytes": data["gpu_memory_bytes"], "fits": fits,
                   "max_concurrent_sequences": data["max_concurrent_sequences"]}
        halt = None
        if not fits:
            first = plan.recommendations[0].action if plan.recommendations else "use a bigger GPU"
            halt = f"the plan does not fit in {s.gpu_memory} per GPU (first recommendation: {first})"
        return StageOutcome(metrics=metrics, gates=[fit_gate, *user], halt=halt)
