"""The benchmark result file and everything that renders it: JSON, Markdown, a rich summary, a PNG, a comparison.

The JSON schema is the contract between `llmopt bench`, CI gates and humans comparing runs, so it is a
pydantic model (`BenchReport`) that both writes and validates. Infinite request rates ("all at once") are
written as the JSON string "Infinity" and read back as `inf`. Files are written atomically (`llmopt.io`:
temp file in the same directory, then `os.replace`), so an interrupted run never leaves half a report behind.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rich.console import Console
from rich.table import Table

from llmopt._version import __version__
from llmopt.bench.ab_stats import RatioEstimate, ratio_interval
from llmopt.bench.conversations import TurnStats, turn_stats
from llmopt.bench.http_target import ServerMetrics
from llmopt.bench.knee import Knee, SweepPoint, find_knee
from llmopt.bench.load import LoadResult
from llmopt.bench.metrics import LatencyStats, RunMetrics, Slo, compute_metrics
from llmopt.bench.workload_spec import AnyWorkload
from llmopt.errors import LlmoptError
from llmopt.io import write_bytes_atomic

LatencyMetric = Literal["ttft", "tpot", "itl", "e2el"]
Percentile = Literal["mean", "p50", "p90", "p99"]
SweepKind = Literal["concurrency", "request_rate"]
_METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


class TargetInfo(BaseModel):
    """What was benchmarked."""

    kind: Literal["http", "offline"]
    url: str | None = None
    model: str | None = None
    endpoint: str | None = Field(None, description="completions | chat | auto (HTTP only).")
    server: str | None = Field(None, description="`owned_by` from /v1/models: llmopt, vllm, llamacpp, ...")
    engine: dict[str, Any] | None = Field(
        None, description="Offline: the EngineConfig used, plus the dtype and device it resolved to.")


class BenchRun(RunMetrics):
    """One load level: its pattern, its metrics and what the server counted meanwhile."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    label: str
    concurrency: int | None = Field(None, description="Max requests in flight; None is unbounded.")
    request_rate: float = Field(math.inf, description="Arrival rate in req/s; Infinity sends all at once.")
    burstiness: float = 1.0
    stopped_early: bool = Field(False, description="The run was interrupted (Ctrl-C); metrics are partial.")
    server_metrics: ServerMetrics | None = None
    turns: list[TurnStats] | None = Field(None, description="Conversations: TTFT per turn index.")
    rounds: list[dict[str, float | None]] | None = Field(
        None, description="--rounds / --ab: every gate metric of each round, in the order they ran; the run's "
        "own numbers pool the rounds' requests.")

    @classmethod
    def from_load(
        cls,
        result: LoadResult,
        slo: Slo | None = None,
        server_metrics: ServerMetrics | None = None,
        *,
        keep_samples: bool = True,
    ) -> BenchRun:
        m = compute_metrics(result.records, result.duration_s, slo, keep_samples=keep_samples)
        p = result.pattern
        turns = turn_stats(result.records) if any(r.turn is not None for r in result.records) else None
        return cls(**dict(m), label=p.label(), concurrency=p.concurrency, request_rate=p.request_rate,
                   burstiness=p.burstiness, stopped_early=result.interrupted, server_metrics=server_metrics,
                   turns=turns)

    def load_value(self, sweep: SweepKind) -> float:
        """The swept variable: concurrency (inf if unbounded) or request rate."""
        if sweep == "concurrency":
            return math.inf if self.concurrency is None else float(self.concurrency)
        return self.request_rate

    def latency(self, metric: LatencyMetric) -> LatencyStats:
        return getattr(self, f"{metric}_ms")


