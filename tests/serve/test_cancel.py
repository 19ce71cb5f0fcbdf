"""Client disconnects abort the engine request (KV freed); the server-side deadline ends with "timeout"."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.serve._server import MODEL_NAME, serve

LONG = {"model": MODEL_NAME, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(tiny_llama):
    # no prefix caching: freed blocks then count as free at once, whatever the cache would keep
    with serve(tiny_llama, engine_kw={"enable_prefix_caching": False}) as s:
        yield s


def poll_metrics(srv, cond, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = srv.metrics()
        if cond(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics never satisfied the condition: {m}")
        time.sleep(0.02)


def idle(m: dict[str, float]) -> bool:
    return m["llmopt:kv_cache_usage_perc"] == 0 and m["llmopt:num_requests_running"] == 0


def test_closing_a_stream_frees_its_kv_blocks(srv):
    before = srv.metrics()["llmopt:request_success_total{finished_reason=abort}"]
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", srv.v1 + "/completions", json={**LONG, "prompt": [5] * 300, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # (breaking out of a for loop over it would close the connection)
            got = 0
            while got < 3:
                got += next(lines).startswith("data: ")
            busy = srv.metrics()
            assert busy["llmopt:kv_cache_usage_perc"] > 0 and busy["llmopt:num_requests_running"] == 1
        # leaving the block closes the response; closing the client closes the socket
    m = poll_metrics(srv, lambda m: idle(m) and
                     m["llmopt:request_success_total{finished_reason=abort}"] == before + 1)
    assert m["llmopt:generation_tokens_total"] < 1000  # stopped long before max_tokens
    assert not srv.state.engine_loop.active
    assert srv.state.admission.waiting == 0 and srv.state.admission.queued_tokens == 0


def test_a_non_streaming_client_that_leaves_aborts_too(srv):
    before = srv.metrics()["llmopt:request_success_total{finished_reason=abort}"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.v1 + "/chat/completions", timeout=httpx.Timeout(30, read=0.3),
                   json={**LONG, "messages": [{"role": "user", "content": "tell me everything"}]})
    poll_metrics(srv, lambda m: idle(m) and m["llmopt:request_success_total{finished_reason=abort}"] == before + 1)
    assert not srv.state.engine_loop.active


def test_server_side_deadline_finishes_with_timeout(tiny_llama):
    with serve(tiny_llama, request_timeout_s=0.25) as s:
        t0 = time.monotonic()
        r = httpx.post(s.v1 + "/completions", json={**LONG, "prompt": "Continuous batching"}, timeout=30).json()
        took = time.monotonic() - t0
        assert r["choices"][0]["finish_reason"] == "timeout"
        assert 0 < r["usage"]["completion_tokens"] < 1000
        assert took < 5
        with httpx.stream("POST", s.v1 + "/chat/completions", timeout=30, json={
                **LONG, "messages": [{"role": "user", "content": "hi"}], "stream": True}) as st:
            raw = st.read().decode()
        assert '"finish_reason": "timeout"' in raw and raw.rstrip().endswith("data: [DONE]")
        m = poll_metrics(s, idle)
        assert m["llmopt:request_success_total{finished_reason=timeout}"] == 2
