"""The `calibrate` stage: `llmopt calibrate` on the recipe's sources; its CALIB_DIR feeds `quantize`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmopt.calibrate.run import CalibrateConfig
from llmopt.errors import LlmoptError
from llmopt.recipe.issues import Issue
from llmopt.recipe.resolved import ResolvedRecipe
from llmopt.recipe.stages.base import Stage, StageContext, StageOutcome, build, model_fields


def _source_spec(path: str, weight: float) -> str:
    return f"{path}:{weight:g}"


def calibrate_config(rr: ResolvedRecipe, output: Path) -> CalibrateConfig:
    """The library config: sources and eval files resolved against the recipe's folder."""
    s = rr.recipe.calibration
    assert s is not None
    kw: dict[str, Any] = s.model_dump(exclude={"data", "eval_data"})
    data = [_source_spec(rr.data_source(src.path), src.weight) for src in s.data]
    eval_data = [str(rr.file(f, "calibration.eval_data file")) for f in s.eval_data]
    return CalibrateConfig(model=rr.model_ref, data=data, eval_data=eval_data, output=output, overwrite=True, **kw)


class CalibrateStage(Stage):
    name = "calibrate"
    section = "calibration"
    summary = "activation statistics (llmopt calibrate)"
    device_key = ("calibration", "device")

    def check(self, rr: ResolvedRecipe) -> list[Issue]:
        s = rr.recipe.calibration
        assert s is not None
        issues: list[Issue] = []
        for i, src in enumerate(s.data):
            try:
                rr.data_source(src.path)
            except LlmoptError as e:
                issues.append(rr.issue(("calibration", "data", i), str(e)))
        for i, f in enumerate(s.eval_data):
            try:
                rr.file(f, "calibration.eval_data file")
            except LlmoptError as e:
                issues.append(rr.issue(("calibration", "eval_data", i), str(e)))
        if not issues:
            issues += build(rr, ("calibration",), model_fields(type(s)),
                            lambda: calibrate_config(rr, rr.base_dir / ".placeholder"))[1]
        return issues

    def inputs(self, rr: ResolvedRecipe) -> dict[str, Any]:
        cfg = calibrate_config(rr, Path("."))
        files = [src.rpartition(":")[0] for src in cfg.data] + list(cfg.eval_data)
        return {"config": cfg.model_dump(mode="json", exclude={"output", "overwrite", "model", "data", "eval_data"}),
                "data": [{"weight": s.weight} for s in cfg.sources], "files": files}

    def run(self, ctx: StageContext, out: Path) -> StageOutcome:
        from llmopt.calibrate.run import run_calibration

        cfg = calibrate_config(ctx.rr, out)
        manifest = run_calibration(cfg, ctx.console)
        ctx.console.print(f"calibrated on {manifest.num_windows} windows × {manifest.seq_len} tokens")
        return StageOutcome(metrics={"windows": manifest.num_windows, "seq_len": manifest.seq_len,
                                     "tokens": manifest.num_tokens,
                                     "duplicates_dropped": manifest.duplicates_dropped,
                                     "warnings": len(manifest.warnings)})