class BenchReport(BaseModel):
    """A whole `llmopt bench` invocation: one run per load level, plus the knee of the sweep."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    target: TargetInfo
    workload: AnyWorkload
    sweep: SweepKind | None = Field(None, description="What varied between runs; None for a single run.")
    knee_metric: LatencyMetric = "ttft"
    knee_percentile: Percentile = "p99"
    slo: Slo | None = None
    runs: list[BenchRun]
    knee: Knee | None = None
    created: datetime = Field(default_factory=lambda: datetime.now(UTC))
    llmopt_version: str = __version__

    def with_knee(self, attainment: float = 0.99) -> BenchReport:
        """A copy with `knee` computed from the runs (None for a single run or no sweep)."""
        knee = knee_from_runs(self.runs, self.sweep, metric=self.knee_metric, percentile=self.knee_percentile,
                              attainment=attainment) if self.sweep else None
        return self.model_copy(update={"knee": knee})


def knee_from_runs(
    runs: Sequence[BenchRun],
    sweep: SweepKind,
    *,
    metric: LatencyMetric = "ttft",
    percentile: Percentile = "p99",
    attainment: float = 0.99,
) -> Knee | None:
    """Sweep points from runs, then `find_knee`.

    With an SLO, a run meets it when at least `attainment` of its finished requests met every bound (so
    failures count against it): a joint p99 when attainment is 0.99.
    """
    points = [
        SweepPoint(
            x=r.load_value(sweep),
            throughput=r.output_throughput,
            latency_ms=getattr(r.latency(metric), percentile),
            slo_met=None if r.slo is None or r.slo_attainment is None else r.slo_attainment >= attainment,
        )
        for r in runs
    ]
    return find_knee(points, x_kind=sweep, latency_label=f"{percentile} {metric.upper()}")


# ---------------------------------------------------------------------------------------- file I/O


def write_json(report: BenchReport, path: str | Path) -> Path:
    data = report.model_dump_json(indent=2).encode() + b"\n"
    return write_bytes_atomic(path, data)


def load_report(path: str | Path) -> BenchReport:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise LlmoptError(f"cannot read report {p}: {e.strerror or e}") from None
    try:
        return BenchReport.model_validate_json(text)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise LlmoptError(f"{p} is not an llmopt bench report: {where}: {first['msg']}") from None


# ----------------------------------------------------------------------------------------- text output


def _f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _rate(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:g}"


def _workload_text(report: BenchReport) -> str:
    w = report.workload
    if w.kind == "jsonl":
        return f"jsonl {w.path}"
    if w.kind == "trace":
        return f"trace {w.path} (blocks of {w.block_size} tokens, timestamps in {w.time_unit} x{w.time_scale:g})"
    if w.kind == "conversation":
        return (f"conversations: {w.num_users} users x {w.turns} turns, first message {w.first_len}, later "
                f"{w.message_len}, answers {w.output_len} tokens, think time {w.think_time} s")
    if w.kind == "prefix":
        return (f"prefix: {w.num_requests} requests, {w.num_prefixes} prefixes x {w.prefix_len} tokens, "
                f"suffix {w.suffix_len}, output {w.output_len}")
    return f"random: {w.num_requests} requests, input {w.input_len}, output {w.output_len} tokens"


def _target_text(report: BenchReport) -> str:
    t = report.target
    where = t.url if t.kind == "http" else "in-process engine"
    bits = [b for b in (t.model, t.server and f"server {t.server}") if b]
    return f"{where} ({', '.join(bits)})" if bits else str(where)


def to_markdown(report: BenchReport) -> str:
    """A Markdown table with one row per run, plus target, workload, SLO and knee."""
    lines = [
        "# llmopt bench",
        "",
        f"- target: {_target_text(report)}",
        f"- workload: {_workload_text(report)}",
    ]
    if report.slo is not None:
        lines.append(f"- SLO: {report.slo.describe()}")
    lines += [f"- created: {report.created.isoformat(timespec='seconds')}, llmopt {report.llmopt_version}", ""]
    head = ["load", "req/s", "output tok/s", "total tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)",
            "TPOT p50 (ms)", "TPOT p99 (ms)", "ITL p99 (ms)", "E2EL p99 (ms)", "goodput (req/s)", "failed"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    for r in report.runs:
        row = [r.label + (" (interrupted)" if r.stopped_early else ""), _f(r.request_throughput),
               _f(r.output_throughput), _f(r.total_throughput), _f(r.ttft_ms.p50), _f(r.ttft_ms.p99),
               _f(r.tpot_ms.p50), _f(r.tpot_ms.p99), _f(r.itl_ms.p99), _f(r.e2el_ms.p99), _f(r.goodput),
               str(r.failed)]
        lines.append("| " + " | ".join(row) + " |")
    if report.knee is not None:
        lines += ["", f"**Knee ({report.knee.method}):** {report.knee.recommendation}"]
    for r in report.runs:
        if r.turns:
            lines += ["", f"TTFT per turn ({r.label}); prefix cache hit rate: {hit_rate_text(r)}", "",
                      "| " + " | ".join(_TURN_HEAD) + " |", "|" + "|".join(["---:"] * len(_TURN_HEAD)) + "|"]
            lines += ["| " + " | ".join(row) + " |" for row in turn_rows(r)]
    return "\n".join(lines) + "\n"


def write_markdown(report: BenchReport, path: str | Path) -> Path:
    data = to_markdown(report).encode()
    return write_bytes_atomic(path, data)


def summary_rows(run: BenchRun) -> list[tuple[str, str] | str]:
    """vLLM's printed summary as (label, value) rows; a bare string starts a section."""
    rows: list[tuple[str, str] | str] = [
        ("Successful requests:", str(run.completed)),
        ("Failed requests:", str(run.failed)),
    ]
    for code, n in sorted(run.failures.items()):
        rows.append((f"  {code}:", str(n)))
    if run.interrupted or run.stopped_early:
        rows.append(("Interrupted requests:", str(run.interrupted)))
    rows += [
        ("Benchmark duration (s):", _f(run.duration_s)),
        ("Total input tokens:", str(run.total_input_tokens)),
        ("Total generated tokens:", str(run.total_output_tokens)),
        ("Request throughput (req/s):", _f(run.request_throughput)),
    ]
    if run.goodput is not None:
        rows.append(("Request goodput (req/s):", _f(run.goodput)))
    rows += [
        ("Output token throughput (tok/s):", _f(run.output_throughput)),
        ("Peak output token throughput (tok/s):", _f(run.peak_output_throughput)),
        ("Peak concurrent requests:", str(run.peak_concurrency)),
        ("Total token throughput (tok/s):", _f(run.total_throughput)),
    ]
    for metric, title in _METRIC_TITLES.items():
        s: LatencyStats = getattr(run, f"{metric}_ms")
        name = metric.upper()
        rows += [title, (f"Mean {name} (ms):", _f(s.mean)), (f"Median {name} (ms):", _f(s.p50)),
                 (f"P90 {name} (ms):", _f(s.p90)), (f"P99 {name} (ms):", _f(s.p99))]
    sm = run.server_metrics
    if sm is not None:
        extra = [(label, v) for label, v in (
            ("Prefix cache hit rate (%):", None if sm.prefix_cache_hit_rate is None else 100 * sm.prefix_cache_hit_rate),
            ("Spec decode acceptance rate (%):",
             None if sm.spec_decode_acceptance_rate is None else 100 * sm.spec_decode_acceptance_rate),
            ("Spec decode acceptance length:", sm.spec_decode_mean_acceptance_length),
            ("Preemptions:", sm.preemptions),
            ("Peak KV cache usage (%):", None if sm.kv_cache_usage_peak is None else 100 * sm.kv_cache_usage_peak),
            ("Mean batch size (seqs/step):", sm.mean_batch_size),
        ) if v is not None]
        if extra:
            rows.append("Server metrics")
            rows += [(label, _f(v, 0 if label == "Preemptions:" else 2)) for label, v in extra]
    return rows


