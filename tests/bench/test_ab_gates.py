"""`METRIC OP NUMBER@CONFIDENCE`: parsing, refusals, and which bound of the interval each operator reads."""

from __future__ import annotations

import pytest

from llmopt.bench.ab_gates import check_bench_gates, parse_bench_gate, parse_bench_gates
from llmopt.bench.ab_stats import RatioEstimate
from llmopt.errors import LlmoptError


def test_parse_plain_and_confidence_forms():
    g = parse_bench_gate("output_throughput_ratio >= 0.95 @ 95")
    assert (g.gate.metric, g.gate.op, g.gate.threshold, g.confidence) == ("output_throughput_ratio", ">=", 0.95, 0.95)
    assert g.expression == "output_throughput_ratio>=0.95@95"
    assert parse_bench_gate("ttft_p99_ms_ratio<=1.1@90%").confidence == pytest.approx(0.9)
    assert parse_bench_gate("output_throughput>=1").confidence is None
    assert [x.gate.metric for x in parse_bench_gates(["a_ratio>=1@95; b<=2"])] == ["a_ratio", "b"]


@pytest.mark.parametrize("text, needle", [
    ("output_throughput_ratio>=0.95@100", "between 50 and 100"),
    ("output_throughput_ratio>=0.95@40", "between 50 and 100"),
    ("output_throughput_ratio==1@95", "needs >=, >, <= or <"),
    ("output_throughput_ratio>=@95", "cannot parse gate"),
])
def test_bad_confidence_gates(text, needle):
    with pytest.raises(LlmoptError, match=needle):
        parse_bench_gate(text)


def test_bounds_by_operator():
    est = RatioEstimate(ratio=0.97, low=0.93, high=1.01, confidence=0.95, rounds=6)
    gates = parse_bench_gates(["x_ratio>=0.95@95", "x_ratio>=0.9@95", "x_ratio<=1.0@95", "x_ratio<=1.05@95",
                               "x_ratio>=0.95"])
    results = check_bench_gates(gates, lambda m: est.ratio, lambda m, conf: est)
    # the point 0.97 clears 0.95, but the interval's lower bound 0.93 does not: not shown with 95%
    assert [r.passed for r in results] == [False, True, False, True, True]
    assert [r.value for r in results] == [0.93, 0.93, 1.01, 1.01, 0.97]
    assert "95% interval [0.93, 1.01], lower bound 0.93" in results[0].describe()
    none = check_bench_gates(gates[:1], lambda m: None, lambda m, conf: RatioEstimate(ratio=1.0, rounds=1))
    assert not none[0].passed and "no interval" in none[0].describe()
