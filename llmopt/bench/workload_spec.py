"""Every workload kind under one discriminated union, and the one call that materializes any of them.

Flat workloads (random, prefix, jsonl, trace) become a list of independent `BenchRequest`s; the
conversation workload becomes per-user scripts whose later turns depend on earlier answers, so it has
its own drivers (`conversation_driver.py`).
"""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field

from llmopt.bench.conversations import ConversationScript, ConversationWorkload, describe_scripts
from llmopt.bench.trace_workload import TraceWorkload
from llmopt.bench.workloads import (
    BenchRequest,
    JsonlWorkload,
    PrefixWorkload,
    RandomWorkload,
    Tokenizer,
    build_requests,
    describe_lengths,
)
from llmopt.errors import LlmoptError

AnyWorkload = Annotated[
    Union[RandomWorkload, PrefixWorkload, JsonlWorkload, TraceWorkload, ConversationWorkload],
    Field(discriminator="kind"),
]
Work = list[BenchRequest] | list[ConversationScript]


def materialize(spec: RandomWorkload | PrefixWorkload | JsonlWorkload | TraceWorkload | ConversationWorkload,
                tokenizer: Tokenizer | None) -> Work:
    """Requests (or conversation scripts) of `spec`; everything but jsonl needs the target's tokenizer."""
    if isinstance(spec, (TraceWorkload, ConversationWorkload)):
        if tokenizer is None:
            raise LlmoptError(f"the {spec.kind} workload needs a tokenizer (pass --tokenizer or a model)")
        return spec.build(tokenizer)
    return build_requests(spec, tokenizer)


def is_conversations(work: Work) -> bool:
    return bool(work) and isinstance(work[0], ConversationScript)


def describe_work(work: Work) -> str:
    return describe_scripts(work) if is_conversations(work) else describe_lengths(work)  # type: ignore[arg-type]


def with_salt(spec: RandomWorkload | PrefixWorkload | JsonlWorkload | TraceWorkload | ConversationWorkload,
              salt: int) -> RandomWorkload | PrefixWorkload | JsonlWorkload | TraceWorkload | ConversationWorkload:
    """The same workload with other prompt tokens (same lengths), so that a server's prefix cache cannot
    serve one round from another; a jsonl file has fixed prompts and stays as it is."""
    return spec if isinstance(spec, JsonlWorkload) else spec.model_copy(update={"salt": salt})
