"""Rounds: the same load level measured several times, kept one by one and pooled into one run.

A ratio between two targets is only as good as its spread, and the spread is only visible across
repetitions. So a run of `--rounds N` (and each side of `--ab`) keeps every gate metric of every round in
`BenchRun.rounds`, for bootstrap intervals later (`ab_stats`), while the run's own numbers pool all the
rounds' requests: throughput over the summed durations, percentiles over every request.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmopt.bench.gate_metrics import RUN_METRICS
from llmopt.bench.http_target import ServerMetrics
from llmopt.bench.load import LoadResult
from llmopt.bench.metrics import Slo
from llmopt.bench.report import BenchRun


def round_values(run: BenchRun) -> dict[str, float | None]:
    """Every gate metric of one round (None where it was not measured)."""
    out: dict[str, float | None] = {}
    for name, get in RUN_METRICS.items():
        v = get(run)
        out[name] = None if v is None else float(v)
    return out


def merge_server_metrics(parts: Sequence[ServerMetrics | None]) -> ServerMetrics | None:
    """Counters summed over rounds, rates recomputed from the sums; None when no round had any."""
    got = [p for p in parts if p is not None]
    if not got:
        return None

    def total(name: str) -> float | None:
        vs = [getattr(p, name) for p in got if getattr(p, name) is not None]
        return float(sum(vs)) if vs else None

    def ratio(num: float | None, den: float | None) -> float | None:
        return num / den if num is not None and den else None

    hits, queries = total("prefix_cache_hits"), total("prefix_cache_queries")
    drafts, accepted = total("spec_decode_draft_tokens"), total("spec_decode_accepted_tokens")
    peaks = [p.kv_cache_usage_peak for p in got if p.kv_cache_usage_peak is not None]
    batches = [p.mean_batch_size for p in got if p.mean_batch_size is not None]
    lengths = [p.spec_decode_mean_acceptance_length for p in got if p.spec_decode_mean_acceptance_length]
    counters: dict[str, float] = {}
    for p in got:
        for k, v in p.counters.items():
            counters[k] = counters.get(k, 0.0) + v
    return ServerMetrics(prefix_cache_hits=hits, prefix_cache_queries=queries,
                         prefix_cache_hit_rate=ratio(hits, queries), spec_decode_draft_tokens=drafts,
                         spec_decode_accepted_tokens=accepted, spec_decode_acceptance_rate=ratio(accepted, drafts),
                         spec_decode_mean_acceptance_length=sum(lengths) / len(lengths) if lengths else None,
                         preemptions=total("preemptions"), kv_cache_usage_peak=max(peaks) if peaks else None,
                         mean_batch_size=sum(batches) / len(batches) if batches else None, counters=counters)


def pool_rounds(results: Sequence[tuple[LoadResult, ServerMetrics | None]], slo: Slo | None, *,
                keep_samples: bool = True, label: str | None = None) -> BenchRun:
    """One run from several rounds of the same level: pooled numbers, plus each round's in `rounds`."""
    per_round = [BenchRun.from_load(r, slo, sm, keep_samples=False) for r, sm in results]
    first = results[0][0]
    pooled = LoadResult(pattern=first.pattern, records=[rec for r, _ in results for rec in r.records],
                        duration_s=sum(r.duration_s for r, _ in results),
                        interrupted=any(r.interrupted for r, _ in results))
    run = BenchRun.from_load(pooled, slo, merge_server_metrics([sm for _, sm in results]),
                             keep_samples=keep_samples)
    run.rounds = [round_values(r) for r in per_round]
    if label is not None:
        run.label = label
    return run
