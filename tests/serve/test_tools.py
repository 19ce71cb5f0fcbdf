"""Tool calling through a real server on the tiny model, with the openai client: forced calls (required, a
named function) always parse and validate, streamed tool-call deltas assemble, `auto` parses what the model
writes, tool results go back through the template (native or the generic rendering), and the 400s."""

from __future__ import annotations

import json
import random
import shutil

import httpx
import jsonschema
import openai
import pytest

from llmopt.models.tokenizer import load_tokenizer
from llmopt.serve.prompts import PromptBuilder
from llmopt.serve.protocol import Tool
from llmopt.serve.tools import (
    GENERIC_SYSTEM,
    ToolCallDelta,
    ToolCallParser,
    generic_messages,
    parse_tool_calls,
    template_supports_tools,
    tool_grammar,
)
from tests.serve._server import MODEL_NAME, serve

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["a", "b"],
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                       "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
    {"type": "function", "function": {"name": "now"}},  # no parameters
]
PARAMS = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# a tool-aware chat template (Qwen2.5's layout, shortened) for the native path
NATIVE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120)


def _check_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    schema = PARAMS[name] or {"type": "object", "maxProperties": 0}
    jsonschema.validate(args, schema)


def test_required_calls_always_parse_and_validate(client):
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        _check_call(call.function.name, call.function.arguments)


def test_required_with_parallel_calls(client):
    seen = 0
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=250)
        c = r.choices[0]
        if c.finish_reason == "length":  # the model may keep calling until max_tokens
            continue
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        assert len({t.id for t in c.message.tool_calls}) == len(c.message.tool_calls)
        for call in c.message.tool_calls:
            _check_call(call.function.name, call.function.arguments)
        seen += 1
    assert seen


