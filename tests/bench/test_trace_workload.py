"""Mooncake-style trace replay: parsing (every bad line named), prompts that share the trace's blocks,
arrival times kept in-process and over HTTP, and the flags' error paths."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run_bench_cli

from llmopt.bench.report import load_report
from llmopt.bench.trace_workload import TraceWorkload, load_trace
from llmopt.errors import LlmoptError


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompts_share_the_traces_blocks(tmp_path, tiny_tokenizer):
    trace = _write(tmp_path / "t.jsonl", [
        {"timestamp": 500, "input_length": 10, "output_length": 3, "hash_ids": [0, 2, 3]},
        {"timestamp": 0, "input_length": 8, "output_length": 2, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 6, "output_length": 1},
    ])
    reqs = TraceWorkload(path=str(trace), block_size=4, token_ids=True).build(tiny_tokenizer)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.5]  # sorted, ms -> s, from the first arrival
    assert [len(r.prompt) for r in reqs] == [8, 10, 6] and [r.max_tokens for r in reqs] == [2, 3, 1]
    first, second = reqs[0].prompt, reqs[1].prompt
    assert first[:4] == second[:4] and first[4:8] != second[4:8]  # hash 0 shared, 1 vs 2 not
    salted = TraceWorkload(path=str(trace), block_size=4, token_ids=True, salt=1).build(tiny_tokenizer)
    assert [len(r.prompt) for r in salted] == [8, 10, 6] and salted[0].prompt != first
    assert salted[0].prompt[:4] == salted[1].prompt[:4]  # another salt: other tokens, same sharing
    fast = TraceWorkload(path=str(trace), time_unit="s", time_scale=0.5, num_requests=2).build(tiny_tokenizer)
    assert [r.arrival_s for r in fast] == [0.0, 250.0] and all(isinstance(r.prompt, str) for r in fast)


@pytest.mark.parametrize("line, needle", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"timestamp": 0, "input_length": 4}', 'missing "output_length"'),
    ('{"timestamp": -1, "input_length": 4, "output_length": 1}', '"timestamp" must be a non-negative number'),
    ('{"timestamp": "0", "input_length": 4, "output_length": 1}', '"timestamp" must be a non-negative number'),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1}', '"input_length" must be a positive integer'),
    ('{"timestamp": 0, "input_length": 4, "output_length": 1.5}', '"output_length" must be a positive integer'),
    ('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [-1]}', '"hash_ids" must be a list'),
])
def test_bad_lines_are_named(tmp_path, line, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 4, "output_length": 1}\n' + line + "\n")
    with pytest.raises(LlmoptError, match=f"bad.jsonl:2: .*{needle[:20]}"):
        load_trace(p)


def test_empty_and_missing_traces(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(LlmoptError, match="the trace is empty"):
        load_trace(tmp_path / "empty.jsonl")
    with pytest.raises(LlmoptError, match="cannot read trace"):
        load_trace(tmp_path / "nope.jsonl")


def test_replay_in_process_keeps_arrivals_and_prefix_hits(tiny_llama, tmp_path, monkeypatch, capsys):
    trace = _write(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 32, "output_length": 4, "hash_ids": [7, 8]},
        {"timestamp": 400, "input_length": 48, "output_length": 4, "hash_ids": [7, 8, 9]},
        {"timestamp": 800, "input_length": 16, "output_length": 4, "hash_ids": [5]},
    ])
    code, out, err = run_bench_cli(monkeypatch, capsys, "--model", str(tiny_llama), "--dtype", "float32",
                                   "--device", "cpu", "--kv-cache-memory", "16MiB", "--workload", "trace",
                                   "--dataset", str(trace), "--trace-block-size", "16", "--warmup", "0",
                                   "--json", str(tmp_path / "r.json"), "--no-progress")
    assert code == 0, err
    rep = load_report(tmp_path / "r.json")
    run = rep.runs[0]
    assert rep.workload.kind == "trace" and run.completed == 3 and run.total_input_tokens == 96
    assert run.duration_s >= 0.8  # the last request was sent 800 ms in, not at once
    assert run.peak_concurrency == 1  # each finished long before the next arrived
    assert run.server_metrics.prefix_cache_hits == 32  # blocks 7 and 8 again in the second request


def test_replay_over_http(fake_server, tiny_llama, tmp_path, monkeypatch, capsys):
    trace = _write(tmp_path / "t.jsonl", [{"timestamp": t, "input_length": 12, "output_length": 2 + i,
                                           "hash_ids": [0, i]} for i, t in enumerate((0, 100, 300))])
    fake_server.bodies.clear()
    code, out, err = run_bench_cli(monkeypatch, capsys, "--url", fake_server.url, "--tokenizer", str(tiny_llama),
                                   "--workload", "trace", "--dataset", str(trace), "--trace-block-size", "6",
                                   "--trace-time-scale", "2", "--warmup", "0", "--json", str(tmp_path / "h.json"),
                                   "--no-progress")
    assert code == 0, err
    run = load_report(tmp_path / "h.json").runs[0]
    assert run.completed == 3 and run.duration_s >= 0.6  # 300 ms, doubled
    probe, *sent = fake_server.bodies  # the test request before the run, then the trace
    assert probe["max_tokens"] == 1 and [b["max_tokens"] for b in sent] == [2, 3, 4]
    prompts = [b["prompt"] for b in sent]
    assert all(isinstance(p, str) for p in prompts) and len(set(prompts)) == 3


@pytest.mark.parametrize("args, needle", [
    (["--workload", "trace"], "needs --dataset TRACE.jsonl"),
    (["--workload", "trace", "--dataset", "/nonexistent.jsonl"], "trace file /nonexistent.jsonl not found"),
    (["--workload", "trace", "--dataset", "TRACE", "--request-rate", "2"], "brings its own arrival times"),
    (["--workload", "trace", "--dataset", "TRACE", "--trace-block-size", "0"], "at least 1"),
    (["--workload", "trace", "--dataset", "TRACE", "--trace-time-scale", "0"], "must be positive"),
    (["--workload", "trace", "--dataset", "TRACE", "--trace-time-unit", "h"], "invalid trace_time_unit"),
    (["--trace-block-size", "16"], "apply to --workload trace, not random"),
])
def test_bad_trace_flags_exit_2(args, needle, tmp_path, monkeypatch, capsys):
    trace = _write(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 4, "output_length": 1}])
    args = [str(trace) if a == "TRACE" else a for a in args]
    code, out, err = run_bench_cli(monkeypatch, capsys, *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
