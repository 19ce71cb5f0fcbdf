"""Turn raw request records into the numbers `vllm bench serve` prints, with vLLM's exact definitions.

Definitions (all over *successful* requests; latencies reported in milliseconds):

* TTFT = first_token - start.
* TPOT = (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one output token: the
  first token is prefill, so including it would mix two different costs.
* ITL  = gaps between consecutive streamed chunks, pooled over all requests (vLLM's streaming ITL). A
  chunk holding k tokens yields one gap, so ITL is what a user *sees*, TPOT what the engine *does*.
* E2EL = end - start, where `end` is the last token's arrival.
* request/output/total throughput = completed requests, output tokens, prompt+output tokens per second
  of wall duration.
* goodput (vLLM): completed requests per second whose TTFT, TPOT and E2EL are all within the SLO;
  a request with at most one output token counts as TPOT 0.

Percentiles use numpy's default linear interpolation, std is the population std, as vLLM.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, Field

from llmopt.bench.records import RequestRecord
from llmopt.errors import LlmoptError

_SLO_METRICS = ("ttft", "tpot", "e2el")
_UNIT_TO_MS = {"": 1.0, "ms": 1.0, "s": 1000.0, "us": 1e-3}
_SLO_ITEM_RE = re.compile(r"^([a-zA-Z0-9_]+)\s*[=:]\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)$")


class Slo(BaseModel):
    """Per-request latency bounds in milliseconds; a request is 'good' when it meets all that are set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def describe(self) -> str:
        """Compact form accepted back by `parse_slo`, e.g. `ttft=1000ms,tpot=50ms`."""
        parts = [f"{m}={_fmt_num(getattr(self, f'{m}_ms'))}ms" for m in _SLO_METRICS
                 if getattr(self, f"{m}_ms") is not None]
        return ",".join(parts)

    def is_met(self, record: RequestRecord) -> bool:
        """vLLM's goodput test for one request. Failed requests never meet an SLO."""
        if not record.success or record.ttft is None:
            return False
        values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
        for m in _SLO_METRICS:
            bound = getattr(self, f"{m}_ms")
            if bound is not None and values[m] * 1000.0 > bound:
                return False
        return True


def _fmt_num(x: float | None) -> str:
    return "" if x is None else f"{x:g}"


def parse_slo(text: str) -> Slo:
    """Parse `ttft=1000ms,tpot=50ms,e2el=5s` (also vLLM's `ttft:1000 tpot:50`; a bare number is ms)."""
    items = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not items:
        raise LlmoptError("empty SLO: use e.g. ttft=1000ms,tpot=50ms,e2el=5s")
    bounds: dict[str, float] = {}
    for item in items:
        m = _SLO_ITEM_RE.match(item)
        if not m:
            raise LlmoptError(f"cannot parse SLO item {item!r}: use METRIC=VALUE with a unit of ms, s or us, e.g. ttft=1000ms")
        name, value, unit = m.group(1).lower(), float(m.group(2)), m.group(3).lower()
        if name not in _SLO_METRICS:
            raise LlmoptError(f"unknown SLO metric {name!r} in {text!r}: choose from {', '.join(_SLO_METRICS)}")
        if unit not in _UNIT_TO_MS:
            raise LlmoptError(f"unknown time unit {unit!r} in SLO item {item!r}: use ms, s or us")
        if f"{name}_ms" in bounds:
            raise LlmoptError(f"SLO metric {name!r} given twice in {text!r}")
        ms = value * _UNIT_TO_MS[unit]
        if not ms > 0 or not math.isfinite(ms):
            raise LlmoptError(f"SLO bound for {name} must be a positive time, got {item!r}")
        bounds[f"{name}_ms"] = ms
    return Slo(**bounds)


