"""echo, prompt logprobs, logit_bias and best_of through a real server on the tiny model (fp32).

Prompt logprobs come from the engine's prefill; they must equal teacher-forced scoring
(`llmopt.engine.scoring.token_logprobs`, what `llmopt eval` uses) of the same tokens in process, and
lm-eval's own response parser must read them as it reads vLLM's.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from llmopt import LLM, SamplingParams
from llmopt.engine.scoring import token_logprobs
from llmopt.eval.loglikelihood import score_continuations
from tests.serve._server import MODEL_NAME

TOL = 1e-5


@pytest.fixture(scope="module")
def ref(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", device="cpu", kv_cache_memory="8MiB", num_threads=1)


def post(server, body: dict, path: str = "/completions") -> dict:
    r = httpx.post(server.v1 + path, json={"model": MODEL_NAME, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_max_tokens_0_scores_the_prompt_like_llmopt_eval(server, ref):
    """lm-eval's request: echo, max_tokens 0, logprobs 1, temperature 0."""
    prompt = "Paged attention keeps the KV cache in blocks"
    ids = ref.get_tokenizer().encode(prompt)
    r = post(server, {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0})
    c = r["choices"][0]
    assert c["text"] == prompt and c["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                          "prompt_tokens_details": {"cached_tokens": 0}}
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) \
        == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # no context for the first token
    assert lp["tokens"] == [ref.get_tokenizer().decode([t]) for t in ids]
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == prompt
    expected = token_logprobs(ref.engine, [ids])[0].tolist()
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=TOL)
    for tok, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert top[tok] == v and 1 <= len(top) <= 2  # the best token, plus this one when it is not the best
        assert max(top.values()) >= v


