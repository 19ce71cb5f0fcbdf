"""Gates on A/B ratios, with an optional confidence: `output_throughput_ratio>=0.95@95`.

The plain form checks the point estimate (mean of B's rounds / mean of A's). The `@NN` form checks the
NN% bootstrap interval instead, on the side a regression would show: `>=`/`>` pass only when the
interval's *lower* bound clears the threshold, `<=`/`<` only when its *upper* bound does. So a gate
passes with confidence only when the data rule out the failure, and a run too noisy to tell fails
("not shown"), which is what a CI gate on a shared machine should do. `==`/`!=` have no such reading
and are refused with `@`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

from pydantic import BaseModel

from llmopt.bench.ab_stats import RatioEstimate
from llmopt.errors import LlmoptError
from llmopt.gates import Gate, GateResult, parse_gate

_CONF_RE = re.compile(r"^(.*?)@\s*([0-9]*\.?[0-9]+)\s*%?\s*$")


class BenchGate(BaseModel):
    """A gate, and the confidence (0..1) its interval form asks for; None: the point estimate."""

    gate: Gate
    confidence: float | None = None

    @property
    def expression(self) -> str:
        conf = "" if self.confidence is None else f"@{100 * self.confidence:g}"
        return self.gate.expression + conf


def parse_bench_gate(text: str) -> BenchGate:
    """`METRIC OP NUMBER` or `METRIC OP NUMBER@CONFIDENCE` (percent, 50 < CONFIDENCE < 100)."""
    m = _CONF_RE.match(text or "")
    if m is None:
        return BenchGate(gate=parse_gate(text))
    gate = parse_gate(m.group(1))
    conf = float(m.group(2))
    if not 50 < conf < 100:
        raise LlmoptError(f"gate {text!r}: the confidence after @ is a percentage between 50 and 100, e.g. @95")
    if gate.op in ("==", "!="):
        raise LlmoptError(f"gate {text!r}: a confidence (@) needs >=, >, <= or <")
    return BenchGate(gate=gate, confidence=conf / 100)


def parse_bench_gates(texts: Iterable[str]) -> list[BenchGate]:
    """Several gates; each item may hold several separated by `;`."""
    return [parse_bench_gate(part) for text in texts for part in text.split(";") if part.strip()]


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