def summary_text(run: BenchRun) -> str:
    """The plain-text block `vllm bench serve` prints, for logs."""
    out = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    for row in summary_rows(run):
        if isinstance(row, str):
            out.append("{s:{c}^50}".format(s=row, c="-"))
        else:
            out.append(f"{row[0]:<40} {row[1]:<10}")
    out.append("=" * 50)
    return "\n".join(out)


def render_summary(run: BenchRun, console: Console, title: str | None = None) -> None:
    """One run as a rich two-column table in vLLM's layout."""
    table = Table(title=title or f"Serving Benchmark Result ({run.label})", show_header=False,
                  title_style="bold", min_width=50)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for row in summary_rows(run):
        if isinstance(row, str):
            table.add_section()
            table.add_row(f"[bold cyan]{row}[/]", "")
        else:
            table.add_row(*row)
    console.print(table)


def hit_rate_text(run: BenchRun) -> str:
    """The run's prefix-cache hit rate, or why there is none."""
    sm = run.server_metrics
    if sm is None or sm.prefix_cache_queries is None:
        return "n/a (the target exports no prefix-cache counters)"
    if sm.prefix_cache_hit_rate is None:
        return "n/a (no prompt token was looked up: prefix caching off)"
    return f"{100 * sm.prefix_cache_hit_rate:.1f}% ({sm.prefix_cache_hits:.0f} of {sm.prefix_cache_queries:.0f} prompt tokens)"


