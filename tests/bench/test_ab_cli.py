"""`llmopt bench --ab A --ab B`: interleaved rounds on two in-process engines or two servers, ratios with
intervals, confidence gates, `--rounds` and `--compare` with the rounds' statistics, and every bad input."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run_bench_cli

from llmopt.bench.ab_report import AbReport
from llmopt.bench.report import load_report

TINY = ["--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "16MiB", "--input-len", "16",
        "--output-len", "16", "--num-prompts", "8", "--concurrency", "8", "--no-progress"]


def test_in_process_slowdown_is_detected(tiny_llama, tmp_path, monkeypatch, capsys):
    """max-num-seqs 1 serializes 8 requests that max-num-seqs 8 batches: B/A throughput well above 1."""
    code, out, err = run_bench_cli(
        monkeypatch, capsys, "--model", str(tiny_llama), *TINY, "--ab", "max-num-seqs=1,name=serial",
        "--ab", "max-num-seqs=8,name=batched", "--rounds", "4", "--json", str(tmp_path / "ab.json"),
        "--markdown", str(tmp_path / "ab.md"), "--gate", "output_throughput_ratio>=1.5@95",
        "--gate", "ttft_p99_ms_ratio<=0.8@95", "--gate", "completed>=32")
    assert code == 0, err
    rep = AbReport.model_validate_json((tmp_path / "ab.json").read_text())
    assert [s.name for s in rep.sides] == ["serial", "batched"]
    assert rep.sequence == ["serial", "batched", "batched", "serial"] * 2  # abba
    a, b = rep.run(0), rep.run(1)
    assert len(a.rounds) == len(b.rounds) == 4 and a.completed == b.completed == 32  # pooled rounds
    assert a.server_metrics.mean_batch_size == pytest.approx(1.0) and b.server_metrics.mean_batch_size > 3
    thr = rep.ratios["output_throughput"]
    assert thr.low > 1.5 and thr.low <= thr.ratio <= thr.high
    assert "gate PASS output_throughput_ratio>=1.5@95 (95% interval" in out
    assert "| output_throughput |" in (tmp_path / "ab.md").read_text()
    # the same data read by --compare: the two sides of one A/B file, paired intervals
    code, out, err = run_bench_cli(monkeypatch, capsys, "--compare", str(tmp_path / "ab.json"))
    assert code == 0, err
    lo, hi = thr.low, thr.high
    assert f"[{lo:.2f}, {hi:.2f}]" in out


def test_confidence_gate_fails_when_not_shown(tiny_llama, monkeypatch, capsys):
    """A `<=` gate reads the interval's upper bound; a failed gate exits 1 and names the bound."""
    code, out, err = run_bench_cli(
        monkeypatch, capsys, "--model", str(tiny_llama), *TINY, "--ab", "max-num-seqs=1", "--ab", "max-num-seqs=8",
        "--rounds", "2", "--ab-order", "abab", "--gate", "output_throughput_ratio<=1@95")
    assert code == 1
    assert "gate FAIL output_throughput_ratio<=1@95" in out
    assert "1 gate(s) failed: output_throughput_ratio<=1@95 (95% interval" in err and "upper bound" in err


def test_server_against_itself_and_a_faster_server(fake_server, tiny_llama, tmp_path, monkeypatch, capsys):
    """The scripted server streams one token per chunk for model `tiny`, two for `multi` (same chunk gap)."""
    base = ["--tokenizer", str(tiny_llama), "--input-len", "6", "--output-len", "6", "--num-prompts", "4",
            "--concurrency", "2", "--warmup", "0", "--no-progress", "--rounds", "4"]
    fake_server.bodies.clear()
    code, out, err = run_bench_cli(monkeypatch, capsys, *base, "--ab", fake_server.url, "--ab", fake_server.url,
                                   "--json", str(tmp_path / "self.json"),
                                   "--gate", "output_throughput_ratio>=0.8@95", "--gate", "output_throughput_ratio<=1.25@95")
    assert code == 0, err
    rep = AbReport.model_validate_json((tmp_path / "self.json").read_text())
    thr = rep.ratios["output_throughput"]
    assert abs(thr.ratio - 1) < 0.1
    # every run had its own prompts: no run can be served from another's prefix cache
    assert [b["max_tokens"] for b in fake_server.bodies[:2]] == [1, 1]  # each side's test request first
    prompts = [b["prompt"] for b in fake_server.bodies[2:]]
    assert len(prompts) == 4 * 2 * 4 and len(set(prompts)) == len(prompts)
    assert rep.run(0).server_metrics.prefix_cache_hit_rate == pytest.approx(0.6)  # from the server's /metrics
    code, out, err = run_bench_cli(monkeypatch, capsys, *base, "--ab", f"url={fake_server.url},served-model=tiny",
                                   "--ab", f"url={fake_server.url},served-model=multi,name=multi",
                                   "--gate", "output_throughput_ratio>=1.2@95")
    assert code == 0, err
    assert "gate PASS output_throughput_ratio>=1.2@95" in out