class LatencyStats(BaseModel):
    """Summary of one latency distribution in milliseconds; all None when there were no samples."""

    count: int = 0
    mean: float | None = None
    std: float | None = None
    min: float | None = None
    max: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def from_seconds(cls, values: Sequence[float]) -> LatencyStats:
        if len(values) == 0:
            return cls()
        a = np.asarray(values, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(
            count=int(a.size),
            mean=float(a.mean()),
            std=float(a.std()),
            min=float(a.min()),
            max=float(a.max()),
            p50=float(p50),
            p90=float(p90),
            p99=float(p99),
        )


class RunSamples(BaseModel):
    """Per-request latencies in ms of successful requests, kept for plots and re-analysis.

    TPOT has entries only for requests with more than one output token, so lists may differ in length.
    """

    ttft_ms: list[float] = Field(default_factory=list)
    tpot_ms: list[float] = Field(default_factory=list)
    e2el_ms: list[float] = Field(default_factory=list)


class RunMetrics(BaseModel):
    """Everything measured in one run at one load level."""

    completed: int
    failed: int
    interrupted: int = 0
    total_input_tokens: int
    total_output_tokens: int
    duration_s: float
    request_throughput: float = Field(description="Completed requests per second.")
    output_throughput: float = Field(description="Output tokens per second.")
    total_throughput: float = Field(description="Prompt plus output tokens per second.")
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2el_ms: LatencyStats
    slo: Slo | None = None
    goodput: float | None = Field(None, description="Requests per second meeting every SLO bound.")
    slo_attainment: float | None = Field(
        None, description="Fraction of finished (completed + failed) requests meeting the SLO."
    )
    failures: dict[str, int] = Field(default_factory=dict, description="Failed requests by error code.")
    peak_output_throughput: float = Field(0.0, description="Most output tokens seen in any 1 s window.")
    peak_concurrency: int = Field(0, description="Most requests in flight at once (successful ones).")
    samples: RunSamples | None = None


def apply_slo(records: Sequence[RequestRecord], slo: Slo | None) -> None:
    """Set `slo_met` on every record (None when there is no SLO); interrupted requests stay None."""
    for r in records:
        r.slo_met = None if slo is None or r.interrupted else slo.is_met(r)


def _peak_output_throughput(ok: Sequence[RequestRecord]) -> float:
    """Max tokens landing in one 1-second bucket counted from the first send (as vLLM)."""
    if not ok:
        return 0.0
    t0 = min(r.start for r in ok)
    buckets: Counter[int] = Counter()
    for r in ok:
        for t, n in zip(r.token_times, r.chunk_token_counts, strict=True):
            buckets[int(t - t0)] += n
    return float(max(buckets.values(), default=0))


def _peak_concurrency(ok: Sequence[RequestRecord]) -> int:
    """Sweep over half-open [start, end) intervals; a departure at the same instant precedes an arrival."""
    events = sorted([(r.start, 1) for r in ok] + [(r.end, -1) for r in ok])
    cur = peak = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: Slo | None = None,
    *,
    keep_samples: bool = True,
) -> RunMetrics:
    """Aggregate one run. `duration_s` is the wall time from the first send to the last completion."""
    if duration_s < 0 or not math.isfinite(duration_s):
        raise ValueError(f"duration must be a finite non-negative number of seconds, got {duration_s}")
    apply_slo(records, slo)
    ok = [r for r in records if r.success and not r.interrupted]
    failed = [r for r in records if not r.success and not r.interrupted]
    interrupted = sum(1 for r in records if r.interrupted)

    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    itls = [g for r in ok for g in r.itls]
    e2els = [r.e2el for r in ok]

    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)

    def per_s(x: float) -> float:
        return x / duration_s if duration_s > 0 else 0.0

    goodput = attainment = None
    if slo is not None:
        good = sum(1 for r in ok if r.slo_met)
        goodput = per_s(good)
        finished = len(ok) + len(failed)
        attainment = good / finished if finished else 0.0

    samples = None
    if keep_samples:
        samples = RunSamples(
            ttft_ms=[t * 1000.0 for t in ttfts],
            tpot_ms=[t * 1000.0 for t in tpots],
            e2el_ms=[t * 1000.0 for t in e2els],
        )
    return RunMetrics(
        completed=len(ok),
        failed=len(failed),
        interrupted=interrupted,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        duration_s=duration_s,
        request_throughput=per_s(len(ok)),
        output_throughput=per_s(total_out),
        total_throughput=per_s(total_in + total_out),
        ttft_ms=LatencyStats.from_seconds(ttfts),
        tpot_ms=LatencyStats.from_seconds(tpots),
        itl_ms=LatencyStats.from_seconds(itls),
        e2el_ms=LatencyStats.from_seconds(e2els),
        slo=slo,
        goodput=goodput,
        slo_attainment=attainment,
        failures=dict(Counter(r.error_code or "unknown" for r in failed)),
        peak_output_throughput=_peak_output_throughput(ok),
        peak_concurrency=_peak_concurrency(ok),
        samples=samples,
    )
