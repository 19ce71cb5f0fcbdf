"""`llmopt bench --html`: a sweep against the scripted server on loopback (latency CDFs, the curve and its knee,
gates), an A/B run (ratio intervals, confidence gates), and bad paths refused before anything runs."""

from __future__ import annotations

import json

import pytest
from html_check import assert_figures, assert_self_contained, read_page

from tests.cli_runner import run_cli

CDFS = ["fig-cdf-ttft", "fig-cdf-tpot", "fig-cdf-e2el"]


def test_sweep_page(fake_server, tiny_llama, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "bench", "--url", fake_server.url, "--tokenizer", str(tiny_llama),
                             "--input-len", "6", "--output-len", "4", "--num-prompts", "4", "--concurrency", "1,2,4",
                             "--warmup", "0", "--no-progress", "--json", str(tmp_path / "b.json"),
                             "--html", str(tmp_path / "b.html"), "--gate", "completed>=4", "--gate", "failed>=1")
    assert code == 1, err  # failed>=1 fails: the page is written with it
    assert f"wrote {tmp_path / 'b.html'}" in out.replace("\n", "")
    page = read_page(tmp_path / "b.html")
    assert_self_contained(page)
    assert page.title == "llmopt bench"
    assert set(page.sections) == {"runs", "latency", "curve", "gates"}
    assert_figures(page, [*CDFS, "fig-curve"])
    assert page.verdicts == ["PASS", "FAIL"]
    rep = json.loads((tmp_path / "b.json").read_text())
    assert rep["knee"]["recommendation"] in page.text
    for run in rep["runs"]:
        assert f"{run['label']} (n={run['completed']})" in page.text  # one CDF line per level, its requests


def test_ab_page(fake_server, tiny_llama, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "bench", "--tokenizer", str(tiny_llama), "--input-len", "6",
                             "--output-len", "6", "--num-prompts", "3", "--concurrency", "3", "--warmup", "0",
                             "--no-progress", "--rounds", "3", "--ab", f"url={fake_server.url},name=one",
                             "--ab", f"url={fake_server.url},served-model=multi,name=two",
                             "--gate", "output_throughput_ratio>=0.5@95", "--gate", "output_throughput_ratio<=0.5@95",
                             "--html", str(tmp_path / "ab.html"))
    assert code == 1, err
    page = read_page(tmp_path / "ab.html")
    assert_self_contained(page)
    assert page.title == "llmopt bench A/B"
    assert set(page.sections) == {"ab", "ab-runs", "ab-latency", "gates"}
    assert_figures(page, ["fig-ab-ratios", "fig-ab-cdf-ttft", "fig-ab-cdf-tpot", "fig-ab-cdf-e2el"])
    assert page.verdicts == ["PASS", "FAIL"] and "lower bound" in page.text and "upper bound" in page.text
    assert "output_throughput" in page.text and "B / A" in page.text


@pytest.mark.parametrize("where", ["missing_folder", "folder"])
def test_bad_html_path_exits_2_before_running(where, closed_port, tmp_path, monkeypatch, capsys):
    target = tmp_path / "nope" / "r.html" if where == "missing_folder" else tmp_path
    # the server is not there either: the path is refused first, before the URL is tried
    code, out, err = run_cli(monkeypatch, capsys, "bench", "--url", f"http://127.0.0.1:{closed_port}",
                             "--html", str(target))
    assert code == 2, (out, err)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --html") and str(target) in lines[0], err


def test_scenario_page(tiny_llama, tmp_path, monkeypatch, capsys):
    """In-process scenario on the tiny model: the comparison, every variant's runs and CDFs."""
    code, out, err = run_cli(monkeypatch, capsys, "bench", "--model", str(tiny_llama), "--dtype", "float32",
                             "--device", "cpu", "--kv-cache-memory", "16MiB", "--scenario", "static-vs-continuous",
                             "--static-batch-size", "2", "--num-prompts", "4", "--input-len", "8", "--output-len",
                             "2:6", "--warmup", "0", "--no-progress", "--html", str(tmp_path / "s.html"))
    assert code == 0, err
    page = read_page(tmp_path / "s.html")
    assert_self_contained(page)
    assert page.title == "llmopt bench scenario"
    assert {"scenario", "scenario-runs", "scenario-latency"} <= set(page.sections)
    assert_figures(page, ["fig-scenario-cdf-ttft", "fig-scenario-cdf-tpot", "fig-scenario-cdf-e2el"])
    assert "static: static batches of 2" in page.text and "continuous: " in page.text
    assert page.verdicts == []  # no gates
