"""On the real SmolLM2-135M, through a real server and the openai client, sampling at temperature 1:
structured outputs validate against their schemas, the regex/choice/grammar forms hold, speculative
decoding with a schema stays valid, and tool calls round-trip (SmolLM2's template has no tools, so the
generic rendering is used)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from llmopt.models.resolve import resolve_model, weights_dir
from llmopt.models.tokenizer import load_tokenizer
from llmopt.serve.tools import template_supports_tools
from tests.conftest import requires_smollm2
from tests.serve._server import MODEL_NAME, serve

pytestmark = [pytest.mark.slow, requires_smollm2]
ENGINE = {"model": "smollm2-135m", "kv_cache_memory": "128MiB", "num_threads": None}
SCHEMAS = [
    ("Pick a t-shirt colour and size.", {
        "type": "object", "additionalProperties": False, "required": ["color", "size"],
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]}}}),
    ("Give the age and the rating (0 to 10) of a movie critic.", {
        "type": "object", "additionalProperties": False, "required": ["age", "rating"],
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 90},
                       "rating": {"type": "integer", "minimum": 0, "maximum": 10}}}),
    ("Describe a person and the city they live in.", {
        "type": "object", "additionalProperties": False, "required": ["person"],
        "properties": {"person": {"type": "object", "additionalProperties": False, "required": ["name", "home"],
                                  "properties": {"name": {"type": "string", "maxLength": 24},
                                                 "home": {"type": "object", "additionalProperties": False,
                                                          "required": ["city", "zip"],
                                                          "properties": {"city": {"type": "string", "maxLength": 24},
                                                                         "zip": {"type": "string",
                                                                                 "pattern": "^[0-9]{5}$"}}}}}}}),
    ("List a few fruits.", {
        "type": "object", "additionalProperties": False, "required": ["fruits"],
        "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                  "minItems": 2, "maxItems": 4}}}),
    ("Give a book title and a one-line summary.", {
        "type": "object", "additionalProperties": False, "required": ["title", "summary"],
        "properties": {"title": {"type": "string", "maxLength": 30}, "summary": {"type": "string", "maxLength": 60}}}),
]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Get the local time in a city",
                                           "parameters": {"type": "object", "additionalProperties": False,
                                                          "required": ["city"],
                                                          "properties": {"city": {"type": "string", "maxLength": 24}}}}}]
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client():
    with serve(None, engine_kw=ENGINE) as srv:
        yield openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=300)


def test_structured_outputs_validate_on_smollm2(client):
    def one(i: int):
        q, schema = SCHEMAS[i % len(SCHEMAS)]
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": q + " Answer in JSON."}], temperature=1.0,
            seed=i, max_tokens=96, response_format={"type": "json_schema",
                                                    "json_schema": {"name": f"s{i % len(SCHEMAS)}", "schema": schema,
                                                                    "strict": True}})
        return schema, r.choices[0]

    with ThreadPoolExecutor(10) as pool:  # all ten in one batch
        results = list(pool.map(one, range(2 * len(SCHEMAS))))
    for schema, c in results:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


def test_regex_choice_and_grammar_on_smollm2(client):
    ask = [{"role": "user", "content": "Is the sky blue? And what is a phone number?"}]
    cases = [({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
             ({"structured_outputs": {"regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"}},
              lambda t: re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", t)),
             ({"guided_grammar": 'root ::= ("yes" | "no") ", because " [a-z ]{1,20} "."'},
              lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", t))]
    for extra, ok in cases:
        r = client.chat.completions.create(model=MODEL_NAME, messages=ask, temperature=1.0, seed=1, max_tokens=40,
                                           extra_body=extra)
        assert r.choices[0].finish_reason == "stop" and ok(r.choices[0].message.content), r.choices[0].message


def test_spec_decoding_with_a_schema_on_smollm2():
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_below_acceptance": 0.0}
    q, schema = SCHEMAS[2]
    example = '{"person": {"name": "Ada", "home": {"city": "London", "zip": "12345"}}}'
    msgs = [{"role": "user", "content": f"{q} Answer in JSON like this: {example}"}]
    with serve(None, engine_kw={**ENGINE, "speculative": spec}) as srv:
        c = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=300)
        for seed in range(2):
            r = c.chat.completions.create(model=MODEL_NAME, messages=msgs, temperature=1.0, seed=seed, max_tokens=96,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "p", "schema": schema}})
            assert r.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        assert srv.metrics()["llmopt:spec_decode_num_accepted_tokens_total"] > 0


def test_smollm2_template_has_no_tools():
    assert not template_supports_tools(load_tokenizer(weights_dir(resolve_model("smollm2-135m"))))


def test_tool_calls_round_trip_on_smollm2(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=1.0, seed=2, max_tokens=80)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    named = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=1.0, seed=3, max_tokens=80,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    with client.chat.completions.stream(**named) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    got = final.message.tool_calls[0]
    assert got.function.name == "get_weather"
    jsonschema.validate(json.loads(got.function.arguments), WEATHER)
    follow = [*ASK, {"role": "assistant", "tool_calls": [{"id": got.id, "type": "function", "function": {
                  "name": got.function.name, "arguments": got.function.arguments}}]},
              {"role": "tool", "tool_call_id": got.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    r2 = client.chat.completions.create(model=MODEL_NAME, messages=follow, tools=TOOLS, temperature=0, max_tokens=40)
    assert r2.choices[0].message.content and r2.usage.prompt_tokens > r.usage.prompt_tokens
