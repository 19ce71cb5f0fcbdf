"""The result of an A/B benchmark: each side's pooled report with its rounds, and B/A ratios with intervals.

Each side is an ordinary `BenchReport` whose one run pools that side's rounds and keeps every round's
metrics (`BenchRun.rounds`), so the file can be re-analysed (`--compare ab.json` expands it into its
sides and recomputes paired intervals) and every number a plain run has is there too.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.table import Table

from llmopt._version import __version__
from llmopt.bench.ab_config import AbOrder
from llmopt.bench.ab_stats import RatioEstimate, ratio_interval
from llmopt.bench.report import BenchReport, BenchRun, render_turns, to_markdown
from llmopt.io import write_bytes_atomic

Better = Literal["higher", "lower"]
AB_METRICS: list[tuple[str, Better]] = [
    ("output_throughput", "higher"), ("request_throughput", "higher"), ("total_throughput", "higher"),
    ("goodput", "higher"),
    ("ttft_p50_ms", "lower"), ("ttft_p90_ms", "lower"), ("ttft_p99_ms", "lower"),
    ("tpot_p50_ms", "lower"), ("tpot_p90_ms", "lower"), ("tpot_p99_ms", "lower"),
    ("itl_p99_ms", "lower"), ("e2el_p50_ms", "lower"), ("e2el_p99_ms", "lower"),
    ("prefix_cache_hit_rate", "higher"),
]


class AbSideResult(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")

    name: str
    spec: str
    report: BenchReport


class AbReport(BaseModel):
    """A whole `llmopt bench --ab A --ab B` invocation; ratios are B / A."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    kind: Literal["ab"] = "ab"
    order: AbOrder
    rounds: int
    confidence: float
    seed: int = 0
    sequence: list[str] = Field(default_factory=list, description="Side names in the order the runs ran.")
    sides: list[AbSideResult]
    ratios: dict[str, RatioEstimate] = Field(default_factory=dict, description="B / A per metric, paired.")
    created: datetime = Field(default_factory=lambda: datetime.now(UTC))
    llmopt_version: str = __version__

    def run(self, side: int) -> BenchRun | None:
        runs = self.sides[side].report.runs
        return runs[0] if runs else None

    def ratio(self, metric: str, confidence: float | None = None) -> RatioEstimate:
        """B / A of `metric` over the rounds, paired, at `confidence` (default: the report's)."""
        a, b = self.run(0), self.run(1)
        conf = self.confidence if confidence is None else confidence
        if a is None or b is None or not a.rounds or not b.rounds:
            return RatioEstimate(ratio=None, confidence=conf)
        xs, ys = [r.get(metric) for r in a.rounds], [r.get(metric) for r in b.rounds]
        n = min(len(xs), len(ys))
        return ratio_interval(xs[:n], ys[:n], paired=True, confidence=conf, seed=self.seed)

    def with_ratios(self) -> AbReport:
        return self.model_copy(update={"ratios": {m: self.ratio(m) for m, _ in AB_METRICS}})

    @property
    def interrupted(self) -> bool:
        return any(r.stopped_early for s in self.sides for r in s.report.runs)


def _v(run: BenchRun | None, metric: str) -> float | None:
    if run is None or not run.rounds:
        return None
    vals = [r.get(metric) for r in run.rounds]
    got = [v for v in vals if v is not None]
    return sum(got) / len(got) if got else None


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _rows(rep: AbReport) -> list[tuple[str, str, str, str, str, str]]:
    """(metric, A mean, B mean, ratio, interval, verdict) for every metric measured on both sides."""
    out = []
    for metric, better in AB_METRICS:
        est = rep.ratios.get(metric)
        if est is None or est.ratio is None:
            continue
        if est.low is None or est.high is None:
            interval, verdict = "n/a", "too few rounds"
        else:
            interval = f"[{est.low:.3f}, {est.high:.3f}]"
            if est.low <= 1.0 <= est.high:
                verdict = "no difference shown"
            else:
                up = est.low > 1.0
                verdict = "B better" if up == (better == "higher") else "B worse"
        out.append((metric, _fmt(_v(rep.run(0), metric)), _fmt(_v(rep.run(1), metric)), f"x{est.ratio:.3f}",
                    interval, verdict))
    return out


def render_ab(rep: AbReport, console: Console) -> None:
    """The ratio table (means over rounds, B/A, its interval, what it shows), then per-turn TTFT."""
    a, b = (s.name for s in rep.sides)
    console.print(f"[bold]A/B:[/] A = {a} ({rep.sides[0].spec}), B = {b} ({rep.sides[1].spec}); "
                  f"{rep.rounds} rounds, order {' '.join(rep.sequence)}")
    table = Table(title=f"B / A over {rep.rounds} rounds, {100 * rep.confidence:g}% bootstrap intervals",
                  title_style="bold")
    for col in ("metric", f"A: {a} (mean)", f"B: {b} (mean)", "B / A", "interval", ""):
        table.add_column(col, justify="left" if col in ("metric", "") else "right")
    rows = _rows(rep)
    for metric, va, vb, ratio, interval, verdict in rows:
        color = {"B better": "green", "B worse": "red"}.get(verdict, "white")
        table.add_row(metric, va, vb, ratio, interval, f"[{color}]{verdict}[/]")
    if not rows:  # e.g. a server that answered every request with 503: say so instead of an empty table
        for s in rep.sides:
            run = s.report.runs[0] if s.report.runs else None
            failures = ", ".join(f"{k}: {v}" for k, v in sorted(run.failures.items())) if run else ""
            console.print(f"[bold red]{s.name}:[/] {run.completed if run else 0} completed"
                          + (f", failed {failures}" if failures else ""), highlight=False)
        console.print("no metric was measured on both sides")
        return
    console.print(table)
    for s in rep.sides:
        run = s.report.runs[0] if s.report.runs else None
        if run is not None and run.turns:
            render_turns(run, console, title=f"{s.name}: TTFT per turn (all rounds)")


def ab_markdown(rep: AbReport) -> str:
    a, b = (s.name for s in rep.sides)
    lines = ["# llmopt bench --ab", "", f"- A = `{a}`: {rep.sides[0].spec}", f"- B = `{b}`: {rep.sides[1].spec}",
             f"- {rep.rounds} rounds, order {' '.join(rep.sequence)}; intervals: {100 * rep.confidence:g}% "
             "bootstrap (scipy BCa at the expanded level, paired by round)", "",
             "| metric | A (mean) | B (mean) | B / A | interval | |", "|---|---:|---:|---:|---:|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in _rows(rep)]
    lines.append("")
    for s in rep.sides:
        lines += [to_markdown(s.report).replace("# llmopt bench", f"## {s.name}", 1)]
    return "\n".join(lines)


def write_ab_json(rep: AbReport, path: str | Path) -> Path:
    return write_bytes_atomic(path, rep.model_dump_json(indent=2).encode() + b"\n")


def write_ab_markdown(rep: AbReport, path: str | Path) -> Path:
    return write_bytes_atomic(path, ab_markdown(rep).encode())