def test_echo_with_generation_prepends_the_prompt_to_text_and_logprobs(server):
    prompt = "def add(a, b):"
    plain = post(server, {"prompt": prompt, "max_tokens": 5, "logprobs": 2, "temperature": 0, "ignore_eos": True})
    echo = post(server, {"prompt": prompt, "max_tokens": 5, "logprobs": 2, "temperature": 0, "ignore_eos": True,
                         "echo": True})
    pc, ec = plain["choices"][0], echo["choices"][0]
    assert ec["text"] == prompt + pc["text"]
    n = len(echo["choices"][0]["logprobs"]["tokens"]) - len(pc["logprobs"]["tokens"])
    assert n == plain["usage"]["prompt_tokens"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert ec["logprobs"][key][n:] == pc["logprobs"][key]
    assert all(2 <= len(t) <= 3 for t in ec["logprobs"]["top_logprobs"][1:n])
    offsets = ec["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[n] == len("".join(ec["logprobs"]["tokens"][:n]))
    assert echo["usage"]["completion_tokens"] == 5
    bare = post(server, {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "echo": True})
    assert bare["choices"][0]["text"] == ec["text"] and bare["choices"][0]["logprobs"] is None


def test_echo_of_token_prompts_in_a_batch_as_lm_eval_sends_and_parses_them(server, ref, tiny_llama):
    """lm-eval's local-completions payload (echo, logprobs 1, max_tokens 1, a batch of token-id prompts),
    read by lm-eval's own parser, gives llmopt eval's log-likelihoods and greediness."""
    lm_eval = pytest.importorskip("lm_eval.models.openai_completions")
    tok = ref.get_tokenizer()
    pairs = [("Question: what stores keys and values?\nAnswer:", " the KV cache"),
             ("The capital of France is", " Paris"), ("1 2 3 4", " 5")]
    encoded = [(tok.encode(c), tok.encode(c + x)[len(tok.encode(c)):]) for c, x in pairs]
    api = lm_eval.LocalCompletionsAPI.__new__(lm_eval.LocalCompletionsAPI)
    api.model = MODEL_NAME
    for max_tokens in (1, 0):
        payload = api._create_payload([c + x for c, x in encoded], generate=False, seed=1234)
        payload["max_tokens"] = max_tokens  # older lm-eval versions sent 0
        r = httpx.post(server.v1 + "/completions", json=payload, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
        if max_tokens == 1:
            got = lm_eval.LocalCompletionsAPI.parse_logprobs(body, ctxlens=[len(c) for c, _ in encoded])
            want = score_continuations(ref.engine, pairs)
            for (lp, greedy), w in zip(got, want, strict=True):
                assert lp == pytest.approx(w.logprob, abs=1e-4)
                assert greedy == w.is_greedy
        for ch, (c, x) in zip(body["choices"], encoded, strict=True):
            lps = ch["logprobs"]["token_logprobs"]
            assert len(lps) == len(c) + len(x) + max_tokens and lps[0] is None
            assert ch["text"].startswith(tok.decode(c + x))


def test_echo_streams_the_prompt_in_the_first_chunk(server):
    body = {"prompt": "Continuous batching", "max_tokens": 6, "logprobs": 1, "temperature": 0, "ignore_eos": True,
            "echo": True}
    whole = post(server, body)["choices"][0]
    for extra in ({}, {"max_tokens": 0}):
        req = {"model": MODEL_NAME, **body, **extra, "stream": True}
        with httpx.stream("POST", server.v1 + "/completions", json=req, timeout=60) as r:
            assert r.status_code == 200
            events = [json.loads(e[6:]) for e in r.read().decode().split("\n\n") if e and e != "data: [DONE]"]
        choices = [e["choices"][0] for e in events]
        text = "".join(c["text"] for c in choices)
        tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
        offsets = [t for c in choices for t in c["logprobs"]["text_offset"]]
        lps = [t for c in choices for t in c["logprobs"]["token_logprobs"]]
        if extra:  # the prompt only
            n = len(tokens)
            assert text == "Continuous batching" and choices[-1]["finish_reason"] == "length"
            assert tokens == whole["logprobs"]["tokens"][:n] and lps == whole["logprobs"]["token_logprobs"][:n]
        else:
            assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]
            assert offsets == whole["logprobs"]["text_offset"] and lps == whole["logprobs"]["token_logprobs"]


def test_prompt_logprobs_extension_on_completions_and_chat(server, ref):
    prompt = "A KV cache stores"
    ids = ref.get_tokenizer().encode(prompt)
    r = post(server, {"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3})
    plp = r["choices"][0]["prompt_logprobs"]
    assert r["choices"][0]["logprobs"] is None and r["usage"]["completion_tokens"] == 2
    expected = token_logprobs(ref.engine, [ids])[0].tolist()
    assert plp[0] is None and len(plp) == len(ids)
    for i, entry in enumerate(plp[1:], start=1):
        mine = entry[str(ids[i])]
        assert mine["logprob"] == pytest.approx(expected[i - 1], abs=TOL)
        assert mine["decoded_token"] == ref.get_tokenizer().decode([ids[i]])
        assert sorted(e["rank"] for e in entry.values())[:3] == [1, 2, 3] and len(entry) in (3, 4)
    # chat: one list for the request, at the top level, over the chat template's tokens
    msgs = [{"role": "user", "content": "hi there"}]
    chat = post(server, {"messages": msgs, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0},
                "/chat/completions")
    tokenized = httpx.post(server.base_url + "/tokenize", json={"messages": msgs}, timeout=30).json()
    cids = tokenized["tokens"]
    assert chat["usage"]["prompt_tokens"] == tokenized["count"] == len(chat["prompt_logprobs"])
    expected = token_logprobs(ref.engine, [cids])[0].tolist()
    got = [e[str(t)]["logprob"] for e, t in zip(chat["prompt_logprobs"][1:], cids[1:], strict=True)]
    assert chat["prompt_logprobs"][0] is None and got == pytest.approx(expected, abs=TOL)
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # top 0: the token itself only
    assert "prompt_logprobs" not in post(server, {"messages": msgs, "max_tokens": 1}, "/chat/completions")


def test_logit_bias_forces_and_bans_in_a_mixed_concurrent_batch(server, ref):
    prompts = ["Continuous batching", "def add(a, b):", "A KV cache stores", "Quantization trades"]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    base = [o.outputs[0] for o in ref.generate(prompts, greedy)]
    forced = 42 if base[0].token_ids != [42] * 4 else 43
    banned = base[1].token_ids[0]
    biased = [{"logit_bias": {str(forced): 100}}, {"logit_bias": {str(banned): -100}}, {}, {"logit_bias": {}}]

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(*(c.post(server.v1 + "/completions", json={
                "model": MODEL_NAME, "prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **b})
                for p, b in zip(prompts, biased, strict=True)))
        return [r.json()["choices"][0]["text"] for r in rs]

    out = asyncio.run(main())
    piece = httpx.post(server.base_url + "/detokenize", json={"tokens": [forced]}).json()["prompt"]
    assert out[0] == piece * 4
    biased_ref = ref.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                          logit_bias={banned: -100.0}))[0].outputs[0]
    assert banned not in biased_ref.token_ids and out[1] == biased_ref.text != base[1].text
    assert out[2:] == [b.text for b in base[2:]]  # unbiased neighbours in the same batch are unchanged
    chat = post(server, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
                         "logit_bias": {str(forced): 100}, "ignore_eos": True}, "/chat/completions")
    assert chat["choices"][0]["message"]["content"] == piece * 3


def test_best_of_returns_the_n_most_likely_of_best_of_samples(server):
    common = {"prompt": "The quick brown", "max_tokens": 5, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    all4 = post(server, {**common, "n": 4, "logprobs": 0})
    scores = [(sum(c["logprobs"]["token_logprobs"]), c["text"]) for c in all4["choices"]]
    best = post(server, {**common, "n": 2, "best_of": 4})
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert [c["text"] for c in best["choices"]] == [t for _, t in sorted(scores, key=lambda s: -s[0])[:2]]
    assert all(c["logprobs"] is None for c in best["choices"])  # not asked for: not returned
    assert best["usage"]["completion_tokens"] == 4 * 5  # every generated completion costs
    with_lp = post(server, {**common, "n": 1, "best_of": 4, "logprobs": 1, "prompt": ["The quick brown", "Hi"]})
    assert len(with_lp["choices"]) == 2 and with_lp["choices"][0]["text"] == best["choices"][0]["text"]
    assert all(len(c["logprobs"]["tokens"]) == 5 for c in with_lp["choices"])
    same = post(server, {**common, "n": 2, "best_of": 2})
    assert len(same["choices"]) == 2
