"""The `bench` stage: `llmopt bench` of the candidate in-process, with `serve.engine`'s settings.

`BenchOptions.build()` applies every rule of the command (workload, sweep, SLO, gate names); the engine
it builds from the few CLI engine flags is then replaced by the full `EngineConfig` of the recipe, so
speculative decoding, prefix caching and the scheduling policy are benchmarked as they would be served.
Reports and the plot go where `--json`, `--markdown` and `--plot` would write them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape

from llmopt.bench.config import BenchConfig, BenchOptions
from llmopt.errors import LlmoptError
from llmopt.recipe.issues import Issue
from llmopt.recipe.resolved import ResolvedRecipe
from llmopt.recipe.stages.base import Stage, StageContext, StageOutcome, build, gate_issues, model_fields
from llmopt.recipe.stages.serving import engine_config, engine_kwargs, serve_issues

REPORT_JSON = "bench.json"
REPORT_MD = "bench.md"
PLOT = "bench.png"
# what the summary shows of the gated run (the knee of a sweep, or the only run)
SUMMARY_METRICS = ("output_throughput", "request_throughput", "goodput", "slo_attainment", "ttft_p50_ms",
                   "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "e2el_p99_ms", "failed", "prefix_cache_hit_rate",
                   "spec_decode_acceptance_rate")


def bench_config(rr: ResolvedRecipe, model: str, out: Path | None) -> BenchConfig:
    s = rr.recipe.bench
    assert s is not None
    kw: dict[str, Any] = s.model_dump(exclude={"dataset"})
    files = {} if out is None else {"json_path": str(out / REPORT_JSON), "markdown_path": str(out / REPORT_MD),
                                    "plot_path": str(out / PLOT)}
    dataset = str(rr.file(s.dataset, "bench.dataset file")) if s.dataset else None
    cfg = BenchOptions(model=model, dataset=dataset, **files, **kw).build()
    return cfg.model_copy(update={"engine": engine_config(rr, model)})


class BenchStage(Stage):
    name = "bench"
    section = "bench"
    summary = "performance gates (llmopt bench)"
    needs = ("quantize",)
    device_key = ("serve", "engine", "device")

    def check(self, rr: ResolvedRecipe) -> list[Issue]:
        s = rr.recipe.bench
        assert s is not None
        issues = serve_issues(rr)
        if s.dataset:
            try:
                rr.file(s.dataset, "bench.dataset file")
            except LlmoptError as e:
                issues.append(rr.issue(("bench", "dataset"), str(e)))
                return issues
        from llmopt.bench.gate_metrics import known_metrics

        known = known_metrics(scenario=s.scenario is not None)
        gate_problems = gate_issues(rr, ("bench", "gates"), s.gates, known, "the benchmark")[1]
        issues += gate_problems
        if not gate_problems:
            issues += build(rr, ("bench",), model_fields(type(s)), lambda: bench_config(rr, rr.model_ref, None))[1]
        return issues

    def inputs(self, rr: ResolvedRecipe) -> dict[str, Any]:
        s = rr.recipe.bench
        assert s is not None
        return {"config": s.model_dump(mode="json", exclude={"dataset"}), "engine": engine_kwargs(rr),
                "files": [str(rr.file(s.dataset, "bench.dataset file"))] if s.dataset else []}

    def run(self, ctx: StageContext, out: Path) -> StageOutcome:
        from llmopt.bench.gate_metrics import RUN_METRICS, gated_run
        from llmopt.bench.runner import run_bench, write_outputs

        cfg = bench_config(ctx.rr, ctx.candidate_model(), out)
        # the bench writes no files itself, so it does not print `out`, the runner's temporary folder; they are
        # written here, and named where they will be once the stage succeeds and that folder is renamed
        outcome = run_bench(cfg.model_copy(update={"json_path": None, "markdown_path": None, "plot_path": None}),
                            ctx.console)
        if outcome.interrupted:
            raise KeyboardInterrupt
        write_outputs(cfg, outcome)
        for path in outcome.written:
            ctx.console.print(f"[dim]wrote {escape(str(ctx.run_dir / self.name / Path(path).relative_to(out)))}[/]")
        report = outcome.report if outcome.scenario is None else outcome.scenario.variants[-1].report
        metrics: dict[str, Any] = {}
        if report is not None:
            run = gated_run(report)
            if report.knee is not None:
                metrics["knee"] = report.knee.recommendation
            metrics["levels"] = len(report.runs)
            if run is not None:
                metrics["gated_run"] = run.label or ""
                for name in SUMMARY_METRICS:
                    value = RUN_METRICS[name](run)
                    if value is not None:
                        metrics[name] = value
        return StageOutcome(metrics=metrics, gates=list(outcome.gates))
