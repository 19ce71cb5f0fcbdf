"""vLLM's metric definitions on hand-built timestamps; every expected number is worked out by hand."""

from __future__ import annotations

import pytest

from llmopt.bench.metrics import LatencyStats, Slo, compute_metrics, parse_slo
from llmopt.bench.records import ERROR_INTERRUPTED, RecordTimer, RequestRecord
from llmopt.errors import LlmoptError


def _records() -> list[RequestRecord]:
    return [
        # ttft 100 ms; chunks carry 1,1,2,1 tokens -> 5 tokens; e2el 300; tpot (300-100)/4 = 50; itl 50,100,50
        RequestRecord.from_chunks(start=0.0, token_times=[0.1, 0.15, 0.25, 0.30],
                                  chunk_token_counts=[1, 1, 2, 1], prompt_tokens=10),
        # ttft 200; 2 tokens; e2el 400; tpot (400-200)/1 = 200; itl 200
        RequestRecord.from_chunks(start=1.0, token_times=[1.2, 1.4], prompt_tokens=20),
        # ttft 500; one token: no TPOT, no ITL; e2el 500
        RequestRecord.from_chunks(start=2.0, token_times=[2.5], prompt_tokens=30),
        RequestRecord.failure(start=3.0, end=3.1, error_code="http_500", error="HTTP 500", prompt_tokens=40),
        RequestRecord.failure(start=3.0, end=3.5, error_code="timeout", error="timed out"),
    ]


def test_request_level_definitions():
    r = _records()[0]
    assert r.ttft == pytest.approx(0.1)
    assert r.e2el == pytest.approx(0.3)
    assert r.output_tokens == 5
    assert r.tpot == pytest.approx(0.05)  # excludes the first token, divides by tokens not chunks
    assert r.itls == pytest.approx([0.05, 0.10, 0.05])  # per chunk gap
    assert _records()[2].tpot is None


def test_run_metrics_match_hand_computation():
    m = compute_metrics(_records(), duration_s=4.0)
    assert (m.completed, m.failed, m.interrupted) == (3, 2, 0)
    assert m.failures == {"http_500": 1, "timeout": 1}
    assert m.total_input_tokens == 60  # failed requests' prompts do not count (vLLM)
    assert m.total_output_tokens == 8
    assert m.request_throughput == pytest.approx(3 / 4)
    assert m.output_throughput == pytest.approx(8 / 4)
    assert m.total_throughput == pytest.approx(68 / 4)

    # TTFT samples 100, 200, 500 ms
    t = m.ttft_ms
    assert t.count == 3
    assert t.mean == pytest.approx(800 / 3)
    assert t.p50 == pytest.approx(200)
    assert t.p90 == pytest.approx(440)  # rank 0.9*2 = 1.8 -> 200 + 0.8*300
    assert t.p99 == pytest.approx(494)  # rank 1.98 -> 200 + 0.98*300
    assert t.std == pytest.approx((86666.6667 / 3) ** 0.5)  # population std
    assert (t.min, t.max) == (pytest.approx(100), pytest.approx(500))

    # TPOT only for requests with > 1 output token: 50, 200
    assert m.tpot_ms.count == 2
    assert m.tpot_ms.mean == pytest.approx(125)
    assert m.tpot_ms.p99 == pytest.approx(50 + 0.99 * 150)

    # ITL pooled chunk gaps: 50, 100, 50, 200
    assert m.itl_ms.count == 4
    assert m.itl_ms.mean == pytest.approx(100)
    assert m.itl_ms.p50 == pytest.approx(75)
    assert m.itl_ms.p90 == pytest.approx(170)  # sorted 50,50,100,200; rank 2.7

    assert m.e2el_ms.mean == pytest.approx(400)
    assert m.e2el_ms.p50 == pytest.approx(400)

    assert m.peak_output_throughput == 5  # all 5 tokens of request 0 land in second 0
    assert m.peak_concurrency == 1
    assert m.goodput is None and m.slo_attainment is None
    assert m.samples is not None and m.samples.ttft_ms == pytest.approx([100, 200, 500])


