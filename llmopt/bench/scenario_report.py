"""The result file of a scenario (several engine variants, one workload) and its renderings.

A `ScenarioReport` holds one ordinary `BenchReport` per variant, so every per-run number, the knee and the
samples are exactly what a plain `llmopt bench` run writes, plus the comparison of every variant against
the first (the baseline). The JSON carries `"kind": "scenario"` so that `--compare` can tell it from a
plain report and expand it into its variants.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rich.console import Console

from llmopt._version import __version__
from llmopt.bench.report import (
    BenchReport,
    Comparison,
    compare_named,
    comparison_markdown,
    load_report,
    render_comparison,
    render_report,
    to_markdown,
)
from llmopt.errors import LlmoptError
from llmopt.io import write_bytes_atomic


class VariantResult(BaseModel):
    """One variant of a scenario and the report of its runs."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    name: str
    description: str
    batching: Literal["continuous", "static"]
    engine_overrides: dict[str, Any] = Field(default_factory=dict)
    report: BenchReport


class ScenarioReport(BaseModel):
    """A whole `llmopt bench --scenario` invocation."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    kind: Literal["scenario"] = "scenario"
    scenario: str
    description: str
    variants: list[VariantResult]
    comparison: Comparison
    created: datetime = Field(default_factory=lambda: datetime.now(UTC))
    llmopt_version: str = __version__

    @property
    def baseline(self) -> VariantResult:
        return self.variants[0]

    @property
    def interrupted(self) -> bool:
        return any(r.stopped_early for v in self.variants for r in v.report.runs)

    @classmethod
    def build(cls, scenario: str, description: str, variants: Sequence[VariantResult]) -> ScenarioReport:
        """Assemble and compare; variants ran the same load levels, so runs are paired by position."""
        named = [(v.name, v.report) for v in variants if v.report.runs]
        comparison = compare_named(named, match="index") if len(named) >= 2 else Comparison(
            reports=[n for n, _ in named], rows=[])
        return cls(scenario=scenario, description=description, variants=list(variants), comparison=comparison)


# ------------------------------------------------------------------------------------------- output


def render_scenario(rep: ScenarioReport, console: Console) -> None:
    """Each variant's table or summary, then the comparison with ratios against the baseline."""
    console.print(f"[bold]scenario {rep.scenario}:[/] {rep.description}")
    for v in rep.variants:
        console.rule(f"[bold]{v.name}[/]: {v.description}")
        render_report(v.report, console)
    if rep.comparison.rows:
        render_comparison(rep.comparison, console,
                          title=f"{rep.scenario}: ratios vs {rep.baseline.name} (baseline)")


def scenario_markdown(rep: ScenarioReport) -> str:
    """Comparison table first (the answer), then each variant's own report."""
    lines = [f"# llmopt bench --scenario {rep.scenario}", "", rep.description, "",
             f"Ratios are against `{rep.baseline.name}`.", "", comparison_markdown(rep.comparison)]
    for v in rep.variants:
        body = to_markdown(v.report).replace("# llmopt bench", f"## {v.name}", 1)
        lines += [body, f"_{v.description}_", ""]
    return "\n".join(lines)


def write_scenario_json(rep: ScenarioReport, path: str | Path) -> Path:
    data = rep.model_dump_json(indent=2).encode() + b"\n"
    return write_bytes_atomic(path, data)


def write_scenario_markdown(rep: ScenarioReport, path: str | Path) -> Path:
    data = scenario_markdown(rep).encode()
    return write_bytes_atomic(path, data)


def write_scenario_plot(rep: ScenarioReport, path: str | Path) -> Path:
    """Left: throughput vs latency, one curve per variant. Right: output throughput per load level."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise LlmoptError("--plot needs matplotlib: pip install matplotlib (or the llmopt bench extra)") from None

    fig = Figure(figsize=(13, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_curve, ax_bar = fig.subplots(1, 2)
    first = rep.variants[0].report
    metric, pct = first.knee_metric, first.knee_percentile
    for v in rep.variants:
        pts = [(getattr(r.latency(metric), pct), r.output_throughput) for r in v.report.runs]
        pts = [(x, y) for x, y in pts if x is not None]
        if pts:
            ax_curve.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=v.name)
    ax_curve.set_xlabel(f"{pct} {metric.upper()} (ms)")
    ax_curve.set_ylabel("output throughput (tok/s)")
    ax_curve.set_title(f"{rep.scenario}: throughput vs latency")
    ax_curve.grid(True, alpha=0.3)
    if any(v.report.runs for v in rep.variants):
        ax_curve.legend(loc="lower right")

    levels = max((len(v.report.runs) for v in rep.variants), default=0)
    width = 0.8 / max(1, len(rep.variants))
    for k, v in enumerate(rep.variants):
        xs = [i + k * width for i in range(len(v.report.runs))]
        ax_bar.bar(xs, [r.output_throughput for r in v.report.runs], width=width, label=v.name)
    ticks = [" vs ".join(dict.fromkeys(v.report.runs[i].label for v in rep.variants if i < len(v.report.runs)))
             for i in range(levels)]
    ax_bar.set_xticks([i + 0.4 - width / 2 for i in range(levels)], ticks, fontsize=8)
    ax_bar.set_ylabel("output throughput (tok/s)")
    ax_bar.set_title("output throughput per load level")
    ax_bar.grid(True, axis="y", alpha=0.3)
    ax_bar.legend()

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    data = buf.getvalue()
    return write_bytes_atomic(path, data)


# ------------------------------------------------------------------------------------------ loading


def load_named_reports(path: str | Path) -> list[tuple[str, BenchReport]]:
    """A report file as (name, report) pairs: a plain report is itself, a scenario is `FILE:VARIANT` each."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise LlmoptError(f"cannot read report {p}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LlmoptError(f"{p} is not JSON: {e}") from None
    if isinstance(raw, dict) and raw.get("kind") == "ab":
        from llmopt.bench.ab_report import AbReport

        try:
            ab = AbReport.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "(top level)"
            raise LlmoptError(f"{p} is not an llmopt A/B report: {where}: {first['msg']}") from None
        return [(f"{p}:{s.name}", s.report) for s in ab.sides]
    if isinstance(raw, dict) and raw.get("kind") == "scenario":
        try:
            rep = ScenarioReport.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "(top level)"
            raise LlmoptError(f"{p} is not an llmopt scenario report: {where}: {first['msg']}") from None
        return [(f"{p}:{v.name}", v.report) for v in rep.variants]
    return [(str(p), load_report(p))]


def compare_files(paths: Sequence[str | Path]) -> Comparison:
    """`--compare`: every report (scenario and A/B files expand to their variants/sides) against the first.

    Runs are paired by load label; when no label is shared by all reports (the variants of one
    static-vs-continuous file: `static batches of 8` and `concurrency 8`), by position instead.
    """
    named = [item for path in paths for item in load_named_reports(path)]
    if len(named) < 2:
        raise LlmoptError("--compare needs at least two reports (files, or one scenario file with variants)")
    shared = set.intersection(*({r.label for r in rep.runs} for _, rep in named))
    # the two sides of one A/B file ran interleaved: their rounds pair up
    paired = len(paths) == 1 and len(named) == 2 and _is_ab(paths[0])
    return compare_named(named, match="label" if shared else "index", paired=paired)


def _is_ab(path: str | Path) -> bool:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8")).get("kind") == "ab"
    except (OSError, ValueError, AttributeError):
        return False
