"""vLLM's /tokenize and /detokenize on a real server: the same ids the completions endpoints use."""

from __future__ import annotations

import httpx
import pytest

from tests.serve._server import MODEL_NAME
from tests.serve.test_errors import assert_openai_error


def tok(server, body, path: str = "/tokenize") -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=30)


def test_tokenize_a_prompt_and_detokenize_it_back(server, tiny_llama):
    from llmopt.models.tokenizer import load_tokenizer

    hf = load_tokenizer(tiny_llama)
    r = tok(server, {"model": MODEL_NAME, "prompt": "Hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens"}
    assert body["tokens"] == hf.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.state.prompts.max_model_len
    # the completions endpoint counts the same tokens
    c = httpx.post(server.v1 + "/completions", json={"prompt": "Hello world", "max_tokens": 1}, timeout=30).json()
    assert c["usage"]["prompt_tokens"] == body["count"]
    assert tok(server, {"tokens": body["tokens"]}, "/detokenize").json() == {"prompt": "Hello world"}
    assert tok(server, {"prompt": "Hello", "add_special_tokens": False}).json()["tokens"] == \
        hf.encode("Hello", add_special_tokens=False)
    assert tok(server, {"prompt": ""}).json()["count"] == len(hf.encode(""))
    strs = tok(server, {"prompt": "Hello world", "return_token_strs": True}).json()["token_strs"]
    assert strs == hf.convert_ids_to_tokens(body["tokens"])
    assert tok(server, {"tokens": []}, "/detokenize").json() == {"prompt": ""}


def test_tokenize_messages_is_the_chat_prompt(server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    r = tok(server, {"messages": msgs})
    assert r.status_code == 200, r.text
    chat = httpx.post(server.v1 + "/chat/completions", json={"messages": msgs, "max_tokens": 1}, timeout=30).json()
    assert chat["usage"]["prompt_tokens"] == r.json()["count"]
    without = tok(server, {"messages": msgs, "add_generation_prompt": False}).json()
    assert without["count"] < r.json()["count"]
    assert r.json()["tokens"][:without["count"]] == without["tokens"]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user"}]}, None),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes please"}, "add_special_tokens"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {"tokens": [10**6]}, "tokens"),  # outside the vocabulary
    ("/detokenize", {"tokens": [2**64]}, "tokens"),
])
def test_bad_tokenizer_requests_are_one_line_400s(server, path, body, param):
    err = assert_openai_error(tok(server, body, path), 400)
    assert "\n" not in err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param)


def test_unknown_model_is_404_and_lone_surrogates_400(server):
    assert_openai_error(tok(server, {"model": "gpt-9", "prompt": "a"}), 404, param="model", code="model_not_found")
    assert_openai_error(tok(server, {"model": "gpt-9", "tokens": [1]}, "/detokenize"), 404, param="model")
    r = httpx.post(server.base_url + "/tokenize", content=b'{"prompt": "a\\ud800"}',
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 400, code="invalid_unicode")
    assert httpx.get(server.base_url + "/health").status_code == 200
