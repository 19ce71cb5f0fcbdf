"""On the real SmolLM2-135M: greedy text over HTTP (completions and chat) equals `LLM.generate`/`LLM.chat`."""

from __future__ import annotations

import openai
import pytest

from llmopt import LLM, SamplingParams
from tests.conftest import requires_smollm2
from tests.serve._server import MODEL_NAME, serve

pytestmark = [pytest.mark.slow, requires_smollm2]


def test_greedy_http_equals_llm_on_smollm2():
    engine_kw = {"model": "smollm2-135m", "kv_cache_memory": "64MiB", "num_threads": None}
    llm = LLM("smollm2-135m", dtype="float32", device="cpu", kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0, max_tokens=32)
    prompt = "The capital of France is"
    msgs = [{"role": "user", "content": "What is a KV cache, in one sentence?"}]
    ref = llm.generate(prompt, params)[0].outputs[0]
    ref_chat = llm.chat(msgs, params)[0].outputs[0]
    del llm
    with serve(None, engine_kw=engine_kw) as srv:
        c = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=120)
        got = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=32, temperature=0)
        assert got.choices[0].text == ref.text
        assert got.usage.completion_tokens == len(ref.token_ids)
        assert got.choices[0].finish_reason == ref.finish_reason
        chat = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=32, temperature=0,
                                         stream=True)
        text = "".join(ch.choices[0].delta.content or "" for ch in chat if ch.choices)
        assert text == ref_chat.text and text.strip()
