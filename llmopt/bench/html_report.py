"""`llmopt bench --html`: a benchmark result as sections of a self-contained HTML page (`llmopt.report`).

For a run or a sweep: every level's numbers, the latency CDFs (TTFT, TPOT and E2EL, one line per level,
from the per-request samples the report keeps), the throughput-latency curve with the knee starred and
the recommendation. A scenario adds its comparison table, an A/B run its B/A ratios with their bootstrap
intervals (a table and a forest plot). The gates come last in the command's page, with point, interval
and verdict. A recipe's `summary.html` takes the same sections from `bench/bench.json`.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmopt.bench.ab_report import AB_METRICS, AbReport
from llmopt.bench.report import BenchReport, BenchRun, hit_rate_text
from llmopt.bench.scenario_report import ScenarioReport
from llmopt.gates import GateResult
from llmopt.report.figures import cdf_svg, curve_svg, intervals_svg
from llmopt.report.html import (
    Raw,
    Section,
    figure,
    gate_rows,
    gate_table,
    num,
    paragraph,
    render_page,
    table,
)

AnyBench = BenchReport | ScenarioReport | AbReport
_CDFS = (("ttft", "TTFT", "time to first token"), ("tpot", "TPOT", "time per output token, after the first"),
         ("e2el", "E2EL", "end-to-end latency"))


def _runs_table(runs: Sequence[tuple[str, BenchRun]]) -> Raw:
    head = ["run", "completed", "failed", "req/s", "output tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
            "ITL p50", "ITL p99", "E2EL p99", "goodput"]
    rows = [[name + (" (interrupted)" if r.stopped_early else ""), r.completed, r.failed, num(r.request_throughput),
             num(r.output_throughput), num(r.ttft_ms.p50), num(r.ttft_ms.p99), num(r.tpot_ms.p50), num(r.tpot_ms.p99),
             num(r.itl_ms.p50), num(r.itl_ms.p99), num(r.e2el_ms.p99), num(r.goodput)] for name, r in runs]
    return table(head, rows, numeric=tuple(range(1, len(head))))


def _cdf_section(runs: Sequence[tuple[str, BenchRun]], prefix: str) -> Section:
    s = Section(f"{prefix}latency", "Latency CDFs")
    for key, short, what in _CDFS:
        series = [(name, getattr(r.samples, f"{key}_ms")) for name, r in runs if r.samples is not None]
        svg = cdf_svg(f"{prefix}cdf-{key}", series, f"{short} (ms)", f"{short} CDF")
        if svg is None:
            s.add(paragraph(f"{short}: no per-request samples in this report.", "note"))
        else:
            s.add(figure(svg, f"{short} ({what}): the share of successful requests at or below each latency, "
                         "one line per run.", f"fig-{prefix}cdf-{key}"))
    s.add(paragraph("ITL (gaps between streamed chunks, pooled over requests) is given as percentiles in the table "
                    "above; the report keeps no per-chunk samples.", "note"))
    return s


def _curve_section(report: BenchReport, prefix: str, title: str = "Throughput-latency curve") -> Section | None:
    if len(report.runs) < 2:
        return None
    metric, pct = report.knee_metric, report.knee_percentile
    pts = [(r.label, getattr(r.latency(metric), pct), r.output_throughput) for r in report.runs]
    knee = report.knee
    star = None
    if knee is not None and knee.point is not None and knee.point.latency_ms is not None:
        star = (knee.point.latency_ms, knee.point.throughput)
    svg = curve_svg(f"{prefix}curve", pts, star, f"{pct} {metric.upper()} (ms)",
                    f"knee ({knee.method})" if knee is not None else "knee")
    s = Section(f"{prefix}curve", title)
    if svg is not None:
        s.add(figure(svg, f"Output throughput against {pct} {metric.upper()}, one point per load level; the star is "
                     "the knee: past it, more load buys queueing delay, not throughput.", f"fig-{prefix}curve"))
    s.add(paragraph(f"Knee ({knee.method}): {knee.recommendation}" if knee is not None else "No knee was found."))
    return s


def _run_sections(report: BenchReport, prefix: str = "", name: str = "") -> list[Section]:
    runs = [(r.label, r) for r in report.runs]
    head = Section(f"{prefix}runs", f"{name}Runs" if name else "Runs")
    t = report.target
    where = t.url if t.kind == "http" else "in-process engine"
    head.add(paragraph(f"Target: {where} ({t.model or 'model n/a'}); workload: {report.workload.kind}; "
                       f"{len(report.runs)} run(s). Latencies in ms."))
    head.add(_runs_table(runs))
    if any(r.server_metrics is not None for r in report.runs):
        head.add(table(["run", "prefix cache hit rate"], [[r.label, hit_rate_text(r)] for r in report.runs]))
    out = [head, _cdf_section(runs, prefix)]
    curve = _curve_section(report, prefix)
    if curve is not None:
        out.append(curve)
    return out


def _ab_sections(rep: AbReport) -> list[Section]:
    a, b = (s.name for s in rep.sides)
    s = Section("ab", "A/B ratios")
    s.add(paragraph(f"A = {a} ({rep.sides[0].spec}), B = {b} ({rep.sides[1].spec}); {rep.rounds} rounds, order "
                    f"{' '.join(rep.sequence)}; B / A over the rounds with {100 * rep.confidence:g}% bootstrap "
                    "intervals, paired by round."))
    rows, forest = [], []
    for metric, better in AB_METRICS:
        est = rep.ratios.get(metric)
        if est is None or est.ratio is None:
            continue
        if est.low is None or est.high is None:
            shown = "too few rounds"
        elif est.low <= 1.0 <= est.high:
            shown = "no difference shown"
        else:
            shown = "B better" if (est.low > 1.0) == (better == "higher") else "B worse"
        rows.append([metric, f"x{est.ratio:.3f}", "-" if est.low is None else f"[{est.low:.3f}, {est.high:.3f}]",
                     est.rounds, better, shown])
        forest.append((metric, est.ratio, est.low, est.high))
    s.add(table(["metric", "B / A", "interval", "rounds", "better", "shows"], rows, numeric=(1, 2, 3)))
    svg = intervals_svg("ab-ratios", forest, 1.0, "B / A", "B / A with bootstrap intervals")
    if svg is not None:
        s.add(figure(svg, "Each metric's B / A ratio and its interval; the dashed line is 1 (no difference).",
                     "fig-ab-ratios"))
    runs = [(f"{side.name}: {r.label}", r) for side in rep.sides for r in side.report.runs]
    sides = Section("ab-runs", "Both sides")
    sides.add(_runs_table(runs))
    return [s, sides, _cdf_section(runs, "ab-")]


def _scenario_sections(rep: ScenarioReport) -> list[Section]:
    s = Section("scenario", f"Scenario {rep.scenario}")
    s.add(paragraph(rep.description))
    names = rep.comparison.reports
    rows = []
    for row in rep.comparison.rows:
        cells = [f"{num(c.value)}" + ("" if i == 0 or c.ratio is None else f" (x{c.ratio:.2f})")
                 for i, c in enumerate(row.cells)]
        rows.append([row.run, row.metric, *cells])
    s.add(table(["load", "metric", *[f"{n} (base)" if i == 0 else n for i, n in enumerate(names)]], rows))
    out = [s]
    runs = [(f"{v.name}: {r.label}", r) for v in rep.variants for r in v.report.runs]
    variants = Section("scenario-runs", "Variants")
    variants.add(_runs_table(runs))
    out += [variants, _cdf_section(runs, "scenario-")]
    for i, v in enumerate(rep.variants):
        curve = _curve_section(v.report, f"v{i}-", f"Throughput-latency curve: {v.name}")
        if curve is not None:
            out.append(curve)
    return out


def bench_sections(result: AnyBench) -> list[Section]:
    """The sections of a plain report, a scenario or an A/B result (gates are added by the caller)."""
    if isinstance(result, AbReport):
        return _ab_sections(result)
    if isinstance(result, ScenarioReport):
        return _scenario_sections(result)
    return _run_sections(result)


def bench_page(result: AnyBench, gates: Sequence[GateResult] = ()) -> str:
    """The whole `--html` page: the result's sections, then its gates."""
    sections = bench_sections(result)
    if gates:
        g = Section("gates", "Gates")
        g.add(gate_table(gate_rows(gates)))
        sections.append(g)
    kind = {AbReport: "A/B", ScenarioReport: "scenario"}.get(type(result), "")
    verdict = "no gates" if not gates else ("all gates passed" if all(x.passed for x in gates) else
                                            "gate(s) failed")
    return render_page(f"llmopt bench {kind}".strip(), sections, meta=[verdict])
