"""Structured outputs at the edge: the request's constraint, whichever field it came in, compiled before
the request is admitted, so that a constraint the engine cannot compile is a 400 that names the field
and the problem (streaming included: nothing is sent before it compiles).

Fields, at most one per request: OpenAI's `response_format` (`json_schema` → its `schema`,
`json_object` → any JSON object, `text` → none), vLLM's `structured_outputs` and vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. The compiler is the engine's own
(thread-safe, cached by kind and text), so the engine's compile of the same constraint is a cache hit.
"""

from __future__ import annotations

import asyncio

from llmopt.engine.structured_output import GrammarError, StructuredOutputCompiler, StructuredOutputsParams
from llmopt.serve.errors import ApiError
from llmopt.serve.protocol import ChatCompletionRequest, CompletionRequest


def requested_constraint(req: CompletionRequest | ChatCompletionRequest) -> tuple[StructuredOutputsParams, str] | None:
    """The constraint a request asks for and the parameter it came in, or None; 400 for more than one."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        found.append((StructuredOutputsParams(json=rf.json_schema.schema_), "response_format.json_schema.schema"))
    elif rf is not None and rf.type == "json_object":
        found.append((StructuredOutputsParams(json_object=True), "response_format"))
    so = req.structured_outputs
    if so is not None:
        spec = StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                       json_object=so.json_object or None)
        found.append((spec, f"structured_outputs.{spec.key[0]}"))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(req, field)
        if value is not None:
            found.append((StructuredOutputsParams(**{kind: value}), field))
    if len(found) > 1:
        raise ApiError(400, f"give at most one structured output constraint (got {', '.join(p for _, p in found)})",
                       param=found[1][1])
    return found[0] if found else None


async def compile_constraint(compiler: StructuredOutputCompiler, spec: StructuredOutputsParams, param: str) -> None:
    """Compile (or find cached) off the event loop; 400 naming `param` and the problem when it cannot."""
    try:
        await asyncio.to_thread(compiler.compile, spec)
    except GrammarError as e:
        raise ApiError(400, f"{param}: {e}", param=param, code="invalid_structured_output") from None
