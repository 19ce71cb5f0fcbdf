"""The page builder itself: escaping, the gate table, figures, the atomic write and its errors."""

from __future__ import annotations

import pytest
from html_check import assert_figures, assert_self_contained, read_page

from llmopt.errors import LlmoptError
from llmopt.gates import ConfidenceGate, Gate, GateResult, check_interval_gate, parse_confidence_gate
from llmopt.report.figures import cdf_svg, curve_svg, intervals_svg, stacked_bar_svg
from llmopt.report.html import (
    Section,
    check_html_path,
    figure,
    gate_rows,
    gate_table,
    render_page,
    table,
    write_html,
)


def _gates():
    plain = GateResult(gate=Gate(metric="ttft_p99_ms", op="<=", threshold=1000), value=812.4, passed=True)
    unmeasured = GateResult(gate=Gate(metric="goodput", op=">=", threshold=1), value=None, passed=False)
    shown = check_interval_gate(parse_confidence_gate("acc_drop<=5@95"), 1.5, -0.4, 3.4)
    undecided = check_interval_gate(parse_confidence_gate("acc_drop<=3@95"), 1.5, -0.4, 3.4)
    undecided.note = "about 301 items would decide it"
    failed = check_interval_gate(ConfidenceGate(gate=Gate(metric="output_throughput_ratio", op=">=", threshold=0.95),
                                                confidence=0.95), 0.3, 0.28, 0.32)
    return [plain, unmeasured, shown, undecided, failed]


def test_page_with_every_part(tmp_path):
    s1 = Section("gates", "Gates").add(gate_table(gate_rows(_gates())))
    s2 = Section("figs", "Figures <&>")
    s2.add(figure(cdf_svg("cdf", [("a", [1.0, 2.0, 3.0]), ("b & c", [2.0, 5.0])], "ms", "TTFT"), "cdf", "fig-cdf"))
    s2.add(figure(curve_svg("curve", [("c1", 10.0, 5.0), ("c2", 20.0, 8.0)], (20.0, 8.0), "ms"), "curve", "fig-curve"))
    s2.add(figure(stacked_bar_svg("bar", [("weights", 1.0), ("kv", 2.0)], 5.0, "GiB", "plan"), "bar", "fig-bar"))
    s2.add(figure(intervals_svg("forest", [("x", 1.0, 0.9, 1.1)], 1.0, "B/A", "t"), "forest", "fig-forest"))
    s2.add("<script>alert(1)</script>", table(["a<b"], [["<i>x</i>"]]))
    path = write_html(tmp_path / "r.html", render_page("title <x>", [s1, s2], meta=["a & b"]))
    page = read_page(path)
    assert page.title == "title <x>"
    assert page.sections == {"gates": "Gates", "figs": "Figures <&>"}
    assert_figures(page, ["fig-cdf", "fig-curve", "fig-bar", "fig-forest"])
    assert_self_contained(page)  # the script above is text, not an element
    assert "<script>alert(1)</script>" in page.text and "<i>x</i>" in page.text
    assert page.verdicts == ["PASS", "FAIL", "PASS", "NOT SHOWN", "FAIL"]
    assert "about 301 items would decide it" in page.text and "not measured" in page.text
    assert "[-0.4, 3.4] (95%)" in page.text and "upper bound" in page.text and "lower bound" in page.text
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]  # no temp file left


def test_empty_figures_are_none():
    assert cdf_svg("x", [("a", [])], "ms", "t") is None
    assert curve_svg("x", [("a", None, 1.0)], None, "ms") is None
    assert intervals_svg("x", [], 1.0, "x", "t") is None


def test_bad_paths_are_one_line_errors(tmp_path):
    with pytest.raises(LlmoptError, match="folder .*nope does not exist"):
        check_html_path(tmp_path / "nope" / "r.html")
    with pytest.raises(LlmoptError, match="is a folder"):
        check_html_path(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(LlmoptError, match="is not a folder"):
        write_html(tmp_path / "file" / "r.html", "<!DOCTYPE html>")


def test_write_replaces_atomically(tmp_path):
    p = tmp_path / "r.html"
    p.write_text("old")
    write_html(p, "<!DOCTYPE html>\n<html></html>\n")
    assert p.read_text().startswith("<!DOCTYPE html>")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["r.html"]


def test_ab_interval_gates_get_the_shared_verdicts():
    """bench --ab's interval gates only pass or fail; the page says NOT SHOWN when the interval straddles the
    threshold, FAIL when all of it is past, as eval does."""
    from llmopt.bench.ab_gates import check_bench_gates, parse_bench_gates
    from llmopt.bench.ab_stats import RatioEstimate

    est = RatioEstimate(ratio=0.97, low=0.93, high=1.01, confidence=0.95, rounds=6)
    gates = parse_bench_gates(["output_throughput_ratio>=0.95@95", "output_throughput_ratio>=0.9@95",
                               "output_throughput_ratio>=1.05@95", "output_throughput_ratio>=0.95"])
    rows = gate_rows(check_bench_gates(gates, lambda m: 0.97, lambda m, c: est))
    assert [r.verdict for r in rows] == ["NOT SHOWN", "PASS", "FAIL", "PASS"]
    assert [r.reads for r in rows] == ["lower bound"] * 3 + ["point"]
    assert rows[0].expression == "output_throughput_ratio>=0.95@95" and (rows[0].low, rows[0].high) == (0.93, 1.01)
