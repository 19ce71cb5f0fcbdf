"""The report schema, its writers (JSON, Markdown, rich, PNG) and `--compare`."""

from __future__ import annotations

import io
import json
import math

import pytest
from rich.console import Console

from llmopt.bench.http_target import ServerMetrics
from llmopt.bench.load import LoadPattern, LoadResult
from llmopt.bench.metrics import parse_slo
from llmopt.bench.records import RequestRecord
from llmopt.bench.report import (
    BenchReport,
    BenchRun,
    TargetInfo,
    compare_reports,
    load_report,
    render_comparison,
    render_report,
    summary_text,
    to_markdown,
    write_json,
    write_markdown,
    write_plot,
)
from llmopt.bench.workloads import RandomWorkload
from llmopt.errors import LlmoptError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load_result(pattern: LoadPattern, ttft: float, tpot: float, per_s: float = 1.0, n: int = 12, out: int = 5,
                 failures: int = 0) -> LoadResult:
    """n requests, `per_s` starting each second, with the given TTFT and TPOT, plus some failures."""
    recs = []
    for i in range(n):
        s = i / per_s
        times = [s + ttft + k * tpot * (1 + 0.1 * (i % 3)) for k in range(out)]
        recs.append(RequestRecord.from_chunks(start=s, token_times=times, prompt_tokens=20, index=i))
    recs += [RequestRecord.failure(start=0, end=1, error_code="http_503", error="busy") for _ in range(failures)]
    return LoadResult(pattern=pattern, records=recs, duration_s=n / per_s)


SWEEP = [  # concurrency, requests started per second, TTFT, TPOT: saturates at 8
    (1, 1.0, 0.05, 0.010), (2, 2.0, 0.06, 0.011), (4, 3.8, 0.08, 0.013), (8, 6.5, 0.30, 0.020),
    (None, 6.8, 1.2, 0.05),
]


def _report(speedup: float = 1.0, slo: str | None = None) -> BenchReport:
    s = parse_slo(slo) if slo else None
    runs = []
    for c, per_s, ttft, tpot in SWEEP:
        res = _load_result(LoadPattern(concurrency=c), ttft / speedup, tpot / speedup, per_s=per_s * speedup)
        runs.append(BenchRun.from_load(res, s, ServerMetrics(prefix_cache_hit_rate=0.5, preemptions=0)))
    rep = BenchReport(target=TargetInfo(kind="http", url="http://127.0.0.1:8000", model="tiny", server="llmopt"),
                      workload=RandomWorkload(num_requests=12, input_len="20", output_len="5"),
                      sweep="concurrency", slo=s, runs=runs)
    return rep.with_knee()


def test_json_round_trip_and_schema(tmp_path):
    rep = _report()
    path = write_json(rep, tmp_path / "out" / "a.json")
    raw = json.loads(path.read_text())
    assert set(raw) >= {"target", "workload", "runs", "knee", "created", "llmopt_version"}
    run = raw["runs"][0]
    for key in ("concurrency", "request_rate", "request_throughput", "output_throughput", "total_throughput",
                "goodput", "failures", "completed", "duration_s", "server_metrics"):
        assert key in run
    assert set(run["ttft_ms"]) >= {"mean", "p50", "p90", "p99", "std", "min", "max"}
    assert run["request_rate"] == "Infinity"  # strict JSON has no inf
    assert raw["runs"][-1]["concurrency"] is None
    assert raw["workload"]["kind"] == "random"
    back = load_report(path)
    assert back == rep
    assert math.isinf(back.runs[0].request_rate)
    assert BenchReport.model_validate(raw) == rep
    assert [p.name for p in path.parent.iterdir()] == ["a.json"]  # no temp files left behind


def test_knee_in_report():
    rep = _report()
    assert rep.knee is not None and rep.knee.point is not None
    assert rep.knee.method == "kneedle" and rep.knee.point.x == 8
    assert rep.knee.recommendation == "run with max concurrency 8: 32.5 tok/s at p99 TTFT 300 ms"
    rep = _report(slo="ttft=100ms")
    assert rep.knee.method == "slo" and rep.knee.point.x == 4  # concurrency 4 is the last with TTFT < 100 ms
    assert rep.runs[0].goodput == pytest.approx(rep.runs[0].request_throughput)


def test_bad_report_files(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"target": {"kind": "http"}, "runs": []}')
    with pytest.raises(LlmoptError, match="is not an llmopt bench report: workload"):
        load_report(p)
    with pytest.raises(LlmoptError, match="cannot read report"):
        load_report(tmp_path / "missing.json")


def test_markdown(tmp_path):
    rep = _report()
    md = to_markdown(rep)
    assert "| load | req/s | output tok/s |" in md
    assert "| concurrency 8 |" in md and "| all at once |" in md
    assert f"**Knee ({rep.knee.method}):** {rep.knee.recommendation}" in md
    assert write_markdown(rep, tmp_path / "r.md").read_text() == md


def test_plots_are_png(tmp_path):
    rep = _report()
    assert write_plot(rep, tmp_path / "sweep.png").read_bytes()[:8] == PNG_MAGIC
    single = rep.model_copy(update={"runs": rep.runs[:1], "knee": None, "sweep": None})
    assert write_plot(single, tmp_path / "single.png").read_bytes()[:8] == PNG_MAGIC


def test_rich_and_text_summaries():
    rep = _report()
    res = _load_result(LoadPattern(concurrency=2), 0.1, 0.01, failures=2)
    run = BenchRun.from_load(res, parse_slo("ttft=1s"))
    text = summary_text(run)
    assert " Serving Benchmark Result " in text
    assert "Failed requests:                         2" in text and "http_503" in text
    assert "Request goodput (req/s):" in text
    assert "Mean TTFT (ms):                          100.00" in text

    out = io.StringIO()
    console = Console(file=out, width=160)
    render_report(rep, console)
    render_report(rep.model_copy(update={"runs": [run], "knee": None}), console)
    shown = out.getvalue()
    assert "concurrency 8" in shown and "knee (" in shown
    assert "Time per Output Token" in shown and "Prefix cache hit rate" not in shown


def test_compare_reports(tmp_path):
    a = write_json(_report(), tmp_path / "a.json")
    b = write_json(_report(speedup=2.0), tmp_path / "b.json")
    cmp = compare_reports([a, b])
    assert cmp.reports == [str(a), str(b)]
    rows = {(r.run, r.metric): r for r in cmp.rows}
    row = rows[("concurrency 1", "req/s")]
    assert row.better == "higher"
    assert row.cells[0].value == pytest.approx(1.0) and row.cells[0].ratio == pytest.approx(1.0)
    assert row.cells[1].value == pytest.approx(2.0) and row.cells[1].ratio == pytest.approx(2.0)
    ttft = rows[("all at once", "TTFT p50 ms")]
    assert ttft.better == "lower" and ttft.cells[1].ratio == pytest.approx(0.5)
    assert rows[("concurrency 8", "failed")].cells[1].ratio is None  # 0 failures: no ratio to take
    out = io.StringIO()
    render_comparison(cmp, Console(file=out, width=200))
    assert "a.json (base)" in out.getvalue() and "x2.00" in out.getvalue()
    with pytest.raises(LlmoptError, match="at least two"):
        compare_reports([a])
