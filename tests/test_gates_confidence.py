"""The confidence form of gates (`acc_drop<=2@95`): parsing, refusals, and the verdict on an interval."""

from __future__ import annotations

import pytest

from llmopt.errors import LlmoptError
from llmopt.gates import check_interval_gate, parse_confidence_gate, parse_confidence_gates, parse_gate


def test_parse_forms():
    cg = parse_confidence_gate("acc_drop <= 2 @ 95")
    assert (cg.gate.metric, cg.gate.op, cg.gate.threshold, cg.confidence) == ("acc_drop", "<=", 2.0, 0.95)
    assert cg.expression == "acc_drop<=2@95" and cg.bound == "high"
    assert parse_confidence_gate("top1_agreement>=0.9@90%").confidence == pytest.approx(0.9)
    assert parse_confidence_gate("top1_agreement>=0.9@90").bound == "low"
    plain = parse_confidence_gate("kl_div<=0.05")
    assert plain.confidence is None and plain.expression == "kl_div<=0.05"
    assert [g.expression for g in parse_confidence_gates(["a_drop<=1@95; kl_div<0.1"])] == ["a_drop<=1@95",
                                                                                          "kl_div<0.1"]


@pytest.mark.parametrize("text, message", [
    ("acc_drop<=2@50", "between 50 and 100"),
    ("acc_drop<=2@100", "between 50 and 100"),
    ("acc_drop<=2@0.95", "between 50 and 100"),
    ("acc_drop==2@95", "needs >=, >, <= or <"),
    ("acc_drop<=@95", "cannot parse gate"),
    ("acc_drop<=2@", "cannot parse gate"),
    ("acc_drop<=2@@95", "cannot parse gate"),
])
def test_bad_confidence_gates_are_one_line(text, message):
    with pytest.raises(LlmoptError, match=message) as e:
        parse_confidence_gate(text)
    assert "\n" not in str(e.value)


def test_plain_parser_refuses_the_confidence_form():
    """Commands without intervals keep the plain parser: `@95` there is an error, not a silent point check."""
    with pytest.raises(LlmoptError, match="cannot parse gate"):
        parse_gate("output_throughput>=1@95")


def test_verdicts():
    upper = parse_confidence_gate("acc_drop<=2@95")
    assert check_interval_gate(upper, 0.5, -1.0, 1.9).verdict == "pass"
    undecided = check_interval_gate(upper, 0.5, -1.0, 3.0)
    assert (undecided.verdict, undecided.passed, undecided.value) == ("not shown", False, 3.0)
    assert undecided.describe().startswith("NOT SHOWN acc_drop<=2@95 (point 0.5, 95% interval [-1, 3])")
    assert check_interval_gate(upper, 4.0, 2.5, 6.0).verdict == "fail"  # wholly past the margin: shown
    lower = parse_confidence_gate("top1_agreement>=0.9@95")
    assert check_interval_gate(lower, 0.95, 0.91, 0.97).passed
    assert check_interval_gate(lower, 0.95, 0.85, 0.97).verdict == "not shown"
    unmeasured = check_interval_gate(lower, None, None, None)
    assert (unmeasured.verdict, unmeasured.passed) == ("fail", False)
    assert "not measured" in unmeasured.describe()
