"""API keys on /v1 (401 in OpenAI's shape), open probes, and the bind-address warning."""

from __future__ import annotations

import httpx
import openai
import pytest

from llmopt.serve.auth import ApiKeyAuth
from llmopt.serve.config import ServerConfig
from llmopt.serve.errors import ApiError
from llmopt.serve.server import bind_warning
from tests.serve._server import MODEL_NAME, serve
from tests.serve.test_errors import assert_openai_error

KEYS = ["sk-alpha", "sk-beta"]


@pytest.fixture(scope="module")
def keyed(tiny_llama):
    with serve(tiny_llama, api_keys=KEYS) as srv:
        yield srv


def test_requests_without_a_valid_key_get_401(keyed):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic sk-alpha"},
                    {"Authorization": "Bearer"}, {"Authorization": "Bearer sk-alph"}):
        r = httpx.post(keyed.v1 + "/completions", json=body, headers=headers)
        err = assert_openai_error(r, 401, code="invalid_api_key")
        assert err["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
    assert_openai_error(httpx.get(keyed.v1 + "/models"), 401)
    # the key is checked before the body is parsed: strangers learn nothing about parsing
    r = httpx.post(keyed.v1 + "/completions", content=b"{broken", headers={"content-type": "application/json"})
    assert_openai_error(r, 401)


def test_every_configured_key_works_with_the_openai_client(keyed):
    for key in KEYS:
        c = openai.OpenAI(base_url=keyed.v1, api_key=key, max_retries=0)
        r = c.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)
        assert r.usage.completion_tokens <= 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.v1, api_key="sk-nope", max_retries=0).models.list()


def test_tokenize_and_detokenize_need_a_key_too(keyed):
    for path, body in (("/tokenize", {"prompt": "Hello"}), ("/detokenize", {"tokens": [5, 6]})):
        assert_openai_error(httpx.post(keyed.base_url + path, json=body), 401, code="invalid_api_key")
        r = httpx.post(keyed.base_url + path, json=body, headers={"Authorization": f"Bearer {KEYS[1]}"})
        assert r.status_code == 200, r.text


def test_health_metrics_and_version_stay_open(keyed):
    assert httpx.get(keyed.base_url + "/health").status_code == 200
    assert httpx.get(keyed.base_url + "/version").status_code == 200
    r = httpx.get(keyed.base_url + "/metrics")
    assert r.status_code == 200 and "llmopt:num_requests_running" in r.text


def test_loopback_by_default_and_a_warning_for_open_binds():
    assert ServerConfig().host == "127.0.0.1"
    assert bind_warning("127.0.0.1", []) is None
    assert "--api-key" in bind_warning("0.0.0.0", [])
    assert bind_warning("::", []) is not None
    assert bind_warning("0.0.0.0", ["k"]) is None


def test_key_priorities_are_default_and_ceiling():
    auth = ApiKeyAuth(["gold", "bronze", "plain"], {"gold": 5, "bronze": -5})
    assert auth.priority("gold", None) == 5
    assert auth.priority("gold", 2) == 2
    assert auth.priority("bronze", 100) == -5
    assert auth.priority("plain", 3) == 0  # keys without a class: default and ceiling 0
    trusting = ApiKeyAuth(["k"])
    assert trusting.priority("k", 7) == 7 and trusting.priority(None, None) == 0
    with pytest.raises(ApiError):
        auth.authenticate("Bearer silver")