def test_goodput_requires_every_bound():
    # r0: ttft 100, tpot 50 -> good; r1: tpot 200 -> bad; r2: ttft 500 -> bad; failures never good
    m = compute_metrics(_records(), 4.0, parse_slo("ttft=300ms,tpot=100ms"))
    assert m.goodput == pytest.approx(1 / 4)
    assert m.slo_attainment == pytest.approx(1 / 5)


def test_goodput_single_token_request_counts_as_tpot_zero():
    recs = _records()
    m = compute_metrics(recs, 4.0, parse_slo("tpot=10ms"))
    assert m.goodput == pytest.approx(1 / 4)  # only the one-token request passes (vLLM semantics)
    assert [r.slo_met for r in recs] == [False, False, True, False, False]
    m = compute_metrics(_records(), 4.0, parse_slo("e2el=0.45s"))
    assert m.goodput == pytest.approx(2 / 4)


def test_interrupted_requests_are_not_failures():
    recs = _records()[:1] + [RequestRecord.failure(start=0, end=1, error_code=ERROR_INTERRUPTED,
                                                   error="stopped", interrupted=True)]
    m = compute_metrics(recs, 1.0, parse_slo("ttft=1s"))
    assert (m.completed, m.failed, m.interrupted) == (1, 0, 1)
    assert m.failures == {}
    assert recs[1].slo_met is None


def test_peak_concurrency_overlaps():
    recs = [RequestRecord.from_chunks(start=s, token_times=[e]) for s, e in [(0, 2), (1, 3), (1.5, 2.5), (2, 4)]]
    assert compute_metrics(recs, 4.0).peak_concurrency == 3  # at 1.5..2: three; at 2 one leaves, one joins


def test_empty_run():
    m = compute_metrics([], 0.0)
    assert m.completed == 0 and m.request_throughput == 0.0
    assert m.ttft_ms == LatencyStats()
    assert m.ttft_ms.p99 is None


@pytest.mark.parametrize("text,expected", [
    ("ttft=1000ms,tpot=50ms,e2el=5s", Slo(ttft_ms=1000, tpot_ms=50, e2el_ms=5000)),
    ("ttft:1000 tpot:50", Slo(ttft_ms=1000, tpot_ms=50)),
    ("TTFT=0.5s", Slo(ttft_ms=500)),
    ("tpot=500us", Slo(tpot_ms=0.5)),
])
def test_parse_slo(text, expected):
    assert parse_slo(text) == expected
    assert parse_slo(expected.describe()) == expected


@pytest.mark.parametrize("text,needle", [
    ("", "empty SLO"),
    ("ttft", "cannot parse SLO item"),
    ("ttft=abc", "cannot parse SLO item"),
    ("foo=1ms", "unknown SLO metric 'foo'"),
    ("ttft=1h", "unknown time unit 'h'"),
    ("ttft=0ms", "must be a positive time"),
    ("ttft=1ms,ttft=2ms", "given twice"),
])
def test_parse_slo_errors(text, needle):
    with pytest.raises(LlmoptError, match=needle):
        parse_slo(text)


def test_record_timer_with_a_fake_clock():
    ticks = iter([10.0, 10.2, 10.25, 10.4, 11.0])
    t = RecordTimer(prompt_tokens=9, clock=lambda: next(ticks))
    t.chunk()
    t.chunk(0)  # nothing new: ignored, no clock read
    t.chunk(2)
    t.chunk()
    rec = t.success()
    assert rec.ttft == pytest.approx(0.2) and rec.e2el == pytest.approx(0.4)
    assert rec.output_tokens == 4 and rec.chunk_token_counts == [1, 2, 1] and rec.prompt_tokens == 9
    assert rec.tpot == pytest.approx(0.2 / 3)
    empty = RecordTimer(clock=lambda: 1.0).success()
    assert not empty.success and empty.error_code == "no_tokens"
