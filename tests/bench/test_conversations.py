"""Multi-turn conversations: scripts, each turn resending the history with the model's own answer, TTFT
per turn, the prefix-cache hit rate from the target's counters (or 'n/a'), and the flags' error paths."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from cli_helpers import run_bench_cli, subprocess_env
from rich.console import Console

from llmopt.bench.conversations import ConversationWorkload, parse_think_time
from llmopt.bench.report import BenchRun, load_report, render_turns
from llmopt.errors import LlmoptError

TINY = ["--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "16MiB", "--no-progress"]


def test_scripts(tiny_tokenizer):
    w = ConversationWorkload(num_users=3, turns=4, first_len="20", message_len="5:9", output_len="6",
                             think_time="0.5:1.5", seed=3, token_ids=True)
    scripts = w.build(tiny_tokenizer)
    assert len(scripts) == 3 and all(s.turns == 4 for s in scripts) and w.num_requests == 12
    assert all(len(s.messages[0]) == 20 and all(5 <= len(m) <= 9 for m in s.messages[1:]) for s in scripts)
    assert all(0.5 <= t <= 1.5 for s in scripts for t in s.think_s) and scripts[0].max_tokens == [6] * 4
    again = ConversationWorkload(**{**w.model_dump(), "salt": 1}).build(tiny_tokenizer)
    assert [len(m) for m in again[0].messages] == [len(m) for m in scripts[0].messages]  # same lengths
    assert again[0].messages != scripts[0].messages  # other tokens


@pytest.mark.parametrize("text, want", [("2", (2.0, 2.0)), ("0", (0.0, 0.0)), ("0.5:3", (0.5, 3.0)), ("1s", (1.0, 1.0))])
def test_think_time(text, want):
    assert parse_think_time(text) == want


@pytest.mark.parametrize("text", ["fast", "3:1", "-1"])
def test_bad_think_time(text):
    with pytest.raises(LlmoptError, match="think time"):
        parse_think_time(text)


def test_in_process_conversations(tiny_llama, tmp_path, monkeypatch, capsys):
    code, out, err = run_bench_cli(monkeypatch, capsys, "--model", str(tiny_llama), *TINY, "--workload", "conversation",
                                   "--users", "2", "--turns", "3", "--input-len", "16", "--message-len", "4",
                                   "--output-len", "4", "--think-time", "0.05", "--json", str(tmp_path / "c.json"),
                                   "--markdown", str(tmp_path / "c.md"))
    assert code == 0, err
    run = load_report(tmp_path / "c.json").runs[0]
    assert run.completed == 6 and run.label == "2 users x 3 turns"
    # each turn resends the history: prompt + the 4 answer tokens + a 4-token message
    assert [t.prompt_tokens_mean for t in run.turns] == [16, 24, 32]
    assert all(t.completed == 2 and t.ttft_ms.p50 > 0 for t in run.turns)
    # later turns find the earlier prompt (and answer) blocks in the prefix cache
    assert run.server_metrics.prefix_cache_hits >= 2 * 16 and run.server_metrics.prefix_cache_hit_rate > 0.2
    assert "TTFT per turn" in out and "prefix cache hit rate:" in out
    assert "| 3 | 2 | 0 | 32 |" in (tmp_path / "c.md").read_text()


def test_http_conversations_resend_the_answers(fake_server, tiny_llama, tmp_path, monkeypatch, capsys):
    fake_server.bodies.clear()
    code, out, err = run_bench_cli(monkeypatch, capsys, "--url", fake_server.url, "--tokenizer", str(tiny_llama),
                                   "--workload", "conversation", "--users", "2", "--turns", "3", "--input-len", "8",
                                   "--message-len", "3", "--output-len", "2", "--think-time", "0", "--warmup", "0",
                                   "--json", str(tmp_path / "h.json"), "--no-progress")
    assert code == 0, err
    run = load_report(tmp_path / "h.json").runs[0]
    assert [t.completed for t in run.turns] == [2, 2, 2]
    assert run.server_metrics.prefix_cache_hit_rate == pytest.approx(0.6)  # the server's own counters
    third = [b["messages"] for b in fake_server.bodies if len(b["messages"]) == 5]  # the test request has 1
    assert len(third) == 2  # user, assistant, user, assistant, user
    assert [m["role"] for m in third[0]] == ["user", "assistant", "user", "assistant", "user"]
    assert third[0][1]["content"] == "abab"  # the answer the server streamed, sent back as history


def test_hit_rate_is_na_without_counters():
    run = BenchRun.model_validate({
        "label": "x", "completed": 1, "failed": 0, "total_input_tokens": 1, "total_output_tokens": 1,
        "duration_s": 1.0, "request_throughput": 1.0, "output_throughput": 1.0, "total_throughput": 2.0,
        "ttft_ms": {}, "tpot_ms": {}, "itl_ms": {}, "e2el_ms": {}, "server_metrics": None,
        "turns": [{"turn": 0, "completed": 1, "failed": 0, "ttft_ms": {"count": 1, "p50": 5.0}}]})
    console = Console(width=200, record=True)
    render_turns(run, console)
    assert "prefix cache hit rate: n/a (the target exports no prefix-cache counters)" in console.export_text()


def test_conversations_against_llmopt_serve(tiny_llama, tmp_path):
    """The hit rate comes from `llmopt serve`'s Prometheus counters (llmopt:prefix_cache_*)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = subprocess_env()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "llmopt", "serve", str(tiny_llama), "--port", str(port),
                               "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "16MiB"],
                              cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llmopt serve did not become healthy in 90 s"
            time.sleep(0.3)
        p = subprocess.run([sys.executable, "-m", "llmopt", "bench", "--url", url, "--tokenizer", str(tiny_llama),
                            "--workload", "conversation", "--users", "2", "--turns", "3", "--input-len", "40",
                            "--message-len", "8", "--output-len", "8", "--think-time", "0.1", "--json", "c.json",
                            "--no-progress"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        run = load_report(tmp_path / "c.json").runs[0]
        assert [t.completed for t in run.turns] == [2, 2, 2]
        assert run.turns[2].prompt_tokens_mean > run.turns[0].prompt_tokens_mean
        assert run.server_metrics.prefix_cache_hit_rate > 0.2
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.mark.parametrize("args, needle", [
    (["--workload", "conversation", "--num-prompts", "4"], "drop --num-prompts"),
    (["--workload", "conversation", "--concurrency", "2"], "load is its users"),
    (["--workload", "conversation", "--users", "0"], "--users must be at least 1"),
    (["--workload", "conversation", "--turns", "0"], "--turns must be at least 1"),
    (["--workload", "conversation", "--think-time", "soon"], "cannot parse think time"),
    (["--workload", "conversation", "--message-len", "0"], "token length must be at least 1"),
    (["--users", "3"], "apply to --workload conversation, not random"),
    (["--workload", "conversation", "--scenario", "static-vs-continuous"], "static batches need independent"),
])
def test_bad_conversation_flags_exit_2(args, needle, monkeypatch, capsys):
    code, out, err = run_bench_cli(monkeypatch, capsys, *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
