"""The `quantize` stage: `llmopt quantize` with the calibrate stage's CALIB_DIR; writes the checkpoint
that `eval`, `serve` and `bench` then load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmopt.quant.recipe import QuantizeConfig
from llmopt.recipe.issues import Issue
from llmopt.recipe.resolved import ResolvedRecipe
from llmopt.recipe.stages.base import Stage, StageContext, StageOutcome, build, model_fields


def quantize_config(rr: ResolvedRecipe, output: Path, calib: Path | None) -> QuantizeConfig:
    s = rr.recipe.quantize
    assert s is not None
    kw = s.model_dump()
    if kw.get("eval_data") is not None:  # scheme: auto with a gate: relative to the recipe's folder
        kw["eval_data"] = rr.file(str(kw["eval_data"]), "file")
    return QuantizeConfig(model=rr.model_ref, output=output, overwrite=True, calib=calib, **kw)


class QuantizeStage(Stage):
    name = "quantize"
    section = "quantize"
    summary = "quantized checkpoint (llmopt quantize)"
    needs = ("calibrate",)
    device_key = ("quantize", "device")

    def check(self, rr: ResolvedRecipe) -> list[Issue]:
        s = rr.recipe.quantize
        assert s is not None
        calib = rr.base_dir / ".placeholder-calib" if rr.recipe.calibration is not None else None
        cfg, issues = build(rr, ("quantize",), model_fields(type(s)),
                            lambda: quantize_config(rr, rr.base_dir / ".placeholder", calib))
        need = None if cfg is None else cfg.data_need()
        if need is not None and calib is None:
            what, key = need
            what = "scheme: auto" if key == "scheme" and cfg.scheme == "auto" else what
            issues.append(rr.issue(("quantize", key), f"{what} needs calibration data: add a `calibration` "
                                   "section to the recipe"))
        return issues

    def inputs(self, rr: ResolvedRecipe) -> dict[str, Any]:
        s = rr.recipe.quantize
        assert s is not None
        return {"config": s.model_dump(mode="json")}

    def run(self, ctx: StageContext, out: Path) -> StageOutcome:
        from llmopt.quant.pipeline import REPORT
        from llmopt.tune.gate_search import quantize as run_quantize

        cfg = quantize_config(ctx.rr, out, ctx.artifacts.get("calibrate"))
        report = run_quantize(cfg, ctx.console)
        # `out` is the runner's temporary folder, renamed to the stage's folder when the stage succeeds:
        # the report records, and the table shows, where the checkpoint will be
        report.output = str(ctx.run_dir / self.name)
        report.write(out / REPORT)
        report.render(ctx.console)
        werr = [m.weight_rel_err for m in report.modules]
        oerr = [m.output_rel_err for m in report.modules if m.output_rel_err is not None]
        metrics: dict[str, Any] = {
            "scheme": cfg.scheme, "method": cfg.method, "format": cfg.format,
            "modules_quantized": len(report.modules), "modules_ignored": len(report.ignored),
            "bytes_before": report.bytes_before, "bytes_after": report.bytes_after,
            "compression": round(report.bytes_before / max(report.bytes_after, 1), 3),
            "weight_rel_err_mean": sum(werr) / len(werr) if werr else None,
        }
        if report.auto:
            metrics.update({f"auto_{k}": report.auto[k] for k in ("bits", "predicted_kl", "measured_kl")})
        if oerr:
            metrics["output_rel_err_mean"] = sum(oerr) / len(oerr)
            metrics["output_rel_err_max"] = max(oerr)
        return StageOutcome(metrics=metrics)
