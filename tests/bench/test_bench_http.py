"""The streaming HTTP client against a real tiny server on 127.0.0.1 (see conftest.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from scripted_sse_server import TOKEN_DELAY, TTFT_DELAY, USAGE_PROMPT_TOKENS

from llmopt.bench.http_target import (
    HttpTarget,
    HttpTargetConfig,
    MetricsSnapshot,
    SseParser,
    check_reachable,
    diff_metrics,
    normalize_base_url,
    scrape_metrics,
)
from llmopt.bench.load import LoadPattern, run_load
from llmopt.bench.metrics import compute_metrics
from llmopt.bench.workloads import BenchRequest
from llmopt.errors import LlmoptError


def _send(url: str, req: BenchRequest, **cfg):
    async def main():
        async with HttpTarget(HttpTargetConfig(base_url=url, **cfg)) as t:
            return await t.send(req), t

    return asyncio.run(main())


# ------------------------------------------------------------------------------------------------ SSE


def test_sse_parser_framing():
    p = SseParser()
    assert p.feed('data: {"a"') == []
    assert p.feed(': 1}\n') == []  # a data line is not an event until the blank line
    assert p.feed("\n") == ['{"a": 1}']
    assert p.feed(": ping\r\n\r\ndata:x\r\ndata: y\r\n\r") == []  # the trailing CR may be half of CRLF
    assert p.feed("\nevent: e\ndata: [DONE]\n\n") == ["x\ny", "[DONE]"]
    assert p.feed("data: tail") == []
    assert p.flush() == ["tail"]


def test_normalize_base_url():
    assert normalize_base_url("localhost:8000/v1/") == "http://localhost:8000"
    assert normalize_base_url("https://h/x/") == "https://h/x"
    with pytest.raises(LlmoptError):
        normalize_base_url(" ")


# -------------------------------------------------------------------------------------------- streams


def test_completions_stream_is_timed_per_chunk(fake_server):
    req = BenchRequest(prompt="hello", max_tokens=4, expected_prompt_tokens=2)
    rec, target = _send(fake_server.url, req)
    assert rec.success, rec.error
    assert len(rec.token_times) == 4 and rec.chunk_token_counts == [1, 1, 1, 1]
    assert rec.output_tokens == 4 and rec.prompt_tokens == USAGE_PROMPT_TOKENS  # from the usage block
    assert rec.ttft >= TTFT_DELAY * 0.9
    # the server paces chunks TOKEN_DELAY apart; individual gaps jitter on a busy machine, the total cannot
    assert rec.e2el >= (TTFT_DELAY + 3 * TOKEN_DELAY) * 0.95
    assert len(rec.itls) == 3 and sum(rec.itls) == pytest.approx(rec.end - rec.first_token)
    assert rec.end == rec.token_times[-1]
    body = fake_server.bodies[-1]
    assert body["prompt"] == "hello" and body["model"] == "tiny" and body["max_tokens"] == 4
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0
    assert body["ignore_eos"] is True  # auto: the server says it is llmopt's
    assert target.owned_by == "llmopt"


def test_ignore_eos_only_when_asked(fake_server):
    _send(fake_server.url, BenchRequest(prompt="x", max_tokens=1), send_ignore_eos=False)
    assert "ignore_eos" not in fake_server.bodies[-1]


def test_chat_role_chunk_is_not_a_token(fake_server):
    msgs = [{"role": "user", "content": "hi"}]
    rec, _ = _send(fake_server.url, BenchRequest(prompt=msgs, max_tokens=3))
    assert rec.success and len(rec.token_times) == 3
    assert rec.ttft >= TTFT_DELAY * 0.9  # the early role-only delta did not count as the first token
    assert fake_server.bodies[-1]["messages"] == msgs
    rec, _ = _send(fake_server.url, BenchRequest(prompt="plain text", max_tokens=2), endpoint="chat")
    assert rec.success and fake_server.bodies[-1]["messages"] == [{"role": "user", "content": "plain text"}]


def test_multi_token_chunks_with_continuous_usage(fake_server):
    rec, _ = _send(fake_server.url, BenchRequest(prompt="x", max_tokens=5), model="multi")
    assert rec.chunk_token_counts == [2, 2, 1] and rec.output_tokens == 5
    assert rec.tpot == pytest.approx((rec.e2el - rec.ttft) / 4)


def test_without_usage_chunks_are_counted(fake_server):
    rec, _ = _send(fake_server.url, BenchRequest(prompt="x", max_tokens=3, expected_prompt_tokens=11),
                   model="nousage")
    assert rec.success and rec.output_tokens == 3 and rec.prompt_tokens == 11


@pytest.mark.parametrize("model,code,needle", [
    ("err500", "http_500", "engine exploded"),
    ("midstream_error", "stream_error", "out of KV cache"),
    ("garbage", "bad_response", "not JSON"),
])
def test_server_failures_become_failed_records(fake_server, model, code, needle):
    rec, _ = _send(fake_server.url, BenchRequest(prompt="x", max_tokens=3), model=model)
    assert not rec.success and rec.error_code == code and needle in rec.error


def test_timeout_is_a_failed_record(fake_server):
    t0 = time.perf_counter()
    rec, _ = _send(fake_server.url, BenchRequest(prompt="x", max_tokens=2), model="slow", timeout_s=0.3)
    assert rec.error_code == "timeout" and time.perf_counter() - t0 < 3


def test_a_request_the_server_closed_the_connection_on_is_resent_once(fake_server):
    """llama-server closes keep-alive connections the client may already have put a request on: that
    request never reached the server, so it is resent once (not counted as a failure), but never twice."""
    fake_server.dropped = 0
    n = len(fake_server.bodies)
    rec, _ = _send(fake_server.url, BenchRequest(prompt="x", max_tokens=2), model="drop_once")
    assert rec.success, rec.error
    assert fake_server.dropped == 1 and len(fake_server.bodies) == n + 2 and rec.output_tokens == 2
    rec, _ = _send(fake_server.url, BenchRequest(prompt="x", max_tokens=2), model="drop_always")
    assert not rec.success and rec.error_code == "protocol_error" and "without sending a response" in rec.error
    assert fake_server.dropped == 3  # the first attempt and one resend


def test_connection_refused_is_a_failed_record(closed_port):
    rec, _ = _send(f"http://127.0.0.1:{closed_port}", BenchRequest(prompt="x", max_tokens=2), model="m")
    assert not rec.success and rec.error_code == "connect_error"


def test_endpoint_mismatch_is_a_user_error(fake_server):
    target = HttpTarget(HttpTargetConfig(base_url=fake_server.url, endpoint="chat"))
    with pytest.raises(LlmoptError, match="token-id prompts"):
        target.validate_requests([BenchRequest(prompt=[1, 2], max_tokens=1)])
    asyncio.run(target.aclose())


def test_end_to_end_run_against_the_server(fake_server):
    reqs = [BenchRequest(prompt=f"p{i}", max_tokens=3) for i in range(8)]

    async def main():
        async with HttpTarget(HttpTargetConfig(base_url=fake_server.url)) as t:
            before = await scrape_metrics(fake_server.url)
            res = await run_load(t.send, reqs, LoadPattern(concurrency=4), progress=False)
            after = await scrape_metrics(fake_server.url)
            return res, diff_metrics(before, after)

    res, server = asyncio.run(main())
    m = compute_metrics(res.records, res.duration_s)
    assert m.completed == 8 and m.failed == 0
    assert m.total_output_tokens == 24 and m.total_input_tokens == 8 * USAGE_PROMPT_TOKENS
    assert m.peak_concurrency == 4
    assert m.ttft_ms.p50 >= TTFT_DELAY * 900
    assert server is not None
    assert server.prefix_cache_queries == 80 and server.prefix_cache_hits == 48
    assert server.prefix_cache_hit_rate == pytest.approx(0.6)
    assert server.spec_decode_acceptance_rate is None and server.preemptions is None


# ----------------------------------------------------------------------------------- reachability


def test_check_reachable(fake_server, closed_port):
    check_reachable(fake_server.url)
    t0 = time.perf_counter()
    with pytest.raises(LlmoptError) as e:
        check_reachable(f"http://127.0.0.1:{closed_port}")
    assert str(e.value) == f"cannot reach http://127.0.0.1:{closed_port}: connection refused"
    assert time.perf_counter() - t0 < 2


# ------------------------------------------------------------------------------------ Prometheus


def test_scrape_without_metrics_endpoint(closed_port):
    assert asyncio.run(scrape_metrics(f"http://127.0.0.1:{closed_port}")) is None
    assert diff_metrics(None, MetricsSnapshot(values={}, taken_at=0)) is None


def test_diff_metrics_vllm_names_and_edge_cases():
    before = MetricsSnapshot(taken_at=0, values={
        "vllm:prefix_cache_queries_total": 1000, "vllm:prefix_cache_hits_total": 200,
        "vllm:spec_decode_num_drafts_total": 10, "vllm:spec_decode_num_draft_tokens_total": 30,
        "vllm:num_preemptions_total": 5, "vllm:num_requests_running": 3,
    })
    after = MetricsSnapshot(taken_at=1, values={
        "vllm:prefix_cache_queries_total": 1400, "vllm:prefix_cache_hits_total": 500,
        "vllm:spec_decode_num_drafts_total": 110, "vllm:spec_decode_num_draft_tokens_total": 330,
        "vllm:spec_decode_num_accepted_tokens_total": 150,  # appeared lazily: before counts as 0
        "vllm:num_preemptions_total": 7, "vllm:num_requests_running": 9,
    })
    d = diff_metrics(before, after)
    assert d.prefix_cache_hit_rate == pytest.approx(300 / 400)
    assert d.spec_decode_acceptance_rate == pytest.approx(150 / 300)
    assert d.spec_decode_mean_acceptance_length == pytest.approx(1 + 150 / 100)
    assert d.preemptions == 2
    assert "vllm:num_requests_running" not in d.counters  # gauges are not deltas
    assert d.counters["vllm:prefix_cache_hits_total"] == 300
    # a counter reset (server restarted mid-run) gives no number rather than a negative one
    reset = MetricsSnapshot(taken_at=2, values={"vllm:prefix_cache_queries_total": 10,
                                                "vllm:prefix_cache_hits_total": 5})
    d = diff_metrics(before, reset)
    assert d.prefix_cache_hit_rate is None and d.preemptions is None
