"""Structured outputs through a real server on the tiny model, with real clients: response_format
(json_schema, json_object) on chat and completions, vLLM's structured_outputs and guided_* fields,
streaming, constrained next to unconstrained requests, speculative decoding, and the 400s."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.serve._server import MODEL_NAME, serve

ITEM = {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                       "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}
SCHEMAS = {
    "enum": {"type": "object", "additionalProperties": False, "required": ["color", "size"],
             "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]}}},
    "bounded_integers": {"type": "object", "additionalProperties": False, "required": ["age", "delta"],
                         "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 65},
                                        "delta": {"type": "integer", "minimum": -3, "maximum": 3}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["order"],
               "properties": {"order": {"type": "object", "additionalProperties": False,
                                        "required": ["item", "rush"],
                                        "properties": {"item": ITEM, "rush": {"type": "boolean"}}}}},
    "array": {"type": "object", "additionalProperties": False, "required": ["items"],
              "properties": {"items": {"type": "array", "items": ITEM, "minItems": 2, "maxItems": 3}}},
    "short_strings": {"type": "object", "additionalProperties": False, "required": ["title", "tags"],
                      "properties": {"title": {"type": "string", "maxLength": 6},
                                     "tags": {"type": "array", "maxItems": 2,
                                              "items": {"type": "string", "maxLength": 3}}}},
}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.v1 + path, json={"model": MODEL_NAME, **body}, timeout=120)


def _chat(content: str = "Give me JSON") -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_response_format_json_schema_validates_with_sampling(client, name):
    schema = SCHEMAS[name]
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=_chat(), temperature=1.0, seed=seed, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


def test_openai_parse_helper_with_a_pydantic_model(client):
    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        sensor: str = Field(max_length=5)
        level: int = Field(ge=0, le=100)
        unit: str = Field(pattern="^(C|F)$")

    r = client.chat.completions.parse(model=MODEL_NAME, messages=_chat(), response_format=Reading,
                                      temperature=1.0, seed=4, max_tokens=80)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Reading) and 0 <= parsed.level <= 100 and parsed.unit in ("C", "F")


def test_json_object_on_chat_and_response_format_on_completions(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=_chat(), temperature=1.0, seed=1, max_tokens=300,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # an unbounded object may run out of tokens, but it is an object so far
        assert text.startswith("{")
    schema = SCHEMAS["enum"]
    r = client.completions.create(model=MODEL_NAME, prompt="JSON:", temperature=1.0, seed=2, max_tokens=60,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "e", "schema": schema}}})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_vllm_structured_outputs_and_guided_fields(server, path):
    base = {"prompt": "Hello", "max_tokens": 40} if path == "/completions" else {"messages": _chat(), "max_tokens": 40}
    checks = [
        ({"structured_outputs": {"regex": r"[a-c]{2}-[0-9]{3}"}}, lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{3}", t)),
        ({"guided_regex": r"(yes|no)!"}, lambda t: t in ("yes!", "no!")),
        ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
        ({"guided_choice": ["x y", "z"]}, lambda t: t in ("x y", "z")),
        ({"structured_outputs": {"grammar": 'start: "n=" /[0-9]{2}/'}}, lambda t: re.fullmatch(r"n=[0-9]{2}", t)),
        ({"guided_grammar": 'root ::= "a" ("b" | "c")'}, lambda t: t in ("ab", "ac")),  # GBNF (vLLM's EBNF)
        ({"structured_outputs": {"json": SCHEMAS["enum"]}}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS["enum"])
         is None),
        ({"guided_json": json.dumps(SCHEMAS["bounded_integers"])},
         lambda t: jsonschema.validate(json.loads(t), SCHEMAS["bounded_integers"]) is None),
        ({"structured_outputs": {"json_object": True}, "max_tokens": 300}, lambda t: t.startswith("{")),
        ({"guided_choice": ["only"], "guided_decoding_backend": "xgrammar"}, lambda t: t == "only"),  # backend ignored
    ]
    for extra, ok in checks:
        for seed in range(2):
            r = post(server, path, {**base, "temperature": 1.0, "seed": seed, **extra})
            assert r.status_code == 200, (extra, r.text)
            c = r.json()["choices"][0]
            text = c["text"] if path == "/completions" else c["message"]["content"]
            assert ok(text), (extra, text)


def test_streamed_constrained_output_is_the_same_valid_json(client):
    schema = SCHEMAS["array"]
    kw = dict(model=MODEL_NAME, messages=_chat(), temperature=1.0, seed=9, max_tokens=120,
              response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole
    jsonschema.validate(json.loads(text), schema)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]


def test_constrained_and_unconstrained_concurrently_each_get_what_they_asked(server, client):
    plain = dict(model=MODEL_NAME, prompt="The quick brown fox", temperature=0, max_tokens=24)
    solo = client.completions.create(**plain).choices[0].text

    def constrained(seed: int) -> str:
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=_chat(), temperature=1.0, seed=seed, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}})
        return r.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(constrained, s) if i % 2 else pool.submit(
            lambda: client.completions.create(**plain).choices[0].text) for i, s in enumerate(range(8))]
        results = [f.result() for f in futs]
    for i, text in enumerate(results):
        if i % 2:
            jsonschema.validate(json.loads(text), SCHEMAS["nested"])
        else:
            assert text == solo  # greedy fp32: token-identical next to constrained requests


def test_speculative_decoding_with_a_schema_gives_valid_output(tiny_llama):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "disable_below_acceptance": 0.0}
    example = '{"color": "red", "size": "M"} {"color": "blue", "size": "S"} '
    with serve(tiny_llama, engine_kw={"speculative": spec}) as srv:
        c = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=120)
        for seed in range(4):
            r = c.completions.create(model=MODEL_NAME, prompt=example * 3, temperature=1.0 if seed else 0,
                                     seed=seed, max_tokens=40,
                                     extra_body={"structured_outputs": {"json": SCHEMAS["enum"]}})
            assert r.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["enum"])
        m = srv.metrics()
        assert m["llmopt:spec_decode_num_draft_tokens_total"] > 0 and m["llmopt:spec_decode_num_accepted_tokens_total"] > 0


@pytest.mark.parametrize("path,body,param,needle", [
    ("/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}}, "response_format.json_schema.schema", "Invalid type: foo"),
    ("/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}},
     "response_format.json_schema.schema", "minimum (3) is greater than maximum (1)"),
    ("/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"not": {"type": "null"}}}}}, "response_format.json_schema.schema", "not"),
    ("/completions", {"structured_outputs": {"json": {"$ref": "#/$defs/nope"}}}, "structured_outputs.json",
     "does not exist"),
    ("/completions", {"guided_json": "{broken"}, "guided_json", "not valid JSON"),
    ("/completions", {"guided_regex": "(ab"}, "guided_regex", "unclosed group"),
    ("/chat/completions", {"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar",
     "missing_rule"),
    ("/chat/completions", {"guided_grammar": "root ::= undefined"}, "guided_grammar", "undefined"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_cannot_compile_is_a_400_naming_it(server, path, body, param, needle, stream):
    base = {"prompt": "Hi"} if path == "/completions" else {"messages": _chat()}
    r = post(server, path, {**base, **body, "stream": stream})
    assert r.status_code == 400, r.text  # before any SSE: streaming too
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"] and "\n" not in err["message"]


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "backend": "x"}}, "structured_outputs.backend"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_json": 5}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
])
def test_malformed_constraint_fields_are_400s(server, body, param):
    r = post(server, "/completions", {"prompt": "Hi", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param), err


def test_each_schema_is_compiled_once_across_requests(server, client):
    comp = server.state.engine_loop.engine.structured_outputs
    schema = {"type": "object", "properties": {"compiled_once_marker": {"enum": [1, 2]}},
              "required": ["compiled_once_marker"], "additionalProperties": False}
    before = comp.num_compiled
    for seed in range(3):
        client.chat.completions.create(model=MODEL_NAME, messages=_chat(), temperature=1.0, seed=seed, max_tokens=30,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "m", "schema": schema}})
    assert comp.num_compiled == before + 1
