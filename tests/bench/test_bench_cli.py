"""`llmopt bench` end to end on the tiny model: library, CLI (in-process and as a subprocess), scenarios,
`--compare`, gates, bad input and Ctrl-C."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from cli_helpers import run_bench_cli, subprocess_env
from rich.console import Console

from llmopt.bench.config import BenchOptions
from llmopt.bench.report import BenchReport, load_report
from llmopt.bench.runner import run_bench
from llmopt.bench.scenario_report import ScenarioReport, compare_files

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ENGINE = ["--kv-cache-memory", "16MiB", "--dtype", "float32", "--device", "cpu"]


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=250)


@pytest.fixture(scope="module")
def sweep(tiny_llama, tmp_path_factory):
    """One offline concurrency sweep through the library, with every output file."""
    d = tmp_path_factory.mktemp("sweep")
    cfg = BenchOptions(model=str(tiny_llama), kv_cache_memory="16MiB", dtype="float32", device="cpu",
                       input_len="8:24", output_len="4:16", num_prompts=8, concurrency="1,4",
                       json_path=str(d / "r.json"), markdown_path=str(d / "r.md"), plot_path=str(d / "r.png"),
                       progress=False).build()
    return run_bench(cfg, _quiet()), d


def test_offline_sweep_through_the_library(sweep):
    outcome, d = sweep
    rep = outcome.report
    assert not outcome.interrupted and outcome.scenario is None
    assert rep.target.kind == "offline" and rep.target.engine["resolved_dtype"] == "float32"
    assert rep.sweep == "concurrency" and [r.label for r in rep.runs] == ["concurrency 1", "concurrency 4"]
    for run in rep.runs:
        assert run.completed == 8 and run.failed == 0 and run.output_throughput > 0
        assert run.ttft_ms.p99 is not None and run.tpot_ms.count > 0
        assert run.server_metrics is not None and run.server_metrics.mean_batch_size >= 1
    assert rep.runs[0].peak_concurrency == 1 and rep.runs[1].peak_concurrency <= 4
    assert rep.runs[0].total_output_tokens == rep.runs[1].total_output_tokens  # same workload each level
    assert rep.knee is not None and rep.knee.index is not None and rep.knee.recommendation
    assert load_report(d / "r.json") == rep  # the JSON is a valid report, and a faithful one
    assert (d / "r.png").read_bytes()[:8] == PNG_MAGIC
    md = (d / "r.md").read_text()
    assert "| load | req/s | output tok/s |" in md and "| concurrency 4 |" in md and "**Knee (" in md


def test_offline_sweep_through_the_cli(tiny_llama, tmp_path):
    cmd = [sys.executable, "-m", "llmopt", "bench", "--model", str(tiny_llama), *ENGINE, "--input-len", "8:24",
           "--output-len", "4:12", "--num-prompts", "6", "--concurrency", "1,2", "--json", "a.json",
           "--markdown", "a.md", "--plot", "a.png", "--gate", "completed>=6", "--no-progress"]
    p = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rep = BenchReport.model_validate(json.loads((tmp_path / "a.json").read_text()))
    assert [r.concurrency for r in rep.runs] == [1, 2] and all(r.completed == 6 for r in rep.runs)
    assert rep.knee is not None
    assert (tmp_path / "a.png").read_bytes()[:8] == PNG_MAGIC
    assert "| concurrency 2 |" in (tmp_path / "a.md").read_text()
    assert "knee (" in p.stdout and "gate PASS completed>=6" in p.stdout and "wrote a.json" in p.stdout


def test_static_vs_continuous(tiny_llama, tmp_path):
    # one long request per batch of 8 and seven short ones: static batching idles 7 slots most of the time
    data = tmp_path / "skewed.jsonl"
    data.write_text("".join(json.dumps({"prompt": [11 + i, 12, 13, 14, 15], "max_tokens": 96 if i % 8 == 0 else 3})
                            + "\n" for i in range(32)))
    cfg = BenchOptions(model=str(tiny_llama), kv_cache_memory="16MiB", dtype="float32", device="cpu",
                       dataset=str(data), scenario="static-vs-continuous", static_batch_size=8, warmup=2,
                       json_path=str(tmp_path / "s.json"), markdown_path=str(tmp_path / "s.md"),
                       plot_path=str(tmp_path / "s.png"), gates=["mean_batch_size_ratio>=1.5"],
                       progress=False).build()
    outcome = run_bench(cfg, _quiet())
    static, cont = (v.report.runs[0] for v in outcome.scenario.variants)
    assert static.label == "static batches of 8" and cont.label == "concurrency 8"
    assert static.total_output_tokens == cont.total_output_tokens == 4 * 96 + 28 * 3
    # which one is faster in wall time is a benchmark (docs/BENCHMARKS.md), not a test: on a loaded
    # 2-core machine continuous batching lost 147 vs 243 tok/s once while doing a third of the steps
    assert cont.server_metrics.mean_batch_size > static.server_metrics.mean_batch_size
    assert cont.server_metrics.counters["steps"] < static.server_metrics.counters["steps"]
    assert outcome.gates[0].passed and outcome.gate_failure is None

    saved = ScenarioReport.model_validate_json((tmp_path / "s.json").read_text())
    assert saved == outcome.scenario
    row = next(r for r in saved.comparison.rows if r.metric == "output tok/s")
    assert row.run == "static batches of 8 vs concurrency 8"
    assert row.cells[0].ratio == pytest.approx(1.0)
    assert row.cells[1].ratio == pytest.approx(cont.output_throughput / static.output_throughput)
    md = (tmp_path / "s.md").read_text()
    assert "| load | metric | static (base) | continuous |" in md and "## static" in md
    assert (tmp_path / "s.png").read_bytes()[:8] == PNG_MAGIC
    # --compare of the scenario file alone: its variants, paired by position since their labels differ
    cmp = compare_files([tmp_path / "s.json"])
    assert cmp.reports == [f"{tmp_path / 's.json'}:static", f"{tmp_path / 's.json'}:continuous"]
    assert next(r for r in cmp.rows if r.metric == "output tok/s").cells[1].ratio == row.cells[1].ratio


def test_prefix_cache_scenario_and_ratio_gates(tiny_llama, tmp_path, monkeypatch, capsys):
    code, out, err = run_bench_cli(
        monkeypatch, capsys, "--model", str(tiny_llama), *ENGINE, "--scenario", "prefix-cache",
        "--prefix-len", "64", "--num-prefixes", "2", "--suffix-len", "4", "--output-len", "2", "--num-prompts", "8",
        "--concurrency", "1", "--json", str(tmp_path / "p.json"), "--gate", "prefix_cache_hit_rate>=0.5",
        "--gate", "prefix_cache_hit_rate_ratio>=2", "--no-progress")
    assert code == 1, err  # "off" has no hit rate to divide by: the ratio gate is not measured and fails
    assert "gate PASS prefix_cache_hit_rate>=0.5" in out
    assert "1 gate(s) failed: prefix_cache_hit_rate_ratio>=2 (not measured)" in err
    rep = ScenarioReport.model_validate_json((tmp_path / "p.json").read_text())
    off, on = (v.report.runs[0].server_metrics for v in rep.variants)
    assert off.prefix_cache_hit_rate is None and off.prefix_cache_hits == 0
    assert on.prefix_cache_hits == (8 - 2) * 64
    assert "ratios vs prefix-cache-off (baseline)" in out and "prefix hit rate" in out


def test_compare_prints_ratios(sweep, tiny_llama, tmp_path, monkeypatch, capsys):
    outcome, d = sweep
    other = BenchOptions(model=str(tiny_llama), kv_cache_memory="16MiB", dtype="float32", device="cpu",
                         input_len="8:24", output_len="4:16", num_prompts=8, concurrency="1,4", seed=1,
                         json_path=str(tmp_path / "b.json"), progress=False).build()
    run_bench(other, _quiet())
    code, out, err = run_bench_cli(monkeypatch, capsys, "--compare", str(d / "r.json"), str(tmp_path / "b.json"))
    assert code == 0, err
    assert "r.json (base)" in out and "b.json" in out and "concurrency 4" in out
    assert "output tok/s" in out and "TTFT p99 ms" in out and "(x" in out

    code, out, err = run_bench_cli(monkeypatch, capsys, "--compare", str(d / "r.json"))
    assert code == 2 and "at least two reports" in err
    code, out, err = run_bench_cli(monkeypatch, capsys, str(d / "r.json"))
    assert code == 2 and "report files go with --compare" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--url", "http://127.0.0.1:{port}"], "cannot reach http://127.0.0.1:{port}: connection refused"),
    (["--slo", "ttft=soon"], "cannot parse SLO item 'ttft=soon'"),
    (["--concurrency", "1,2,,x"], "cannot parse concurrency sweep"),
    (["--dataset", "missing.jsonl"], "dataset file missing.jsonl not found"),
    (["--gate", "speed>=1"], "unknown gate metric 'speed'"),
    # result files are checked before anything runs (they failed after the whole benchmark, with a traceback)
    (["--json", "afile/b.json"], "--json afile/b.json: afile is not a folder"),
    (["--markdown", "afile/deeper/b.md"], "afile is a file, not a folder"),
    (["--plot", "afile/p.png"], "--plot afile/p.png: afile is not a folder"),
])
def test_bad_input_exits_2_with_one_line(args, message, closed_port, tmp_path):
    (tmp_path / "afile").write_text("x")
    args = [a.format(port=closed_port) for a in args]
    p = subprocess.run([sys.executable, "-m", "llmopt", "bench", *args], cwd=tmp_path, env=subprocess_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message.format(port=closed_port) in lines[0]
    assert p.stdout == ""


def test_gates_pass_and_fail(tiny_llama, monkeypatch, capsys):
    base = ["--model", str(tiny_llama), *ENGINE, "--input-len", "8", "--output-len", "4", "--num-prompts", "4",
            "--concurrency", "2", "--no-progress"]
    code, out, err = run_bench_cli(monkeypatch, capsys, *base, "--gate", "output_throughput>=1", "--gate", "failed<=0")
    assert code == 0, err
    assert "gate PASS output_throughput>=1" in out and "gate PASS failed<=0" in out
    code, out, err = run_bench_cli(monkeypatch, capsys, *base, "--gate", "ttft_p99_ms<=0.000001;completed>=4")
    assert code == 1
    assert "gate FAIL ttft_p99_ms<=1e-06" in out and "gate PASS completed>=4" in out
    assert err.strip().splitlines() == [err.strip()] and "ttft_p99_ms<=1e-06" in err


def test_ctrl_c_prints_partial_results_and_exits_130(tiny_llama, tmp_path, monkeypatch, capsys):
    from llmopt.engine.llm_engine import LLMEngine

    real_step = LLMEngine.step
    calls = {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == 40:  # well into the second load level
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    code, out, err = run_bench_cli(monkeypatch, capsys, "--model", str(tiny_llama), *ENGINE, "--input-len", "8",
                             "--output-len", "6", "--num-prompts", "6", "--concurrency", "1,2,4", "--warmup", "0",
                             "--json", str(tmp_path / "i.json"), "--gate", "failed<=0", "--no-progress")
    assert code == 130 and "interrupted; the partial results are above" in err
    rep = load_report(tmp_path / "i.json")
    assert len(rep.runs) == 2 and not rep.runs[0].stopped_early and rep.runs[1].stopped_early
    assert rep.runs[0].completed == 6 and rep.runs[1].interrupted > 0
    assert "concurrency 2 *" in out and "interrupted:" in out
    assert "gate PASS" not in out and "gate FAIL" not in out  # partial results are not gated
