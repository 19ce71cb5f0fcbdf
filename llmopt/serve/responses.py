"""OpenAI response shapes for completions and chat, whole and as SSE chunks, built from StreamEvents.

`ChoiceState` accumulates one choice (text, tokens, logprobs, finish reason) across events; the
builders turn it into OpenAI's JSON. Finish reasons are OpenAI's `stop` and `length`, plus `abort`
(client gone or server shutting down) and `timeout` (the server-side deadline), as vLLM does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from llmopt.serve.engine_loop import ChoiceDelta
from llmopt.serve.prompts import PromptBuilder

MIN_LOGPROB = -9999.0  # JSON has no -inf


def _lp(v: float) -> float:
    return v if v > MIN_LOGPROB else MIN_LOGPROB


@dataclass
class ChoiceState:
    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)  # (token, top dict)

    def add(self, d: ChoiceDelta) -> None:
        self.text += d.text
        self.num_tokens += len(d.token_ids)
        if d.logprobs is not None:
            self.logprobs.extend(zip(d.token_ids, d.logprobs, strict=False))
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def completion_logprobs(prompts: PromptBuilder, items: list[tuple[int, dict[int, float]]],
                        offset: int = 0) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, `text_offset` counted from the completion start."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for tok, top in items:
        piece = prompts.piece(tok)
        tokens.append(piece)
        token_lps.append(_lp(top.get(tok, MIN_LOGPROB)))
        tops.append({prompts.piece(t): _lp(v) for t, v in top.items()})
        offsets.append(pos)
        pos += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(prompts: PromptBuilder, items: list[tuple[int, dict[int, float]]], top_n: int) -> dict[str, Any]:
    """The chat shape: one entry per token with its bytes and the `top_n` best alternatives."""
    content = []
    for tok, top in items:
        piece = prompts.piece(tok)
        best = sorted(top.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
        content.append({
            "token": piece, "logprob": _lp(top.get(tok, MIN_LOGPROB)), "bytes": list(piece.encode("utf-8")),
            "top_logprobs": [{"token": (p := prompts.piece(t)), "logprob": _lp(v), "bytes": list(p.encode("utf-8"))}
                             for t, v in best],
        })
    return {"content": content}


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def now_s() -> int:
    return int(time.time())
