"""`RUN_DIR/summary.html`: the run as one self-contained page, beside `summary.md`.

The stage table and every gate of the run (point estimate, interval, PASS / NOT SHOWN / FAIL), then what
each stage's artifact holds, read back from the run directory, so a skipped stage shows what it measured
last time: the memory plan (`vram_plan/plan.json`), the eval report (`eval/eval.json`, with `bisect`'s
per-layer sensitivity when it ran) and the benchmark (`bench/bench.json`: latency CDFs, the throughput-
latency curve and its knee). A stage whose artifact is missing is left out, with a line saying so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmopt.recipe.summary import RunReport, StageReport
from llmopt.report.html import GateRow, Section, gate_table, paragraph, render_page, table

SUMMARY_HTML = "summary.html"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _record_rows(stage: StageReport) -> list[GateRow]:
    rows = []
    for g in stage.gates:
        verdict = ("NOT SHOWN" if g.detail and g.detail.startswith("NOT SHOWN") else "PASS" if g.passed else "FAIL")
        rows.append(GateRow(f"{stage.name}: {g.gate}", verdict, g.value, note=g.detail))
    return rows


def _gate_rows(report: RunReport, eval_data: dict[str, Any] | None) -> list[GateRow]:
    from llmopt.eval.html_report import eval_gate_rows

    rows: list[GateRow] = []
    for s in report.stages:
        if s.name == "eval" and eval_data is not None and s.gates:
            try:
                by_gate = {r.expression: r for r in eval_gate_rows(eval_data)}
            except Exception:  # noqa: BLE001 - an unreadable eval.json: the recorded gates alone
                by_gate = {}
            for g in s.gates:  # the recorded gates decide; eval.json adds their intervals
                r = by_gate.get(g.gate)
                if r is None:
                    rows += _record_rows(StageReport(s.name, s.status, gates=[g]))
                else:
                    rows.append(GateRow(f"eval: {r.expression}", r.verdict, r.point, r.low, r.high, r.confidence,
                                        r.reads, r.note))
        else:
            rows += _record_rows(s)
    return rows


def _bench_result(data: dict[str, Any]) -> Any:
    from llmopt.bench.report import BenchReport
    from llmopt.bench.scenario_report import ScenarioReport

    return (ScenarioReport if data.get("kind") == "scenario" else BenchReport).model_validate(data)


def render_html(report: RunReport, run_dir: Path) -> str:
    stages = Section("stages", "Stages")
    stages.add(table(["stage", "status", "time", "note"],
                     [[s.name, s.status.replace("_", " "), "" if s.duration_s is None else f"{s.duration_s:.1f} s",
                       s.error or s.reason] for s in report.stages], numeric=(2,)))
    if report.skipped_gates:
        stages.add(paragraph("Gates skipped (--skip-gate): " + "; ".join(report.skipped_gates), "note"))
    ran = {s.name for s in report.stages if s.status in ("ran", "skipped")}
    eval_data = _read_json(run_dir / "eval" / "eval.json") if "eval" in ran else None
    sections = [stages]
    rows = _gate_rows(report, eval_data)
    if rows:
        gates = Section("gates", "Gates")
        gates.add(gate_table(rows))
        sections.append(gates)
    missing: list[str] = []

    def add(artifact: str, build: Callable[[dict[str, Any]], list[Section]]) -> None:
        """The sections of one artifact; one that is missing or unreadable (an older format) is named
        instead: the summary is written after a failure too, and must never hide it."""
        data = eval_data if artifact == "eval/eval.json" else _read_json(run_dir / artifact)
        if data is None:
            missing.append(f"{artifact} (missing)")
            return
        try:
            sections.extend(build(data))
        except Exception as e:  # noqa: BLE001 - any unreadable artifact is reported, not raised
            missing.append(f"{artifact} ({type(e).__name__})")

    if "vram_plan" in ran:
        from llmopt.planning.plan_html import plan_section

        add("vram_plan/plan.json", lambda d: [plan_section(d)])
    if "eval" in ran:
        from llmopt.eval.html_report import eval_sections

        add("eval/eval.json", lambda d: eval_sections(d, gates=False, prefix="eval-"))
    if "bench" in ran:
        from llmopt.bench.html_report import bench_sections

        add("bench/bench.json", lambda d: bench_sections(_bench_result(d)))
    if missing:
        stages.add(paragraph("Not shown: " + ", ".join(missing), "note"))
    verdict = ("all gates passed" if report.exit_code == 0 else "gate(s) failed" if report.failed_gates
               else "a stage failed")
    meta = [verdict, f"run directory {report.run_dir}, started {report.started_at}, {report.duration_s:.1f} s"]
    if report.description:
        meta.insert(0, report.description.strip())
    return render_page(f"llmopt run: {report.recipe}", sections, meta=meta)
