"""Gate expressions: `METRIC OP THRESHOLD` checks that turn a measurement into a CI pass/fail.

`bench`, `eval` and recipes all need the same thing: the user names a metric, a comparison and a number
(`output_throughput>=150`, `ttft_p99_ms<=1000`, `ppl_increase_pct<=5`), and the command exits 1 when a
measured value fails it. One parser keeps the syntax and the error messages identical everywhere; what a
metric name *means* is up to each command, which passes a lookup function to `check_gates`.

A gate whose metric was not measured (the lookup returns None, or NaN) fails: a CI gate that silently
passes because nothing was measured is worse than no gate.

Where a command measures an interval (`bench --ab` ratios over rounds, `eval` comparisons over items and
windows), a gate may carry a confidence: `acc_drop<=1@95`. It then reads the NN% interval instead of the
point estimate, on the side a regression would show: `<=`/`<` pass only when the *upper* bound meets the
threshold, `>=`/`>` only when the *lower* bound does. That is a non-inferiority test with the threshold
as its margin: the gate passes only when the data rule the failure out, and a run too small or too noisy
to tell does not pass ("not shown"), which is what a CI gate should do. `==`/`!=` have no such reading
and refuse `@`.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

from pydantic import BaseModel, Field

from llmopt.errors import LlmoptError

GateOp = Literal[">=", "<=", ">", "<", "==", "!="]

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "==": operator.eq,
    "!=": operator.ne,
}
# longest operators first so that `>=` is not read as `>` followed by `=5`
_CONF_RE = re.compile(r"^(.*?)@\s*([0-9]*\.?[0-9]+)\s*%?\s*$")
_GATE_RE = re.compile(
    r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*(>=|<=|==|!=|>|<)\s*"
    r"([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)\s*(%?)\s*$"
)


class Gate(BaseModel):
    """One check: `metric op threshold`, e.g. Gate(metric="ttft_p99_ms", op="<=", threshold=1000)."""

    metric: str
    op: GateOp
    threshold: float

    @property
    def expression(self) -> str:
        """The canonical text form, accepted back by `parse_gate`."""
        return f"{self.metric}{self.op}{self.threshold:g}"

    def check(self, value: float | None) -> bool:
        """True when `value` satisfies the gate; an unmeasured (None or NaN) value never does."""
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return False
        return _OPS[self.op](float(value), self.threshold)


class GateResult(BaseModel):
    """A gate and what was measured for it."""

    gate: Gate
    value: float | None = Field(description="The measured value; None when the metric was not measured.")
    passed: bool

    def describe(self) -> str:
        """`PASS ttft_p99_ms<=1000 (measured 812.4)` or `FAIL ... (not measured)`."""
        measured = "not measured" if self.value is None else f"measured {self.value:.4g}"
        return f"{'PASS' if self.passed else 'FAIL'} {self.gate.expression} ({measured})"


def parse_gate(text: str) -> Gate:
    """Parse `metric>=150`, `ttft_p99_ms <= 1000`, `ppl_increase_pct<5%` (a trailing % is decoration).

    Raises a one-line LlmoptError naming the expression when it cannot be parsed.
    """
    m = _GATE_RE.match(text or "")
    if not m:
        raise LlmoptError(
            f"cannot parse gate {text!r}: use METRIC OP NUMBER with OP one of >=, <=, >, <, ==, != "
            "(e.g. output_throughput>=150 or ttft_p99_ms<=1000)")
    threshold = float(m.group(3))
    if not math.isfinite(threshold):
        raise LlmoptError(f"gate {text!r} needs a finite threshold")
    return Gate(metric=m.group(1), op=m.group(2), threshold=threshold)  # type: ignore[arg-type]


def parse_gates(texts: Iterable[str]) -> list[Gate]:
    """Parse several gates; each item may itself hold several separated by `;`."""
    out: list[Gate] = []
    for text in texts:
        out += [parse_gate(part) for part in text.split(";") if part.strip()]
    return out


def check_gates(gates: Sequence[Gate], lookup: Callable[[str], float | None]) -> list[GateResult]:
    """Evaluate every gate with `lookup(metric) -> value` (None: not measured)."""
    results = []
    for g in gates:
        value = lookup(g.metric)
        results.append(GateResult(gate=g, value=None if value is None else float(value), passed=g.check(value)))
    return results


def failure_message(results: Sequence[GateResult]) -> str | None:
    """One line naming every failed gate, or None when all passed."""
    failed = [r for r in results if not r.passed]
    if not failed:
        return None
    return f"{len(failed)} gate(s) failed: " + "; ".join(r.describe().removeprefix("FAIL ") for r in failed)


# ------------------------------------------------------------------------- gates with a confidence


class ConfidenceGate(BaseModel):
    """A gate, and the confidence (0..1) its interval form asks for; None: the point estimate."""

    gate: Gate
    confidence: float | None = None

    @property
    def expression(self) -> str:
        conf = "" if self.confidence is None else f"@{100 * self.confidence:g}"
        return self.gate.expression + conf

    @property
    def bound(self) -> Literal["low", "high"]:
        """The side of the interval a failure would show on: the lower bound for >=/>, the upper for <=/<."""
        return "low" if self.gate.op in (">=", ">") else "high"


def parse_confidence_gate(text: str) -> ConfidenceGate:
    """`METRIC OP NUMBER` or `METRIC OP NUMBER@CONFIDENCE` (percent, 50 < CONFIDENCE < 100)."""
    m = _CONF_RE.match(text or "")
    if m is None:
        return ConfidenceGate(gate=parse_gate(text))
    gate = parse_gate(m.group(1))
    conf = float(m.group(2))
    if not 50 < conf < 100:
        raise LlmoptError(f"gate {text!r}: the confidence after @ is a percentage between 50 and 100, e.g. @95")
    if gate.op in ("==", "!="):
        raise LlmoptError(f"gate {text!r}: a confidence (@) needs >=, >, <= or <")
    return ConfidenceGate(gate=gate, confidence=conf / 100)


def parse_confidence_gates(texts: Iterable[str]) -> list[ConfidenceGate]:
    """Several gates; each item may hold several separated by `;`."""
    return [parse_confidence_gate(part) for text in texts for part in text.split(";") if part.strip()]


Verdict = Literal["pass", "not shown", "fail"]


class IntervalGateResult(GateResult):
    """A gate checked on one bound of an interval; `value` is that bound. The verdict says whether the
    interval meets the threshold (pass), lies wholly past it (fail: the failure is shown), or straddles it
    (not shown: too few items to tell, which does not pass). `note` says what would decide it."""

    expression: str
    confidence: float
    point: float | None = None
    low: float | None = None
    high: float | None = None
    verdict: Verdict = "not shown"
    note: str | None = None

    def describe(self) -> str:
        if self.point is None:
            what = "not measured"
        elif self.low is None or self.high is None:
            what = f"point {self.point:.4g}, no interval"
        else:
            what = (f"point {self.point:.4g}, {100 * self.confidence:g}% interval [{self.low:.4g}, {self.high:.4g}]")
        label = {"pass": "PASS", "fail": "FAIL", "not shown": "NOT SHOWN"}[self.verdict]
        return f"{label} {self.expression} ({what})" + (f"; {self.note}" if self.note else "")


def check_interval_gate(cg: ConfidenceGate, point: float | None, low: float | None,
                        high: float | None) -> IntervalGateResult:
    """Check a confidence gate on its interval [low, high] around `point` (None: not measured)."""
    assert cg.confidence is not None
    g = cg.gate
    bound = low if cg.bound == "low" else high
    far = high if cg.bound == "low" else low
    passed = g.check(bound)
    shown = point is None or (far is not None and not g.check(far))  # unmeasured, or wholly past the threshold
    verdict: Verdict = "pass" if passed else ("fail" if shown else "not shown")
    return IntervalGateResult(gate=g, value=bound, passed=passed, expression=cg.expression,
                              confidence=cg.confidence, point=point, low=low, high=high, verdict=verdict)
