"""`llmopt bench`: measure TTFT, TPOT, ITL, throughput and goodput against a server or the in-process engine.

The measurement core is target-agnostic: every target turns requests into `RequestRecord`s.
`HttpTarget.send` (an OpenAI-compatible server) is driven by `run_load` under a `LoadPattern`;
`OfflineEngineTarget` drives our engine in-process under the same patterns, emulating the client.
`compute_metrics` applies vLLM's definitions, `find_knee` picks the load to run at, `report` writes and
compares the results, `scenarios` compares engine variants (static vs continuous batching, prefix cache).

`ab` runs two targets in interleaved rounds and `ab_stats` puts bootstrap intervals on their ratios;
`conversations` and `trace_workload` are the multi-turn and trace-replay workloads.

`run_bench(BenchOptions(...).build())` is the whole `llmopt bench` command as one call.
"""

from __future__ import annotations

from llmopt.bench.ab_report import AbReport
from llmopt.bench.ab_stats import RatioEstimate, ratio_interval
from llmopt.bench.config import BenchConfig, BenchOptions
from llmopt.bench.conversations import ConversationWorkload
from llmopt.bench.engine_counters import StepStatsCollector
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
from llmopt.bench.offline import OfflineEngineTarget
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
from llmopt.bench.runner import BenchInterrupted, BenchOutcome, run_bench, show_comparison
from llmopt.bench.scenario_report import ScenarioReport, VariantResult, compare_files
from llmopt.bench.scenarios import SCENARIOS, Scenario, ScenarioParams, Variant, build_scenario
from llmopt.bench.trace_workload import TraceWorkload, load_trace
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
    "SCENARIOS",
    "AbReport",
    "ConversationWorkload",
    "RatioEstimate",
    "TraceWorkload",
    "load_trace",
    "ratio_interval",
    "BenchConfig",
    "BenchInterrupted",
    "BenchOptions",
    "BenchOutcome",
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
    "OfflineEngineTarget",
    "PrefixWorkload",
    "RandomWorkload",
    "RecordTimer",
    "RequestRecord",
    "RunMetrics",
    "Scenario",
    "ScenarioParams",
    "ScenarioReport",
    "ServerMetrics",
    "Slo",
    "SseParser",
    "StepStatsCollector",
    "SweepPoint",
    "TargetInfo",
    "Variant",
    "VariantResult",
    "WorkloadSpec",
    "apply_slo",
    "arrival_schedule",
    "build_requests",
    "build_scenario",
    "check_reachable",
    "compare_files",
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
    "run_bench",
    "run_load",
    "scrape_metrics",
    "show_comparison",
    "to_markdown",
    "write_json",
    "write_markdown",
    "write_plot",
]
