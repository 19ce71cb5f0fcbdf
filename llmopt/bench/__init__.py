"""`llmopt bench`: measure TTFT, TPOT, ITL, throughput and goodput against a server or the in-process engine.

The measurement core is target-agnostic: a target is any `async send(BenchRequest) -> RequestRecord`
(`HttpTarget.send` for OpenAI-compatible servers, the engine's adapter offline). `run_load` drives it under
a `LoadPattern`, `compute_metrics` applies vLLM's definitions, `find_knee` picks the load to run at, and
`report` writes and compares the results.
"""

from __future__ import annotations

from llmopt.bench.http_target import (
    HttpTarget,
    HttpTargetConfig,
    MetricsSnapshot,
    ServerMetrics,
    SseParser,
    check_reachable,
    diff_metrics,
    scrape_metrics,
)
from llmopt.bench.knee import Knee, SweepPoint, find_knee
from llmopt.bench.load import LoadPattern, LoadResult, arrival_schedule, parse_sweep, run_load
from llmopt.bench.metrics import LatencyStats, RunMetrics, Slo, apply_slo, compute_metrics, parse_slo
from llmopt.bench.records import RecordTimer, RequestRecord
from llmopt.bench.report import (
    BenchReport,
    BenchRun,
    Comparison,
    TargetInfo,
    compare_reports,
    knee_from_runs,
    load_report,
    render_comparison,
    render_report,
    render_summary,
    to_markdown,
    write_json,
    write_markdown,
    write_plot,
)
from llmopt.bench.workloads import (
    BenchRequest,
    JsonlWorkload,
    LengthDist,
    PrefixWorkload,
    RandomWorkload,
    WorkloadSpec,
    build_requests,
    load_jsonl,
    parse_length,
)

__all__ = [
    "BenchReport",
    "BenchRequest",
    "BenchRun",
    "Comparison",
    "HttpTarget",
    "HttpTargetConfig",
    "JsonlWorkload",
    "Knee",
    "LatencyStats",
    "LengthDist",
    "LoadPattern",
    "LoadResult",
    "MetricsSnapshot",
    "PrefixWorkload",
    "RandomWorkload",
    "RecordTimer",
    "RequestRecord",
    "RunMetrics",
    "ServerMetrics",
    "Slo",
    "SseParser",
    "SweepPoint",
    "TargetInfo",
    "WorkloadSpec",
    "apply_slo",
    "arrival_schedule",
    "build_requests",
    "check_reachable",
    "compare_reports",
    "compute_metrics",
    "diff_metrics",
    "find_knee",
    "knee_from_runs",
    "load_jsonl",
    "load_report",
    "parse_length",
    "parse_slo",
    "parse_sweep",
    "render_comparison",
    "render_report",
    "render_summary",
    "run_load",
    "scrape_metrics",
    "to_markdown",
    "write_json",
    "write_markdown",
    "write_plot",
]
