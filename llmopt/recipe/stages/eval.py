"""The `eval` stage: `llmopt eval` of the candidate (the quantized checkpoint, or `model` when the recipe
does not quantize) against `eval.baseline`, with the section's gates.

It calls `run_eval`, the library function behind `llmopt eval` (whose CLI wrapper raises on a failed gate;
a recipe wants the measurements of every stage and decides the exit code at the end), and writes the
same JSON and Markdown reports the command writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from llmopt.errors import LlmoptError
from llmopt.eval.options import EvalOptions
from llmopt.recipe.files import resolve_model_ref
from llmopt.recipe.issues import Issue
from llmopt.recipe.resolved import ResolvedRecipe
from llmopt.recipe.stages.base import Stage, StageContext, StageOutcome, build, gate_issues, model_fields

REPORT_JSON = "eval.json"
REPORT_MD = "eval.md"
BISECT_PLOT = "bisect.png"


def eval_options(rr: ResolvedRecipe, model: str, out: Path | None) -> EvalOptions:
    """The library options: files resolved against the recipe's folder, the baseline like `model`."""
    s = rr.recipe.eval
    assert s is not None
    kw: dict[str, Any] = s.model_dump(exclude={"ppl_data", "tasks", "baseline"})
    return EvalOptions(
        model=model,
        baseline=resolve_model_ref(s.baseline, rr.base_dir) if s.baseline else None,
        ppl_data=rr.file(s.ppl_data, "eval.ppl_data file") if s.ppl_data else None,
        tasks=[rr.file(t, "eval task file") for t in s.tasks],
        bisect_plot=out / BISECT_PLOT if out is not None and s.bisect else None,
        **kw,
    )


def _progress(console: Console) -> tuple[Progress, Any]:
    bar = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)
    ids: dict[str, Any] = {}

    def update(label: str, done: int, total: int) -> None:
        if label not in ids:
            ids[label] = bar.add_task(label, total=total)
        bar.update(ids[label], completed=done, total=total)

    return bar, update


class EvalStage(Stage):
    name = "eval"
    section = "eval"
    summary = "quality gates (llmopt eval)"
    needs = ("quantize",)
    device_key = ("eval", "device")

    def check(self, rr: ResolvedRecipe) -> list[Issue]:
        from llmopt.eval.compare import interval_metric_names, metric_names
        from llmopt.eval.tasks import load_task

        s = rr.recipe.eval
        assert s is not None
        issues: list[Issue] = []
        if s.baseline:
            try:
                resolve_model_ref(s.baseline, rr.base_dir)
            except LlmoptError as e:
                issues.append(rr.issue(("eval", "baseline"), str(e)))
        if s.ppl_data:
            try:
                rr.file(s.ppl_data, "eval.ppl_data file")
            except LlmoptError as e:
                issues.append(rr.issue(("eval", "ppl_data"), str(e)))
        tasks = []
        for i, t in enumerate(s.tasks):
            try:
                task = load_task(rr.file(t, "eval task file"))
                task.requests()  # every document's prompt and choices, as `llmopt eval` checks them
                tasks.append(task)
            except LlmoptError as e:
                issues.append(rr.issue(("eval", "tasks", i), str(e)))
        if issues:
            return issues
        opts, issues = build(rr, ("eval",), model_fields(type(s)), lambda: eval_options(rr, rr.model_ref, None))
        if opts is not None:
            where = "this eval" if opts.baseline else "this eval (no eval.baseline: comparisons such as " \
                "ppl_increase_pct, kl_div, top1_agreement and *_drop need one)"
            issues += gate_issues(rr, ("eval", "gates"), s.gates, metric_names(opts, tasks), where,
                                  intervals=interval_metric_names(opts, tasks))[1]
        return issues

    def inputs(self, rr: ResolvedRecipe) -> dict[str, Any]:
        from llmopt.eval.tasks import load_task

        opts = eval_options(rr, rr.model_ref, None)
        # a task is its config and documents, wherever its YAML keeps them
        tasks = []
        for t in opts.tasks:
            task = load_task(t)
            tasks.append({"name": task.name, "config": task.config.model_dump(mode="json"), "docs": task.docs,
                          "fewshot": task.fewshot_docs})
        return {"config": opts.model_dump(mode="json", exclude={"model", "tasks", "ppl_data", "baseline",
                                                                "bisect_plot", "report"}),
                "models": [opts.baseline] if opts.baseline else [], "tasks": tasks,
                "files": [str(opts.ppl_data)] if opts.ppl_data else []}

    def run(self, ctx: StageContext, out: Path) -> StageOutcome:
        from llmopt.eval.compare import run_eval
        from llmopt.eval.report import render_json, render_markdown, render_table

        opts = eval_options(ctx.rr, ctx.candidate_model(), out)
        bar, update = _progress(ctx.console)
        with bar:
            report = run_eval(opts, update)
        render_table(report, ctx.console)
        (out / REPORT_JSON).write_text(render_json(report) + "\n")
        (out / REPORT_MD).write_text(render_markdown(report))
        data = json.loads(render_json(report))
        metrics: dict[str, Any] = {}
        for name, row in data["metrics"].items():
            metrics[name] = row["candidate"]
            ci = row.get("interval") or {}
            if ci.get("low") is not None and ci.get("high") is not None:  # the point never without its interval
                metrics[f"{name}.ci95"] = [ci["low"], ci["high"]]
        if opts.baseline:
            metrics.update({f"baseline.{name}": row["baseline"] for name, row in data["metrics"].items()
                            if row.get("baseline") is not None})
        return StageOutcome(metrics=metrics, gates=list(report.gates))
