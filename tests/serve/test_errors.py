"""Every malformed request gets a 4xx in OpenAI's error shape, and the server stays up."""

from __future__ import annotations

import socket

import httpx
import openai
import pytest

from tests.serve._server import MODEL_NAME, serve

OK_COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}


def assert_openai_error(r: httpx.Response, status: int, param: str | None = "?", code: str | None = "?") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "?":
        assert err["param"] == param
    if code != "?":
        assert err["code"] == code
    return err


def post(server, path: str, body=None, **kw) -> httpx.Response:
    return httpx.post(server.v1 + path, json=body, timeout=30, **kw)


def raw(server, path: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.v1 + path, content=content, timeout=30,
                      headers={"content-type": "application/json", **(headers or {})})


@pytest.mark.parametrize("content", [b"{not json", b'{"prompt": "a",}', b"", b"\xff\xfe{}"])
def test_bad_json(server, content):
    err = assert_openai_error(raw(server, "/completions", content), 400)
    assert err["type"] == "invalid_request_error"


def test_invalid_utf8_inside_a_string(server):
    assert_openai_error(raw(server, "/completions", b'{"model": "tiny", "prompt": "caf\xe9"}'), 400)


def test_lone_surrogate_is_refused(server):
    r = raw(server, "/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}')
    assert_openai_error(r, 400, code="invalid_unicode")
    r = raw(server, "/chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}')
    assert_openai_error(r, 400, param="messages.0.content")


@pytest.mark.parametrize("body,param", [
    ([1, 2], None),
    ({**OK_COMPLETION, "temperature": "hot"}, "temperature"),
    ({**OK_COMPLETION, "temperature": -0.5}, "temperature"),
    ({**OK_COMPLETION, "temperature": 3}, "temperature"),
    ({**OK_COMPLETION, "max_tokens": "many"}, "max_tokens"),
    ({**OK_COMPLETION, "max_tokens": 0}, "max_tokens"),
    ({**OK_COMPLETION, "top_p": 0}, "top_p"),
    ({**OK_COMPLETION, "n": 9}, "n"),
    ({**OK_COMPLETION, "logprobs": 21}, "logprobs"),
    ({**OK_COMPLETION, "top_k": -2}, "top_k"),
    ({**OK_COMPLETION, "stop": ""}, "stop"),
    ({**OK_COMPLETION, "stream": "yes please"}, "stream"),
    ({**OK_COMPLETION, "frobnicate": 1}, "frobnicate"),
    ({**OK_COMPLETION, "prompt": [1, "a"]}, "prompt"),
    ({**OK_COMPLETION, "prompt": [-1]}, "prompt"),
    ({**OK_COMPLETION, "echo": "loudly"}, "echo"),
    ({**OK_COMPLETION, "logit_bias": {"five": 1.0}}, "logit_bias"),
    ({**OK_COMPLETION, "logit_bias": {"-5": 1.0}}, "logit_bias"),
    ({**OK_COMPLETION, "logit_bias": {"5": 100.5}}, "logit_bias"),
    ({**OK_COMPLETION, "logit_bias": {"5": -101}}, "logit_bias"),
    ({**OK_COMPLETION, "logit_bias": {"5": "up"}}, "logit_bias"),
    ({**OK_COMPLETION, "logit_bias": {"99999": 1.0}}, "logit_bias"),  # outside the vocabulary
    ({**OK_COMPLETION, "logit_bias": [5]}, "logit_bias"),
    ({**OK_COMPLETION, "logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
    ({**OK_COMPLETION, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({**OK_COMPLETION, "prompt_logprobs": -1}, "prompt_logprobs"),
    ({**OK_COMPLETION, "prompt_logprobs": 1, "stream": True}, None),
    ({**OK_COMPLETION, "max_tokens": 0, "echo": False}, "max_tokens"),
    ({**OK_COMPLETION, "max_tokens": -1, "echo": True}, "max_tokens"),
    ({**OK_COMPLETION, "best_of": 1, "n": 2}, None),
    ({**OK_COMPLETION, "best_of": 9}, "best_of"),
    ({**OK_COMPLETION, "best_of": 3, "stream": True}, None),
    ({**OK_COMPLETION, "suffix": "tail"}, None),
    ({"model": MODEL_NAME}, "prompt"),
])
def test_wrong_types_and_ranges_completions(server, body, param):
    err = assert_openai_error(post(server, "/completions", body), 400)
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param)


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL_NAME, "messages": []}, "messages"),
    ({"model": MODEL_NAME, "messages": "hello"}, "messages"),
    ({"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": MODEL_NAME, "messages": [{"role": "user"}]}, None),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content"),
    ({**OK_CHAT, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({**OK_CHAT, "top_logprobs": 2}, None),
    ({**OK_CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ({**OK_CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ({**OK_CHAT, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({**OK_CHAT, "logit_bias": {"x1": 1.0}}, "logit_bias"),
    ({**OK_CHAT, "logit_bias": {"99999": 1.0}}, "logit_bias"),
    ({**OK_CHAT, "logit_bias": {"1": float("1e3")}}, "logit_bias"),
    ({**OK_CHAT, "prompt_logprobs": 30}, "prompt_logprobs"),
    ({**OK_CHAT, "prompt_logprobs": 2, "stream": True}, None),
    ({**OK_CHAT, "echo": True}, "echo"),  # chat has no echo
    ({**OK_CHAT, "best_of": 2}, "best_of"),
])
def test_wrong_types_and_ranges_chat(server, body, param):
    err = assert_openai_error(post(server, "/chat/completions", body), 400)
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinite_numbers(server, literal):
    body = b'{"model": "tiny", "prompt": "a", "temperature": ' + literal + b"}"
    assert_openai_error(raw(server, "/completions", body), 400, param="temperature")


def test_unknown_model_is_404_and_the_openai_client_says_so(server):
    assert_openai_error(post(server, "/completions", {**OK_COMPLETION, "model": "gpt-9"}), 404, param="model",
                        code="model_not_found")
    c = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-9", messages=OK_CHAT["messages"])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model=MODEL_NAME, prompt="a", temperature=-1)


def test_empty_prompts(server):
    assert_openai_error(post(server, "/completions", {**OK_COMPLETION, "prompt": ""}), 400, param="prompt")
    assert_openai_error(post(server, "/completions", {**OK_COMPLETION, "prompt": []}), 400, param="prompt")


def test_token_ids_outside_the_vocabulary(server):
    vocab = server.state.prompts.vocab_size
    err = assert_openai_error(post(server, "/completions", {**OK_COMPLETION, "prompt": [1, vocab]}), 400)
    assert str(vocab) in err["message"]


def test_prompt_longer_than_the_context_is_400_with_the_reason(server):
    max_len = server.state.prompts.max_model_len
    err = assert_openai_error(post(server, "/completions", {**OK_COMPLETION, "prompt": [3] * max_len}), 400,
                              param="prompt", code="context_length_exceeded")
    assert f"{max_len} tokens" in err["message"]
    long_text = "the quick brown fox " * max_len
    err = assert_openai_error(post(server, "/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": long_text}]}), 400, param="messages")
    assert "maximum context length" in err["message"]


def test_oversize_body_is_413(server):
    big = b'{"model": "tiny", "prompt": "' + b"a" * (4 * 1024 * 1024 + 10) + b'"}'
    assert_openai_error(raw(server, "/completions", big), 413, code="request_too_large")

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(5):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    r = httpx.post(server.v1 + "/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=30)
    assert_openai_error(r, 413)


def test_absurd_content_length_is_refused_without_reading(server):
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000000\r\n\r\n{")
        data = b""
        while chunk := sock.recv(65536):  # the server closes the connection after answering
            data += chunk
    assert data.startswith(b"HTTP/1.1 413") and b"request_too_large" in data


def test_unknown_route_and_method(server):
    assert_openai_error(httpx.get(server.v1 + "/nothing-here"), 404)
    assert_openai_error(httpx.get(server.v1 + "/completions"), 405)


def test_harmless_fields_are_accepted(server):
    r = post(server, "/chat/completions", {**OK_CHAT, "user": "u-1", "metadata": {"k": "v"}, "store": False,
                                           "service_tier": "auto", "tool_choice": "none",
                                           "response_format": {"type": "text"}, "parallel_tool_calls": False,
                                           "max_completion_tokens": 3, "seed": 3, "presence_penalty": 0.5})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3


def test_server_survives_all_of_it(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert post(server, "/completions", OK_COMPLETION).status_code == 200
    m = server.metrics()
    assert m["llmopt:request_rejected_total{reason=too_long}"] >= 2


def test_an_engine_failure_fails_the_requests_in_flight_but_not_the_server(tiny_llama):
    with serve(tiny_llama) as srv:
        engine = srv.state.engine_loop.engine
        real_step = engine.step
        calls = {"n": 0}

        def failing_step():  # fault injection: the third step raises, once
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected")
            return real_step()

        engine.step = failing_step
        r = post(srv, "/completions", {**OK_COMPLETION, "max_tokens": 20, "ignore_eos": True})
        err = assert_openai_error(r, 500)
        assert err["type"] == "server_error" and "internal engine error" in err["message"]
        ok = post(srv, "/completions", {**OK_COMPLETION, "max_tokens": 5})
        assert ok.status_code == 200
        assert httpx.get(srv.base_url + "/health").status_code == 200
        assert not srv.state.engine_loop.active and srv.state.admission.waiting == 0


CHAT_NULLS = ["n", "stream", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "temperature",
              "top_p", "max_completion_tokens", "seed", "stop", "user", "logit_bias", "stream_options", "tools",
              "tool_choice", "response_format", "parallel_tool_calls", "metadata", "store", "service_tier", "top_k",
              "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "prompt_logprobs", "priority"]
COMPLETION_NULLS = ["echo", "n", "stream", "logprobs", "presence_penalty", "frequency_penalty", "temperature",
                    "top_p", "seed", "stop", "user", "logit_bias", "stream_options", "best_of", "suffix",
                    "response_format"]


def test_null_means_the_default(server):
    """OpenAI marks these fields nullable and vLLM declares them Optional: an explicit null is the default
    (it was a 400 "Input should be a valid integer/boolean" for n, stream, logprobs, penalties and echo)."""
    r = post(server, "/chat/completions", {**OK_CHAT, **dict.fromkeys(CHAT_NULLS)})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    r = post(server, "/completions", {**OK_COMPLETION, **dict.fromkeys(COMPLETION_NULLS)})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and not r.json()["choices"][0]["text"].startswith("Hello")  # no echo
    r = post(server, "/chat/completions", {**OK_CHAT, "stream": True,
                                           "stream_options": {"include_usage": None, "continuous_usage_stats": None}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    # the openai client sends None as null
    c = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    chat = c.chat.completions.create(model=MODEL_NAME, messages=OK_CHAT["messages"], max_tokens=2, n=None,
                                     stream=None, logprobs=None, presence_penalty=None, frequency_penalty=None,
                                     temperature=None, seed=None, stop=None, tools=None, tool_choice=None)
    assert len(chat.choices) == 1 and chat.usage.completion_tokens <= 2
    comp = c.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2, echo=None, n=None, stream=None,
                                logprobs=None, presence_penalty=None, frequency_penalty=None)
    assert len(comp.choices) == 1 and comp.choices[0].logprobs is None
    # a field that is required, or whose null has its own meaning, is not affected
    assert_openai_error(post(server, "/chat/completions", {**OK_CHAT, "messages": None}), 400, param="messages")
    assert assert_openai_error(post(server, "/completions", {**OK_COMPLETION, "prompt": None}), 400)["param"] \
        .startswith("prompt")
    assert_openai_error(post(server, "/chat/completions", {**OK_CHAT, "messages": [{"role": None, "content": "x"}]}),
                        400, param="messages.0.role")


@pytest.mark.parametrize("path, body", [("/chat/completions", OK_CHAT), ("/completions", OK_COMPLETION)])
def test_stream_options_need_stream(server, path, body):
    """Accepted and ignored before; OpenAI and vLLM refuse them without `stream: true`."""
    for stream in ({}, {"stream": False}, {"stream": None}):
        err = assert_openai_error(post(server, path, {**body, **stream, "stream_options": {"include_usage": True}}), 400)
        assert err["message"] == "Stream options can only be defined when `stream=True`."
    c = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="stream=True"):
        c.chat.completions.create(model=MODEL_NAME, messages=OK_CHAT["messages"], max_tokens=2,
                                  stream_options={"include_usage": True})
    assert post(server, path, {**body, "stream_options": None}).status_code == 200


@pytest.mark.parametrize("part, what", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "image"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "'input_audio'"),
])
def test_non_text_content_parts_are_one_line(server, part, what):
    """It was pydantic's union message: `messages.0.content.str: Input should be a valid string (and 3 more
    problems)`; SERVE.md promises a 400 saying the part is not supported."""
    content = [{"type": "text", "text": "What is this?"}, part]
    for path, body in (("/chat/completions", OK_CHAT), ("/tokenize", {"model": MODEL_NAME})):
        r = httpx.post(server.base_url + ("/v1" if path.startswith("/chat") else "") + path,
                       json={**body, "messages": [{"role": "user", "content": content}]}, timeout=30)
        err = assert_openai_error(r, 400, param="messages.0.content")
        assert err["message"] == (f"messages.0.content: {what} content parts are not supported by this server, "
                                  "only text (part 1)"), err
