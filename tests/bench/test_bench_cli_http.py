"""`llmopt bench --url`: against the scripted SSE server (faults on demand) and against `llmopt serve`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cli_helpers import run_bench_cli, subprocess_env
from scripted_sse_server import USAGE_PROMPT_TOKENS

from llmopt.bench.report import load_report


def test_sweep_against_a_server_with_metrics(fake_server, tiny_llama, tmp_path, monkeypatch, capsys):
    fake_server.bodies.clear()
    code, out, err = run_bench_cli(monkeypatch, capsys, "--url", fake_server.url, "--tokenizer", str(tiny_llama),
                             "--input-len", "6", "--output-len", "3", "--num-prompts", "4", "--concurrency", "1,2",
                             "--warmup", "1", "--json", str(tmp_path / "h.json"), "--gate", "completed>=4",
                             "--no-progress")
    assert code == 0, err
    rep = load_report(tmp_path / "h.json")
    assert rep.target.kind == "http" and rep.target.server == "llmopt" and rep.target.model == "tiny"
    assert [r.concurrency for r in rep.runs] == [1, 2]
    for run in rep.runs:
        assert run.completed == 4 and run.failed == 0
        assert run.total_output_tokens == 12 and run.total_input_tokens == 4 * USAGE_PROMPT_TOKENS
        # the server counted 6 hits per 10 queries for every request; the warm-up is not in the diff
        assert run.server_metrics.prefix_cache_queries == 40 and run.server_metrics.prefix_cache_hit_rate == 0.6
    probe, *sent = fake_server.bodies
    assert probe["prompt"] == "Hi" and probe["max_tokens"] == 1  # the test request before the run
    assert len(sent) == 2 * (1 + 4)  # a warm-up request before each level
    assert all(b["ignore_eos"] is True and b["max_tokens"] == 3 for b in sent)  # our server
    assert "knee (" in out and "gate PASS completed>=4" in out


def test_a_client_run_never_imports_torch(fake_server, tiny_llama, tmp_path):
    """`llmopt bench --url` is a client: importing torch cost it 2.7 s of a core before each run, which a
    server on the same machine saw as a neighbour (its `--threads auto` then prefilled the first requests on
    one thread: docs/BENCHMARKS.md, "The benchmark client's start"). Every module the run imports is listed
    by `-X importtime`; torch must not be one. (`--tokenizer` an HF directory: the default model's is a GGUF,
    which a cold cache converts to weights first, with torch.)"""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "llmopt", "bench", "--url", fake_server.url,
                        "--tokenizer", str(tiny_llama), "--input-len", "6", "--output-len", "3", "--num-prompts", "2", "--warmup", "1",
                        "--json", "r.json", "--no-progress"],
                       cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "httpx" in imported and load_report(tmp_path / "r.json").runs[0].completed == 2
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}, "the client imported torch"


def test_server_errors_are_counted_not_fatal(fake_server, tiny_llama, monkeypatch, capsys):
    base = ["--url", fake_server.url, "--tokenizer", str(tiny_llama), "--input-len", "4", "--output-len", "3",
            "--num-prompts", "3", "--warmup", "0", "--no-progress"]
    code, out, err = run_bench_cli(monkeypatch, capsys, *base, "--served-model", "err500")
    assert code == 0, err
    assert "Failed requests:" in out and "http_500:" in out
    code, out, err = run_bench_cli(monkeypatch, capsys, *base, "--served-model", "midstream_error", "--gate", "failed<=0")
    assert code == 1 and "failed<=0 (measured 3)" in err
    assert "stream_error:" in out


def test_a_model_the_server_does_not_serve_stops_the_run(fake_server, tiny_llama, monkeypatch, capsys):
    """A server answers 404 for a model name it does not serve (vLLM's answer here), and every request
    would fail: the test request before the run stops it in one line, exit 2, not a report of failures
    with exit 0. Server errors (5xx) stay results (the test above)."""
    base = ["--tokenizer", str(tiny_llama), "--input-len", "4", "--output-len", "3", "--num-prompts", "3",
            "--no-progress"]
    fake_server.bodies.clear()
    code, out, err = run_bench_cli(monkeypatch, capsys, "--url", fake_server.url, *base, "--served-model", "err404")
    assert code == 2 and "refused a test request" in err and "`err404` does not exist" in err
    assert len(err.strip().splitlines()) == 1 and len(fake_server.bodies) == 1  # nothing sent past the test
    code, out, err = run_bench_cli(monkeypatch, capsys, *base, "--ab", fake_server.url,
                                   "--ab", f"url={fake_server.url},served-model=err404", "--rounds", "2")
    assert code == 2 and "`err404` does not exist" in err


def test_jsonl_workload_needs_no_tokenizer(fake_server, tmp_path, monkeypatch, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) + "\n"
                    + json.dumps({"prompt": "hello", "max_tokens": 3}) + "\n")
    code, out, err = run_bench_cli(monkeypatch, capsys, "--url", fake_server.url, "--dataset", str(data), "--warmup", "0",
                             "--json", str(tmp_path / "j.json"), "--no-progress")
    assert code == 0, err
    run = load_report(tmp_path / "j.json").runs[0]
    assert run.completed == 2 and run.total_output_tokens == 5


# -------------------------------------------------------------------------------------- llmopt serve


def _has_serve() -> bool:
    from llmopt.cli import app

    return any(c.name == "serve" or (c.callback and c.callback.__name__ == "serve") for c in app.registered_commands)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not _has_serve(), reason="`llmopt serve` is not available in this tree")
def test_bench_against_llmopt_serve(tiny_llama, tmp_path):
    env = subprocess_env()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "llmopt", "serve", str(tiny_llama), "--port", str(port),
                               "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "16MiB"],
                              cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, Path(tmp_path / "serve.log").read_text()[-2000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llmopt serve did not become healthy in 90 s"
            time.sleep(0.3)
        p = subprocess.run([sys.executable, "-m", "llmopt", "bench", "--url", url, "--tokenizer", str(tiny_llama),
                            "--input-len", "8", "--output-len", "4", "--num-prompts", "4", "--concurrency", "1,2",
                            "--json", "s.json", "--no-progress"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        wrong = subprocess.run([sys.executable, "-m", "llmopt", "bench", "--url", url, "--tokenizer", str(tiny_llama),
                                "--served-model", "not-served", "--num-prompts", "2", "--no-progress"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert wrong.returncode == 2 and "'not-served' does not exist" in wrong.stderr, wrong.stderr
        rep = load_report(tmp_path / "s.json")
        assert rep.target.kind == "http"
        for run in rep.runs:
            assert run.completed == 4 and run.failed == 0
            assert run.total_output_tokens == 16  # ignore_eos reached our server: exactly max_tokens each
            assert run.ttft_ms.p50 is not None and run.ttft_ms.p50 > 0
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
