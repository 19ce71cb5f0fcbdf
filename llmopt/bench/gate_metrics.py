"""What a `--gate` metric name means for a benchmark, and which run it is read from.

Names are flat so they read well on a command line: `output_throughput`, `request_throughput`, `goodput`,
`failed`, `ttft_p99_ms`, `tpot_mean_ms`, `e2el_p50_ms`, `prefix_cache_hit_rate`, `preemptions`, ... (see
`RUN_METRICS`). Throughputs are per second, latencies in milliseconds, rates in 0..1.

Which run: a gate checks the run you would deploy, i.e. the knee of a sweep (the recommended load), or
the only run when one load level was measured. A sweep whose knee has no point (no level met the SLO)
has nothing to check, and every gate fails as "not measured".

Scenarios check the last variant (the candidate: continuous batching, prefix caching on), and add
`<metric>_ratio` = candidate / baseline, e.g. `--gate "output_throughput_ratio>=1.5"`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llmopt.bench.report import BenchReport, BenchRun
from llmopt.bench.scenario_report import ScenarioReport
from llmopt.errors import LlmoptError
from llmopt.gates import Gate, GateResult, check_gates

RunGetter = Callable[[BenchRun], float | None]


def _field(name: str) -> RunGetter:
    return lambda r: getattr(r, name)


def _latency(metric: str, stat: str) -> RunGetter:
    return lambda r: getattr(getattr(r, f"{metric}_ms"), stat)


def _server(name: str) -> RunGetter:
    return lambda r: None if r.server_metrics is None else getattr(r.server_metrics, name)


RUN_METRICS: dict[str, RunGetter] = {
    **{n: _field(n) for n in (
        "completed", "failed", "interrupted", "duration_s", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_throughput", "goodput", "slo_attainment",
        "peak_output_throughput", "peak_concurrency")},
    **{f"{m}_{s}_ms": _latency(m, s) for m in ("ttft", "tpot", "itl", "e2el")
       for s in ("mean", "std", "min", "max", "p50", "p90", "p99")},
    **{n: _server(n) for n in (
        "prefix_cache_hit_rate", "preemptions", "kv_cache_usage_peak", "mean_batch_size",
        "spec_decode_acceptance_rate", "spec_decode_mean_acceptance_length")},
}
RATIO_SUFFIX = "_ratio"


def known_metrics(*, scenario: bool = False) -> list[str]:
    names = list(RUN_METRICS)
    return names + [n + RATIO_SUFFIX for n in names] if scenario else names


def validate_gates(gates: Sequence[Gate], *, scenario: bool = False) -> None:
    """Reject unknown metric names before anything runs (a typo must not cost a benchmark)."""
    known = set(known_metrics(scenario=scenario))
    for g in gates:
        if g.metric not in known:
            hint = "" if scenario or not g.metric.endswith(RATIO_SUFFIX) else " (ratios need --scenario)"
            raise LlmoptError(f"unknown gate metric {g.metric!r}{hint}: use e.g. output_throughput, "
                              "request_throughput, goodput, failed, ttft_p99_ms, tpot_p50_ms, e2el_p99_ms, "
                              "prefix_cache_hit_rate (docs/BENCH.md lists them all)")


def gated_run(report: BenchReport) -> BenchRun | None:
    """The knee run of a sweep, or the only run; None when there is nothing to check."""
    if not report.runs:
        return None
    if report.knee is not None:
        return None if report.knee.index is None else report.runs[report.knee.index]
    return report.runs[0] if len(report.runs) == 1 else None


def _value(run: BenchRun | None, metric: str) -> float | None:
    if run is None:
        return None
    v = RUN_METRICS[metric](run)
    return None if v is None else float(v)


def check_report_gates(report: BenchReport, gates: Sequence[Gate]) -> list[GateResult]:
    run = gated_run(report)
    return check_gates(gates, lambda m: _value(run, m))


def check_scenario_gates(rep: ScenarioReport, gates: Sequence[Gate]) -> list[GateResult]:
    base = gated_run(rep.baseline.report)
    cand = gated_run(rep.variants[-1].report)

    def lookup(metric: str) -> float | None:
        if metric.endswith(RATIO_SUFFIX):
            name = metric.removesuffix(RATIO_SUFFIX)
            num, den = _value(cand, name), _value(base, name)
            return num / den if num is not None and den else None
        return _value(cand, metric)

    return check_gates(gates, lookup)
