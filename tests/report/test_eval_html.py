"""`llmopt eval --html` on tiny models: the gate table with point, interval and verdict, the metrics with their
paired intervals, bisect's per-layer sensitivity; the page is written when a gate fails; bad paths exit 2."""

from __future__ import annotations

import json

import pytest
from html_check import assert_figures, assert_self_contained, read_page

from llmopt.testing.tiny_model import write_tiny_llama
from tests.cli_runner import run_cli
from tests.eval.eval_helpers import write_task

TEXT = ("The quick brown fox jumps over the lazy dog. A KV cache stores keys and values for every token. "
        "Quantization trades a little quality for memory bandwidth and speed. ") * 8
VERDICT = {"pass": "PASS", "fail": "FAIL", "not shown": "NOT SHOWN"}


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory):
    """The same architecture and tokenizer as tiny_llama, other random weights: a candidate that differs."""
    return write_tiny_llama(tmp_path_factory.mktemp("other-llama"), seed=1)


def test_eval_page_has_gates_metrics_and_bisect(tiny_llama, other_llama, tmp_path, monkeypatch, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    task = write_task(tmp_path / "t")
    page_path = tmp_path / "eval.html"
    gates = ["acc_drop<=100@95", "acc_drop<=0@95", "kl_div<=1e-6@95", "ppl_increase_pct<=1000", "tiny_mc.acc>=0"]
    code, out, err = run_cli(monkeypatch, capsys, "eval", str(other_llama), "--baseline", str(tiny_llama),
                             "--ppl-data", str(data), "--seq-len", "64", "--task", str(task), "--bisect",
                             "--json", "--html", str(page_path), *[a for g in gates for a in ("--gate", g)])
    assert code == 1, err  # KL and the zero margin fail; the page is written anyway
    rep = json.loads(out)
    page = read_page(page_path)
    assert_self_contained(page)
    assert page.title == f"llmopt eval: {other_llama} vs {tiny_llama}"
    assert set(page.sections) == {"gates", "metrics", "bisect"}
    assert_figures(page, ["fig-eval-drops", "fig-bisect-layers"])
    # one verdict per gate, as the JSON has them (plain gates: PASS or FAIL)
    expected = [VERDICT[g["verdict"]] if g.get("verdict") else ("PASS" if g["pass"] else "FAIL") for g in rep["gates"]]
    assert page.verdicts == expected and len(expected) == len(gates)
    assert {"PASS", "FAIL"} <= set(expected)
    kl = next(g for g in rep["gates"] if g["gate"] == "kl_div<=1e-06@95")
    assert f"{kl['low']:.4g}" in page.text and "upper bound" in page.text
    # every metric with its interval, and bisect's layers
    for name in rep["metrics"]:
        assert name in page.text
    assert "Per-layer sensitivity" in page.text and "decoder layer restored from the baseline" in page.text
    assert len(rep["bisect"]["layers"]) == 2


def test_single_model_page(tiny_llama, tmp_path, monkeypatch, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    code, out, err = run_cli(monkeypatch, capsys, "eval", str(tiny_llama), "--ppl-data", str(data), "--seq-len", "64",
                             "--html", str(tmp_path / "one.html"), "--gate", "ppl>=1")
    assert code == 0, err
    page = read_page(tmp_path / "one.html")
    assert_self_contained(page)
    assert set(page.sections) == {"gates", "metrics"} and page.verdicts == ["PASS"]
    assert page.figures == {}  # nothing paired to draw


@pytest.mark.parametrize("where", ["missing_folder", "folder"])
def test_bad_html_path_exits_2_before_loading(where, tmp_path, monkeypatch, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    target = tmp_path / "nope" / "r.html" if where == "missing_folder" else tmp_path
    # the model does not exist either: the path is refused first, so nothing was loaded
    code, out, err = run_cli(monkeypatch, capsys, "eval", str(tmp_path / "no-model"), "--ppl-data", str(data),
                             "--html", str(target))
    assert code == 2, (out, err)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --html") and str(target) in lines[0], err
