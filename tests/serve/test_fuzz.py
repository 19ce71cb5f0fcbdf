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