def turn_rows(run: BenchRun) -> list[list[str]]:
    return [[str(t.turn + 1), str(t.completed), str(t.failed), _f(t.prompt_tokens_mean, 0), _f(t.ttft_ms.mean),
             _f(t.ttft_ms.p50), _f(t.ttft_ms.p90), _f(t.ttft_ms.p99)] for t in run.turns or []]


_TURN_HEAD = ["turn", "completed", "failed", "prompt tokens (mean)", "TTFT mean (ms)", "TTFT p50 (ms)",
              "TTFT p90 (ms)", "TTFT p99 (ms)"]


def render_turns(run: BenchRun, console: Console, title: str | None = None) -> None:
    """Conversations: TTFT per turn index, and the prefix-cache hit rate the target counted."""
    table = Table(title=title or f"TTFT per turn ({run.label})", title_style="bold")
    for col in _TURN_HEAD:
        table.add_column(col, justify="right")
    for row in turn_rows(run):
        table.add_row(*row)
    console.print(table)
    console.print(f"prefix cache hit rate: {hit_rate_text(run)}", highlight=False)


def render_report(report: BenchReport, console: Console) -> None:
    """A single run as vLLM's summary; a sweep as one row per run plus the knee."""
    if len(report.runs) == 1:
        render_summary(report.runs[0], console)
        if report.runs[0].turns:
            render_turns(report.runs[0], console)
    else:
        p = report.knee_percentile
        table = Table(title=f"llmopt bench: {_target_text(report)}", title_style="bold")
        for col in ("load", "req/s", "out tok/s", f"TTFT {p}", f"TPOT {p}", f"ITL {p}", f"E2EL {p}",
                    "goodput", "failed"):
            table.add_column(col, justify="left" if col == "load" else "right")
        knee_idx = report.knee.index if report.knee is not None else None
        for i, r in enumerate(report.runs):
            style = "bold green" if i == knee_idx else None
            table.add_row(r.label + (" *" if r.stopped_early else ""), _f(r.request_throughput),
                          _f(r.output_throughput, 1), *(_f(getattr(r.latency(m), p), 1)
                                                        for m in ("ttft", "tpot", "itl", "e2el")),
                          _f(r.goodput), str(r.failed), style=style)
        console.print(table)
        console.print("latencies in ms; * = interrupted run")
    if report.knee is not None:
        console.print(f"[bold]knee ({report.knee.method}):[/] {report.knee.recommendation}")


# ----------------------------------------------------------------------------------------------- plot


