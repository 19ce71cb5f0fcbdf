"""Schemathesis fuzzes the OpenAPI schema of a real server: whatever it sends, never a 5xx.

Both valid (positive) and schema-violating (negative) requests are generated for every operation, at most
30 of each. Valid requests run for real, so the server gets a short context (64 tokens) and a short
deadline. (Schemathesis's pytest plugin does not load under this pytest, so Hypothesis drives its
strategies directly.)
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.serve._server import serve

MAX_EXAMPLES = 30


def test_no_server_errors(tiny_llama):
    with serve(tiny_llama, engine_kw={"max_model_len": 64}, request_timeout_s=5) as srv:
        schema = schemathesis.openapi.from_url(srv.base_url + "/openapi.json")
        operations = [r.ok() for r in schema.get_all_operations()]
        labels = {op.label for op in operations}
        assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health"} <= labels
        assert {"POST /tokenize", "POST /detokenize"} <= labels
        seen: dict[int, int] = {}
        for op in operations:
            modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.method.upper() == "POST" else [])
            for mode in modes:  # GETs without parameters have nothing to violate

                @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(mode))
                def check(case) -> None:
                    r = case.call(base_url=srv.base_url, timeout=30)
                    seen[r.status_code] = seen.get(r.status_code, 0) + 1
                    assert r.status_code < 500, (case.method, case.path, case.body, r.text[:300])
                    if r.status_code >= 400:
                        assert set(r.json()["error"]) == {"message", "type", "param", "code"}

                check()
        assert any(code == 200 for code in seen) and any(400 <= code < 500 for code in seen)
        print("fuzz status codes:", dict(sorted(seen.items())))


def test_structured_output_and_tool_fields_never_5xx(tiny_llama):
    """Random schemas, regexes, grammars, choices and tool definitions: a 200 or a one-line 400, never a 5xx."""
    import httpx
    from hypothesis import strategies as st

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-10, 10) | st.text(max_size=6),
        lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
            st.sampled_from(["type", "properties", "items", "enum", "const", "minimum", "maximum", "maxLength",
                             "pattern", "required", "anyOf", "$ref", "minItems", "format", "x"]), kids, max_size=4),
        max_leaves=12)
    schemas = st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "required", "anyOf", "$ref"]),
                              json_values, max_size=4)
    fields = st.one_of(
        st.builds(lambda s: {"guided_json": s}, schemas),
        st.builds(lambda s: {"structured_outputs": {"json": s}}, schemas),
        st.builds(lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": s}}},
                  schemas),
        st.builds(lambda r: {"guided_regex": r}, st.text(max_size=12)),
        st.builds(lambda g: {"guided_grammar": g}, st.text(max_size=24) | st.just("start: x")),
        st.builds(lambda c: {"guided_choice": c}, st.lists(st.text(max_size=4), max_size=3)),
        st.builds(lambda p, c: {"tools": [{"type": "function", "function": {"name": "f", "parameters": p}}],
                                "tool_choice": c}, schemas, st.sampled_from(["auto", "required", "none", "x"])),
    )
    with serve(tiny_llama, engine_kw={"max_model_len": 1024}, request_timeout_s=5) as srv:
        seen: dict[int, int] = {}

        @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(extra=fields, chat=st.booleans(), stream=st.booleans())
        def check(extra, chat, stream) -> None:
            body = {"max_tokens": 4, "stream": stream, **extra}
            if chat:
                body["messages"] = [{"role": "user", "content": "hi"}]
            else:
                if "tools" in extra:
                    return
                body["prompt"] = "hi"
            r = httpx.post(srv.v1 + ("/chat/completions" if chat else "/completions"), json=body, timeout=60)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (body, r.text[:300])
            if r.status_code >= 400:
                err = r.json()["error"]
                assert "\n" not in err["message"], err

        check()
        assert httpx.get(srv.base_url + "/health").status_code == 200
        assert seen.get(200) and seen.get(400), seen