def test_rounds_and_compare_of_two_separate_runs(fake_server, tiny_llama, tmp_path, monkeypatch, capsys):
    base = ["--url", fake_server.url, "--tokenizer", str(tiny_llama), "--input-len", "6", "--num-prompts", "3",
            "--concurrency", "3", "--warmup", "0", "--no-progress", "--rounds", "3"]
    for name, out_len in (("a", "4"), ("b", "8")):
        code, out, err = run_bench_cli(monkeypatch, capsys, *base, "--output-len", out_len,
                                       "--json", str(tmp_path / f"{name}.json"))
        assert code == 0, err
    run = load_report(tmp_path / "a.json").runs[0]
    assert run.completed == 9 and len(run.rounds) == 3 and run.rounds[0]["completed"] == 3
    code, out, err = run_bench_cli(monkeypatch, capsys, "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert code == 0, err
    row = next(line for line in out.splitlines() if "output tok/s" in line)
    assert "(x" in row and "[" in row  # ratio with its interval over the rounds (unpaired)


@pytest.mark.parametrize("args, needle", [
    (["--ab", "max-num-seqs=1"], "--ab takes two sides"),
    (["--ab", "max-num-seqs=1", "--ab", "max-num-seqs=2", "--ab", "max-num-seqs=3"], "--ab takes two sides"),
    (["--ab", "colour=red", "--ab", "max-num-seqs=2"], "unknown --ab key 'colour'"),
    (["--ab", "max-num-seqs=x", "--ab", "max-num-seqs=2"], "must be a whole number"),
    (["--ab", "max-num-seqs", "--ab", "max-num-seqs=2,prefix-caching=maybe"], "must be on or off"),
    (["--ab", "max-num-seqs=1", "--ab", "max-num-seqs=2", "--rounds", "1"], "at least 2 rounds"),
    (["--ab", "max-num-seqs=1,name=x", "--ab", "max-num-seqs=2,name=x"], "need different names"),
    (["--ab", "max-num-seqs=1", "--ab", "url=http://127.0.0.1:9"], "like with like"),
    (["--ab", "max-num-seqs=1", "--ab", "max-num-seqs=2", "--scenario", "prefix-cache"], "use one"),
    (["--ab", "max-num-seqs=1", "--ab", "max-num-seqs=2", "--plot", "x.png"], "--plot is not written"),
    (["--ab-order", "abba"], "--ab-order applies to --ab"),
    (["--ab", "max-num-seqs=1", "--ab", "max-num-seqs=2", "--ab-order", "baab"], "invalid ab_order"),
    (["--gate", "output_throughput_ratio>=1@95"], "needs the rounds of --ab"),
    (["--ab", "max-num-seqs=1", "--ab", "max-num-seqs=2", "--gate", "output_throughput>=1@95"], "applies to a ratio"),
    (["--ab", "max-num-seqs=1", "--ab", "max-num-seqs=2", "--gate", "nonsense_ratio>=1@95"], "unknown gate metric"),
    (["--rounds", "0"], "--rounds must be at least 1"),
])
def test_bad_input_exits_2(args, needle, monkeypatch, capsys):
    code, out, err = run_bench_cli(monkeypatch, capsys, "--input-len", "4", "--output-len", "2", *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_ab_sweep_is_refused(tiny_llama, monkeypatch, capsys):
    code, out, err = run_bench_cli(monkeypatch, capsys, "--model", str(tiny_llama), "--dtype", "float32",
                                   "--kv-cache-memory", "16MiB", "--concurrency", "1,2", "--ab", "max-num-seqs=1",
                                   "--ab", "max-num-seqs=2", "--no-progress")
    assert code == 2 and "one load level" in err


def test_compare_rejects_a_broken_ab_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "ab", "sides": []}))
    code, out, err = run_bench_cli(monkeypatch, capsys, "--compare", str(tmp_path / "bad.json"))
    assert code == 2 and "not an llmopt A/B report" in err


def test_ab_of_conversations_in_process(tiny_llama, tmp_path, monkeypatch, capsys):
    """Prefix caching off vs on, with conversations: each side keeps its TTFT per turn, over every round."""
    code, out, err = run_bench_cli(
        monkeypatch, capsys, "--model", str(tiny_llama), "--dtype", "float32", "--device", "cpu",
        "--kv-cache-memory", "16MiB", "--no-progress", "--workload", "conversation", "--users", "2", "--turns", "2",
        "--input-len", "32", "--message-len", "4", "--output-len", "4", "--think-time", "0",
        "--ab", "prefix-caching=off,name=off", "--ab", "prefix-caching=on,name=on", "--rounds", "2",
        "--json", str(tmp_path / "c.json"))
    assert code == 0, err
    rep = AbReport.model_validate_json((tmp_path / "c.json").read_text())
    off, on = rep.run(0), rep.run(1)
    assert [t.completed for t in off.turns] == [t.completed for t in on.turns] == [4, 4]  # 2 users x 2 rounds
    assert off.server_metrics.prefix_cache_hit_rate is None and on.server_metrics.prefix_cache_hit_rate > 0.3
    assert "off: TTFT per turn" in out and "on: TTFT per turn" in out
