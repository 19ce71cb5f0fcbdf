"""The shared gate-expression parser (`llmopt.gates`) and what bench gate names mean (`gate_metrics`)."""

from __future__ import annotations

import math

import pytest

from llmopt.bench.gate_metrics import check_report_gates, gated_run, known_metrics, validate_gates
from llmopt.bench.knee import Knee
from llmopt.bench.load import LoadPattern, LoadResult
from llmopt.bench.records import RequestRecord
from llmopt.bench.report import BenchReport, BenchRun, TargetInfo
from llmopt.bench.workloads import RandomWorkload
from llmopt.errors import LlmoptError
from llmopt.gates import Gate, check_gates, failure_message, parse_gate, parse_gates


@pytest.mark.parametrize(("text", "metric", "op", "threshold"), [
    ("output_throughput>=150", "output_throughput", ">=", 150.0),
    ("ttft_p99_ms <= 1000", "ttft_p99_ms", "<=", 1000.0),
    ("ppl_increase_pct<5%", "ppl_increase_pct", "<", 5.0),
    ("  failed == 0 ", "failed", "==", 0.0),
    ("delta>-0.5", "delta", ">", -0.5),
    ("x!=1e-3", "x", "!=", 0.001),
    ("acc.mean>.5", "acc.mean", ">", 0.5),
])
def test_parse_gate(text, metric, op, threshold):
    g = parse_gate(text)
    assert (g.metric, g.op, g.threshold) == (metric, op, threshold)
    assert parse_gate(g.expression) == g  # the canonical form parses back


@pytest.mark.parametrize("bad", ["", "throughput", ">=5", "x=>5", "x>=", "x>=abc", "x >= 5 6", "1x>=2",
                                 "x>=inf", "x>=nan"])
def test_bad_gate_is_one_line_error(bad):
    with pytest.raises(LlmoptError) as e:
        parse_gate(bad)
    assert "\n" not in str(e.value) and "cannot parse gate" in str(e.value)


def test_check_semantics():
    assert Gate(metric="m", op=">=", threshold=150).check(150)
    assert not Gate(metric="m", op=">", threshold=150).check(150)
    assert Gate(metric="m", op="<=", threshold=1000).check(999.9)
    assert not Gate(metric="m", op="<=", threshold=1000).check(None)  # unmeasured never passes
    assert not Gate(metric="m", op="!=", threshold=0).check(math.nan)


def test_several_gates_and_failure_message():
    gates = parse_gates(["a>=1;b<=2", "c==3"])
    assert [g.metric for g in gates] == ["a", "b", "c"]
    results = check_gates(gates, {"a": 5.0, "b": 3.0}.get)
    assert [r.passed for r in results] == [True, False, False]
    assert results[0].describe() == "PASS a>=1 (measured 5)"
    assert results[2].describe() == "FAIL c==3 (not measured)"
    assert failure_message(results) == "2 gate(s) failed: b<=2 (measured 3); c==3 (not measured)"
    assert failure_message(results[:1]) is None


# ------------------------------------------------------------------------------------- bench metrics


def _run(concurrency: int, per_s: float, ttft: float) -> BenchRun:
    recs = [RequestRecord.from_chunks(start=i / per_s, token_times=[i / per_s + ttft + k * 0.01 for k in range(4)],
                                      prompt_tokens=10) for i in range(8)]
    return BenchRun.from_load(LoadResult(pattern=LoadPattern(concurrency=concurrency), records=recs,
                                         duration_s=8 / per_s))


def _report(runs: list[BenchRun], sweep: bool) -> BenchReport:
    rep = BenchReport(target=TargetInfo(kind="offline"), workload=RandomWorkload(num_requests=8),
                      sweep="concurrency" if sweep else None, runs=runs)
    return rep.with_knee()


def test_gate_names_are_validated_before_running():
    validate_gates(parse_gates(["output_throughput>=1", "ttft_p99_ms<=5", "prefix_cache_hit_rate>=0.5"]))
    with pytest.raises(LlmoptError, match="unknown gate metric 'throughput'"):
        validate_gates([parse_gate("throughput>=1")])
    with pytest.raises(LlmoptError, match="ratios need --scenario"):
        validate_gates([parse_gate("output_throughput_ratio>=1")])
    validate_gates([parse_gate("output_throughput_ratio>=1")], scenario=True)
    assert "e2el_p90_ms" in known_metrics() and "goodput_ratio" in known_metrics(scenario=True)


def test_gates_read_the_knee_run_of_a_sweep():
    runs = [_run(1, 1.0, 0.05), _run(2, 2.0, 0.06), _run(4, 3.9, 0.08), _run(8, 4.0, 0.5)]
    rep = _report(runs, sweep=True)
    assert isinstance(rep.knee, Knee) and rep.knee.index is not None
    assert gated_run(rep) is rep.runs[rep.knee.index]
    res = check_report_gates(rep, parse_gates(["request_throughput>=3", "ttft_p99_ms<=100", "failed<=0"]))
    assert all(r.passed for r in res), [r.describe() for r in res]
    single = _report(runs[:1], sweep=False)
    assert gated_run(single) is single.runs[0]
    res = check_report_gates(single, [parse_gate("request_throughput>=3")])
    assert not res[0].passed and res[0].value == pytest.approx(1.0)