def _figure_png(report: BenchReport) -> bytes:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise LlmoptError("--plot needs matplotlib: pip install matplotlib (or the llmopt bench extra)") from None

    # Figure + the Agg canvas directly: no pyplot, so no global backend switch and no GUI
    fig = Figure(figsize=(16, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_curve, ax_ttft, ax_tpot = fig.subplots(1, 3)
    metric, pct = report.knee_metric, report.knee_percentile

    xs = [getattr(r.latency(metric), pct) for r in report.runs]
    ys = [r.output_throughput for r in report.runs]
    pts = [(x, y, r.label) for x, y, r in zip(xs, ys, report.runs, strict=True) if x is not None]
    if pts:
        ax_curve.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        for x, y, label in pts:
            ax_curve.annotate(label, (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
    knee = report.knee
    if knee is not None and knee.point is not None and knee.point.latency_ms is not None:
        ax_curve.plot([knee.point.latency_ms], [knee.point.throughput], marker="*", markersize=18,
                      color="red", linestyle="none", label=f"knee ({knee.method})")
        ax_curve.legend(loc="lower right")
    ax_curve.set_xlabel(f"{pct} {metric.upper()} (ms)")
    ax_curve.set_ylabel("output throughput (tok/s)")
    ax_curve.set_title("throughput vs latency")
    ax_curve.grid(True, alpha=0.3)

    for ax, name in ((ax_ttft, "ttft"), (ax_tpot, "tpot")):
        data = [(r.label, getattr(r.samples, f"{name}_ms")) for r in report.runs if r.samples is not None]
        data = [(label, v) for label, v in data if v]
        if not data:
            ax.text(0.5, 0.5, "no per-request samples", ha="center", va="center", transform=ax.transAxes)
        elif len(data) == 1:
            ax.hist(data[0][1], bins=min(50, max(5, len(data[0][1]) // 4)))
            ax.set_xlabel(f"{name.upper()} (ms)")
            ax.set_ylabel("requests")
        else:
            ax.boxplot([v for _, v in data], tick_labels=[label for label, _ in data], showfliers=True)
            ax.set_ylabel(f"{name.upper()} (ms)")
            ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        ax.set_title(f"{name.upper()} distribution")
        ax.grid(True, alpha=0.3)

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def write_plot(report: BenchReport, path: str | Path) -> Path:
    """Throughput vs latency with the knee marked, and TTFT/TPOT distributions, as one PNG."""
    data = _figure_png(report)
    return write_bytes_atomic(path, data)


# -------------------------------------------------------------------------------------------- compare

_COMPARE_METRICS: list[tuple[str, str, Literal["higher", "lower"]]] = [
    ("output tok/s", "output_throughput", "higher"),
    ("req/s", "request_throughput", "higher"),
    ("goodput req/s", "goodput", "higher"),
    ("TTFT p50 ms", "ttft_ms.p50", "lower"),
    ("TTFT p99 ms", "ttft_ms.p99", "lower"),
    ("TPOT p50 ms", "tpot_ms.p50", "lower"),
    ("TPOT p99 ms", "tpot_ms.p99", "lower"),
    ("ITL p99 ms", "itl_ms.p99", "lower"),
    ("E2EL p99 ms", "e2el_ms.p99", "lower"),
    ("failed", "failed", "lower"),
    ("prefix hit rate", "server_metrics.prefix_cache_hit_rate", "higher"),
    ("preemptions", "server_metrics.preemptions", "lower"),
    ("mean batch size", "server_metrics.mean_batch_size", "higher"),
]


def round_key(field: str) -> str:
    """The key of a compared field in `BenchRun.rounds`: `ttft_ms.p50` -> `ttft_p50_ms`."""
    head, _, tail = field.partition(".")
    if head == "server_metrics":
        return tail
    if head.endswith("_ms") and tail:
        return f"{head.removesuffix('_ms')}_{tail}_ms"
    return head


class CompareCell(BaseModel):
    value: float | None
    ratio: float | None = Field(None, description="value / the first report's value.")
    interval: RatioEstimate | None = Field(
        None, description="Bootstrap interval of the ratio over rounds, when both runs recorded rounds.")


class CompareRow(BaseModel):
    run: str
    metric: str
    better: Literal["higher", "lower"]
    cells: list[CompareCell]


class Comparison(BaseModel):
    """Metrics of matching runs (same load label) across reports, each with its ratio to the first."""

    reports: list[str]
    rows: list[CompareRow]


def _get(run: BenchRun, dotted: str) -> float | None:
    obj: Any = run
    for part in dotted.split("."):
        if obj is None:
            return None  # e.g. server_metrics of a target without /metrics
        obj = getattr(obj, part)
    return None if obj is None else float(obj)


def compare_reports(paths: Sequence[str | Path]) -> Comparison:
    """Load reports and line up their runs by load label; ratios are against the first report."""
    if len(paths) < 2:
        raise LlmoptError("--compare needs at least two report files")
    return compare_named([(str(p), load_report(p)) for p in paths])


def compare_named(named: Sequence[tuple[str, BenchReport]], *, match: Literal["label", "index"] = "label",
                  paired: bool = False, confidence: float = 0.95) -> Comparison:
    """Line up the runs of already-loaded reports; ratios are against the first one.

    `match="label"` pairs runs with the same load label (reports from different invocations);
    `match="index"` pairs the i-th run of every report, for variants of one scenario that ran the same
    load levels under different labels (e.g. `static batches of 8` and `concurrency 8`).
    Where both runs recorded rounds (`--rounds`, `--ab`), each ratio gets a bootstrap interval over them:
    `paired` when the rounds ran interleaved in one invocation (the two sides of an A/B file), else the
    two runs are resampled independently.
    """
    reports = [rep for _, rep in named]
    keyed: list[dict[str, BenchRun]] = []
    keys: list[str] = []
    if match == "label":
        for rep in reports:
            keys += [r.label for r in rep.runs if r.label not in keys]
        keyed = [{r.label: r for r in rep.runs} for rep in reports]
    else:
        for i in range(max(len(rep.runs) for rep in reports)):
            labels = list(dict.fromkeys(rep.runs[i].label for rep in reports if i < len(rep.runs)))
            keys.append(" vs ".join(labels))
        keyed = [{k: rep.runs[i] for i, k in enumerate(keys) if i < len(rep.runs)} for rep in reports]
    rows: list[CompareRow] = []
    for key in keys:
        for name, field, better in _COMPARE_METRICS:
            values = [_get(runs[key], field) if key in runs else None for runs in keyed]
            if all(v is None for v in values):
                continue
            base = values[0]
            cells = [CompareCell(value=v, ratio=(v / base) if v is not None and base else None,
                                 interval=_round_interval(keyed[0].get(key), runs.get(key), field, paired,
                                                          confidence) if i else None)
                     for i, (v, runs) in enumerate(zip(values, keyed, strict=True))]
            rows.append(CompareRow(run=key, metric=name, better=better, cells=cells))
    return Comparison(reports=[name for name, _ in named], rows=rows)


def _round_interval(base: BenchRun | None, run: BenchRun | None, field: str, paired: bool,
                    confidence: float) -> RatioEstimate | None:
    if base is None or run is None or not base.rounds or not run.rounds:
        return None
    k = round_key(field)
    a, b = [r.get(k) for r in base.rounds], [r.get(k) for r in run.rounds]
    if paired and len(a) != len(b):
        paired = False
    est = ratio_interval(a, b, paired=paired, confidence=confidence)
    return est if est.ratio is not None else None


def _ratio_text(c: CompareCell) -> str:
    iv = c.interval
    if iv is not None and iv.ratio is not None and iv.low is not None and iv.high is not None:
        # the interval is about the rounds' means, so is the ratio shown with it (the pooled one may differ)
        return f"x{iv.ratio:.2f} [{iv.low:.2f}, {iv.high:.2f}] over rounds"
    return f"x{c.ratio:.2f}"


def render_comparison(cmp: Comparison, console: Console, tolerance: float = 0.02, title: str | None = None) -> None:
    """Rich table; a ratio is green when better than the baseline by more than `tolerance`, red when worse."""
    table = Table(title=title or "llmopt bench --compare (ratios vs the first report)", title_style="bold")
    table.add_column("load")
    table.add_column("metric")
    for i, name in enumerate(cmp.reports):
        table.add_column(Path(name).name + (" (base)" if i == 0 else ""), justify="right")
    last = None
    for row in cmp.rows:
        cells = []
        for i, c in enumerate(row.cells):
            if c.value is None:
                cells.append("-")
                continue
            text = f"{c.value:.2f}"
            if i > 0 and c.ratio is not None:
                gain = c.ratio - 1 if row.better == "higher" else 1 - c.ratio
                color = "green" if gain > tolerance else "red" if gain < -tolerance else "white"
                text += f" [{color}]({_ratio_text(c)})[/]"
            cells.append(text)
        if last is not None and row.run != last:
            table.add_section()
        table.add_row(row.run if row.run != last else "", row.metric, *cells)
        last = row.run
    console.print(table)


def comparison_markdown(cmp: Comparison) -> str:
    """The comparison as a Markdown table: each value with its ratio to the first column in parentheses."""
    head = ["load", "metric"] + [Path(n).name + (" (base)" if i == 0 else "") for i, n in enumerate(cmp.reports)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---", "---"] + ["---:"] * len(cmp.reports)) + "|"]
    for row in cmp.rows:
        cells = []
        for i, c in enumerate(row.cells):
            text = "-" if c.value is None else f"{c.value:.2f}"
            if i > 0 and c.value is not None and c.ratio is not None:
                text += f" ({_ratio_text(c)})"
            cells.append(text)
        lines.append("| " + " | ".join([row.run, row.metric, *cells]) + " |")
    return "\n".join(lines) + "\n"
