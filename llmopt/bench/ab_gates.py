"""Gates on A/B ratios, with an optional confidence: `output_throughput_ratio>=0.95@95`.

The plain form checks the point estimate (mean of B's rounds / mean of A's). The `@NN` form checks the
NN% bootstrap interval instead, on the side a regression would show: `>=`/`>` pass only when the
interval's *lower* bound clears the threshold, `<=`/`<` only when its *upper* bound does. So a gate
passes with confidence only when the data rule out the failure, and a run too noisy to tell fails
("not shown"), which is what a CI gate on a shared machine should do. `==`/`!=` have no such reading
and are refused with `@`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llmopt.bench.ab_stats import RatioEstimate
from llmopt.gates import ConfidenceGate, GateResult
from llmopt.gates import parse_confidence_gate as parse_bench_gate
from llmopt.gates import parse_confidence_gates as parse_bench_gates

# the parser and the gate type are shared with `eval` (llmopt.gates); bench keeps its names
BenchGate = ConfidenceGate
__all__ = ["BenchGate", "IntervalGateResult", "check_bench_gates", "parse_bench_gate", "parse_bench_gates"]


class IntervalGateResult(GateResult):
    """A gate checked on one bound of a bootstrap interval."""

    expression: str
    estimate: RatioEstimate

    def describe(self) -> str:
        e = self.estimate
        if self.value is None:
            what = "not measured" if e.ratio is None else f"point x{e.ratio:.4g}, no interval (too few rounds)"
        else:
            bound = "lower" if self.gate.op in (">=", ">") else "upper"
            what = (f"{100 * e.confidence:g}% interval [{e.low:.4g}, {e.high:.4g}], {bound} bound "
                    f"{self.value:.4g}, point {e.ratio:.4g}")
        return f"{'PASS' if self.passed else 'FAIL'} {self.expression} ({what})"


def check_bench_gates(gates: Sequence[BenchGate], value: Callable[[str], float | None],
                      interval: Callable[[str, float], RatioEstimate]) -> list[GateResult]:
    """Plain gates read `value(metric)`; interval gates read `interval(metric, confidence)`'s bound."""
    out: list[GateResult] = []
    for bg in gates:
        g = bg.gate
        if bg.confidence is None:
            v = value(g.metric)
            out.append(GateResult(gate=g, value=v, passed=g.check(v)))
            continue
        est = interval(g.metric, bg.confidence)
        bound = est.low if g.op in (">=", ">") else est.high
        out.append(IntervalGateResult(gate=g, value=bound, passed=g.check(bound), expression=bg.expression,
                                      estimate=est))
    return out