def test_a_call_cut_off_by_max_tokens_leaves_no_tag_text_in_content(client):
    """A forced response is calls only; one cut off inside a tag or before its name used to return that text
    (`"<"`, `"<tool_call>\\n{\\"name"`) as content. Every cut, whole and streamed, has none."""
    kw = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0)
    full = client.chat.completions.create(**kw, max_tokens=250).choices[0]
    n = client.chat.completions.create(**kw, max_tokens=250).usage.completion_tokens
    assert full.message.tool_calls and n > 4
    for max_tokens in range(1, min(n, 48)):
        c = client.chat.completions.create(**kw, max_tokens=max_tokens).choices[0]
        assert not c.message.content, (max_tokens, c.message.content)  # "" before the first call, then null
        assert c.finish_reason == "length"
        chunks = list(client.chat.completions.create(**kw, max_tokens=max_tokens, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "", max_tokens


def test_named_function_streams_openai_style_deltas_the_client_assembles(client):
    kw = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=1.0, seed=3, max_tokens=120,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert rest and all(d.id is None and d.function.name is None and d.index == 0 for d in rest)
    streamed_args = "".join(d.function.arguments for d in rest)
    assert streamed_args == whole.message.tool_calls[0].function.arguments
    _check_call("get_weather", streamed_args)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] \
        == ["tool_calls"] == [whole.finish_reason]
    with client.chat.completions.stream(**kw) as stream:  # the openai stream helper assembles the same call
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert final.message.tool_calls[0].function.name == "get_weather"
    assert final.message.tool_calls[0].function.arguments == streamed_args


def test_follow_up_turn_with_a_tool_result(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS[:1], temperature=1.0, seed=5,
                                       max_tokens=120, tool_choice={"type": "function",
                                                                    "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    messages = [*ASK, r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21, "unit": "C"})}]
    r2 = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS[:1], temperature=0,
                                        max_tokens=8)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result are in the prompt


def test_auto_parses_calls_the_model_writes(client):
    """tool_choice auto is not constrained; a guided grammar makes the tiny model write a Hermes call."""
    forced = ('start: "Checking. <tool_call>\\n{\\"name\\": \\"add\\", \\"arguments\\": {\\"a\\": 2, \\"b\\": 3}}'
              '\\n</tool_call>"')
    kw = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=80,
              extra_body={"guided_grammar": forced})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
    assert [(t.function.name, t.function.arguments) for t in whole.message.tool_calls] == [("add", '{"a": 2, "b": 3}')]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    args = "".join(tc.function.arguments or "" for ch in chunks if ch.choices
                   for tc in (ch.choices[0].delta.tool_calls or []))
    assert content == "Checking." and args == '{"a": 2, "b": 3}'
    # without tools, or with tool_choice none, the same text is plain content
    plain = client.chat.completions.create(**{**kw, "tool_choice": "none"}).choices[0]
    assert plain.finish_reason == "stop" and plain.message.tool_calls is None and "<tool_call>" in plain.message.content


def test_auto_without_calls_is_content(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=6)
    c = r.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required"}, None),
    ({"tools": TOOLS + TOOLS[:1]}, None),  # duplicate names
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
])
def test_bad_tools_and_tool_choice_are_400s(server, body, param):
    r = httpx.post(server.v1 + "/chat/completions", json={"model": MODEL_NAME, "messages": ASK, "max_tokens": 4,
                                                          **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "\n" not in err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err


def test_lone_surrogates_in_tools_are_a_400(server):
    body = json.dumps({"model": MODEL_NAME, "messages": ASK, "tools": [
        {"type": "function", "function": {"name": "f", "description": "\ud800"}}]})
    r = httpx.post(server.v1 + "/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


# ---- prompts: native and generic rendering ----------------------------------------------------------------
def test_tiny_template_has_no_tools_so_prompts_use_the_generic_rendering(tiny_llama):
    tok = load_tokenizer(tiny_llama)
    assert not template_supports_tools(tok)
    pb = PromptBuilder(tok, 512, 1024)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                           "arguments": {"city": "Oslo", "unit": "C"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "-3"}, {"role": "tool", "tool_call_id": "c2", "content": "4"}]
    text = tok.decode(pb.encode_chat(msgs, tools=TOOLS))
    assert "Be brief.\n\n# Tools" in text and json.dumps(TOOLS[0]) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n-3\n</tool_response>\n<tool_response>\n4\n</tool_response><|im_end|>" \
        in text


def test_generic_messages_without_a_system_message():
    out = generic_messages([{"role": "user", "content": "hi"}], [TOOLS[2]])
    assert out[0] == {"role": "system", "content": GENERIC_SYSTEM.format(tools=json.dumps(TOOLS[2]))}
    assert out[1] == {"role": "user", "content": "hi"}
    assert generic_messages([{"role": "system", "content": ""}], [TOOLS[2]])[0]["content"].startswith("# Tools")


@pytest.fixture(scope="module")
def native_model(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-tools")
    shutil.copytree(tiny_llama, d, dirs_exist_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = NATIVE_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in d.glob("chat_template.j*"):
        f.unlink()
    return d


def test_a_tool_aware_template_renders_the_tools_itself(native_model):
    tok = load_tokenizer(native_model)
    assert template_supports_tools(tok)
    pb = PromptBuilder(tok, 512, 1024)
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "now", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    text = tok.decode(pb.encode_chat(msgs, tools=TOOLS))
    assert text.startswith("<|im_start|>system\nTOOLS:{") and "# Tools" not in text
    assert '<tool_call>{"name": "now", "arguments": {}}</tool_call>' in text
    assert "<tool_response>noon</tool_response>" in text


def test_native_template_round_trip(native_model):
    with serve(native_model) as srv:
        c = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=120)
        r = c.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, temperature=1.0, seed=1, max_tokens=120)
        call = r.choices[0].message.tool_calls[0]
        _check_call(call.function.name, call.function.arguments)
        follow = [*ASK, r.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "ok"}]
        r2 = c.chat.completions.create(model=MODEL_NAME, messages=follow, tools=TOOLS, max_tokens=4, temperature=0)
        assert r2.usage.prompt_tokens > r.usage.prompt_tokens


# ---- the parser -----------------------------------------------------------------------------------------------
PARSE_CASES = [
    ('Sure. <tool_call>\n{"name": "f", "arguments": {"x": [1, {"y": "}]"}]}}\n</tool_call>\n'
     '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
     "Sure.", [("f", '{"x": [1, {"y": "}]"}]}'), ("g", "{}")]),
    # cut off by max_tokens inside a tag, or before a call's name: never content (it was "<", or the block)
    ("no calls, a tag prefix at the end <tool", "no calls, a tag prefix at the end", []),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<', None, [("f", "{}")]),
    ('<tool_call>\n{"name": "now"}\n</tool_call>\n<tool_call>\n{"name', None, [("now", "{}")]),
    ("Sure. <tool_call>", "Sure.", []),
    ("<tool_call>not json", "<tool_call>not json", []),  # not a call: content, closed or not
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', None, [("f", '{"x": 1}')]),  # any key order
    ('<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),  # no arguments
    ('<tool_call>{"name": "f", "parameters": {"q": "a b"}}</tool_call>', None, [("f", '{"q": "a b"}')]),
    ('<tool_call>{"name": "f", "arguments": {"x": "cut off', None, [("f", '{"x": "cut off')]),  # max_tokens
    ('<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": 3}</tool_call>', []),
    ('  a  <tool_call>{"name":"f","arguments":"{\\"s\\": 1}"}</tool_call>  b ', "a    b",
     [("f", '"{\\"s\\": 1}"')]),  # arguments given as a JSON string stay the model's text
]


@pytest.mark.parametrize("text,content,calls", PARSE_CASES)
def test_parser_whole_and_streamed_in_any_pieces_agree(text, content, calls):
    whole = parse_tool_calls(text)
    assert (whole.content, whole.tool_calls) == (content, calls)
    rng = random.Random(0)
    for _ in range(25):
        p, items, i = ToolCallParser(), [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            items += p.feed(text[i:i + n])
            i += n
        items += p.feed("", final=True)
        got_content = "".join(x for x in items if isinstance(x, str)) or None
        got: list[list[str]] = []
        for x in items:
            if isinstance(x, ToolCallDelta):
                if x.name is not None:
                    assert x.index == len(got) and x.arguments == ""
                    got.append([x.name, ""])
                else:
                    got[x.index][1] += x.arguments
        assert (got_content, [tuple(g) for g in got]) == (content, calls)


def test_tool_grammar_admits_only_offered_calls(llm_compiler_tok):
    comp, tok = llm_compiler_tok
    from llmopt.engine.structured_output import StructuredOutputsParams

    tools = [Tool.model_validate(t) for t in TOOLS]
    m = comp.matcher(StructuredOutputsParams(grammar=tool_grammar(tools, "add", parallel=False)))
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 22}}\n</tool_call>'
    ids = tok.encode(good, add_special_tokens=False)
    assert m.validate(ids) == len(ids)
    for bad in ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',  # not the named one
                '<tool_call>\n{"name": "add", "arguments": {"a": 100, "b": 1}}\n</tool_call>',  # out of range
                'Sure: <tool_call>'):  # text first
        ids = tok.encode(bad, add_special_tokens=False)
        assert m.validate(ids) < len(ids), bad


@pytest.fixture(scope="module")
def llm_compiler_tok(tiny_llama):
    from llmopt.engine.structured_output import StructuredOutputCompiler

    tok = load_tokenizer(tiny_llama)
    return StructuredOutputCompiler(tok, 512, [tok.eos_token_id]), tok
