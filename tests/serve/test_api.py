"""The OpenAI API through the real openai client and httpx against a real uvicorn server."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

import llmopt
from llmopt import LLM, SamplingParams
from tests.serve._server import MODEL_NAME

METRIC_NAMES = [
    "llmopt:time_to_first_token_seconds", "llmopt:inter_token_latency_seconds",
    "llmopt:e2e_request_latency_seconds", "llmopt:request_queue_time_seconds", "llmopt:num_requests_running",
    "llmopt:num_requests_waiting", "llmopt:kv_cache_usage_perc", "llmopt:prefix_cache_queries",
    "llmopt:prefix_cache_hits", "llmopt:num_preemptions", "llmopt:prompt_tokens", "llmopt:generation_tokens",
    "llmopt:request_success", "llmopt:request_rejected", "llmopt:degraded",
]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


def test_health_models_and_metric_names(server):
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.base_url + "/version").json() == {"version": llmopt.__version__}  # as vLLM's
    models = client(server).models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].owned_by == "llmopt"
    text = httpx.get(server.base_url + "/metrics").text
    for name in METRIC_NAMES:  # counters carry prometheus_client's _total suffix, as vLLM's do
        assert f"# TYPE {name} " in text or f"# TYPE {name}_total counter" in text, name
    assert 'llmopt:request_success_total{finished_reason="stop",model_name="tiny"}' in text


def test_completion_stream_and_whole_agree(server):
    c = client(server)
    whole = c.completions.create(model=MODEL_NAME, prompt="Continuous batching", max_tokens=12, **GREEDY)
    assert whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    assert whole.choices[0].text.startswith(" batching")
    chunks = list(c.completions.create(model=MODEL_NAME, prompt="Continuous batching", max_tokens=12, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_stream_and_whole_agree(server):
    c = client(server)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    whole = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=10, **GREEDY)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 10
    stream = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=10, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sse_wire_format_ends_with_done(server):
    body = {"model": MODEL_NAME, "prompt": "Hello world", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all("usage" not in json.loads(e[6:]) for e in events[:-1])  # no include_usage: no usage field


def test_greedy_http_equals_llm_generate(server, tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", kv_cache_memory="8MiB", num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    c = client(server)
    for prompt in ["Continuous batching", "def add(a, b):", "A KV cache stores"]:
        ref = llm.generate(prompt, params)[0].outputs[0]
        got = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, logprobs=0, **GREEDY)
        assert got.choices[0].text == ref.text
        assert len(got.choices[0].logprobs.tokens) == len(ref.token_ids)
    msgs = [{"role": "user", "content": "Quantization trades"}]
    ref_chat = llm.chat(msgs, params)[0].outputs[0].text
    got_chat = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=24, **GREEDY)
    assert got_chat.choices[0].message.content == ref_chat


def test_n_seed_logprobs_and_token_prompts(server):
    c = client(server)
    kw = dict(model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=6, n=3, temperature=1.0, seed=11, logprobs=2,
              extra_body={"ignore_eos": True})
    a = c.completions.create(**kw)
    b = c.completions.create(**kw)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]  # seeded: reproducible
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset[0] == 0
    assert a.usage.completion_tokens == 18 and a.usage.prompt_tokens == 4
    chat = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy picks the best


def test_batch_of_prompts_index_choices(server):
    r = httpx.post(server.v1 + "/completions", json={
        "model": MODEL_NAME, "prompt": ["Continuous batching", "def add(a, b):"], "n": 2, "max_tokens": 5,
        "temperature": 0, "ignore_eos": True}, timeout=30).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["choices"][0]["text"] == r["choices"][1]["text"]  # greedy: both samples of prompt 0 agree
    assert r["choices"][0]["text"].startswith(" batching") and r["choices"][2]["text"].startswith("):")
    assert r["usage"]["completion_tokens"] == 20


def test_stop_strings_min_tokens_and_max_tokens_cap(server):
    c = client(server)
    r = c.completions.create(model=MODEL_NAME, prompt="def add(a, b):", max_tokens=20, stop=["ququ"], **GREEDY)
    assert r.choices[0].text == "):" and r.choices[0].finish_reason == "stop"
    # the default max_tokens of chat is "up to max_model_len"; an explicit huge one is capped, not refused
    big = httpx.post(server.v1 + "/completions", json={
        "model": MODEL_NAME, "prompt": [1] * 1000, "max_tokens": 10**9, "temperature": 0, "ignore_eos": True,
        "min_tokens": 3}, timeout=60).json()
    assert big["usage"]["completion_tokens"] == server.state.prompts.max_model_len - 1000
    assert big["choices"][0]["finish_reason"] == "length"


def test_32_concurrent_streams_complete(server):
    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await c.completions.create(model=MODEL_NAME, prompt=f"Request {i}: the quick", max_tokens=16,
                                            stream=True, stream_options={"include_usage": True}, **GREEDY)
        text, usage = "", None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].text
            if ch.usage:
                usage = ch.usage.completion_tokens
        return text, usage

    async def main():
        c = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(c, i) for i in range(32)))
        finally:
            await c.close()

    results = asyncio.run(main())
    assert len(results) == 32 and all(u == 16 for _, u in results)
    m = server.metrics()
    assert m["llmopt:request_success_total{finished_reason=length}"] >= 32
    assert m["llmopt:generation_tokens_total"] >= 32 * 16
    assert m["llmopt:time_to_first_token_seconds_count"] >= 32


def test_llmopt_bench_client_streams_from_our_server(server):
    from llmopt.bench.http_target import HttpTarget, HttpTargetConfig, diff_metrics, scrape_metrics
    from llmopt.bench.workloads import BenchRequest

    async def main():
        before = await scrape_metrics(server.base_url)
        async with HttpTarget(HttpTargetConfig(base_url=server.base_url)) as target:
            assert target.send_ignore_eos and target.model == MODEL_NAME  # owned_by: llmopt
            records = [await target.send(BenchRequest(prompt=p, max_tokens=12))
                       for p in ("The quick brown", [5, 6, 7], [{"role": "user", "content": "hi"}])]
        return records, diff_metrics(before, await scrape_metrics(server.base_url))

    records, server_metrics = asyncio.run(main())
    for rec in records:
        assert rec.success, rec.error
        assert rec.output_tokens == 12 and rec.first_token is not None
    assert server_metrics.counters["llmopt:generation_tokens_total"] >= 36


def test_speculative_serving_exports_spec_decode_metrics(tiny_llama):
    """`--speculative ngram`: greedy text is unchanged and the spec_decode counters move."""
    import httpx

    from llmopt import LLM, SamplingParams
    from tests.serve._server import MODEL_NAME, serve

    prompt = "the KV cache stores keys and values " * 6
    ref = LLM(str(tiny_llama), dtype="float32").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0].text
    with serve(tiny_llama, engine_kw={"speculative": {"method": "ngram"}}) as srv:
        r = httpx.post(srv.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt,
                                                               "max_tokens": 24, "temperature": 0,
                                                               "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref
        metrics = httpx.get(srv.base_url + "/metrics").text
    drafted = [ln for ln in metrics.splitlines() if ln.startswith("llmopt:spec_decode_num_draft_tokens_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0
