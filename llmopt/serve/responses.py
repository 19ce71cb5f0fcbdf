"""OpenAI response shapes for completions and chat, whole and as SSE chunks, built from StreamEvents.

`ChoiceState` accumulates one choice (text, tokens, logprobs, finish reason) across events; the
builders turn it into OpenAI's JSON. Finish reasons are OpenAI's `stop` and `length`, plus `abort`
(client gone or server shutting down) and `timeout` (the server-side deadline), as vLLM does.
Prompt logprobs (the engine's {token: (logprob, rank)} per prompt token) become either legacy
completions entries for `echo`, or vLLM's `prompt_logprobs` list.
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

    @property
    def cumulative_logprob(self) -> float:
        """Sum of the generated tokens' logprobs (what best_of ranks by)."""
        return sum(top.get(tok, MIN_LOGPROB) for tok, top in self.logprobs)

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


PromptEntry = dict[int, tuple[float, int]] | None  # engine prompt logprobs: {token: (logprob, rank)}


def _top_by_piece(prompts: PromptBuilder, top: dict[int, float]) -> dict[str, float]:
    """{token text: logprob}; two tokens with the same text (say, partial UTF-8 bytes) keep the larger."""
    out: dict[str, float] = {}
    for t, v in top.items():
        piece = prompts.piece(t)
        if piece not in out or v > out[piece]:
            out[piece] = _lp(v)
    return out


def completion_logprobs(prompts: PromptBuilder, items: list[tuple[int, dict[int, float] | None]],
                        offset: int = 0) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, `text_offset` counted from the completion start
    (from the prompt's start with echo). An entry without logprobs (the first prompt token) is null."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for tok, top in items:
        piece = prompts.piece(tok)
        tokens.append(piece)
        token_lps.append(None if top is None else _lp(top.get(tok, MIN_LOGPROB)))
        tops.append(None if top is None else _top_by_piece(prompts, top))
        offsets.append(pos)
        pos += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def echo_items(prompt_ids: list[int], entries: list[PromptEntry] | tuple[PromptEntry, ...] | None,
               top_n: int) -> list[tuple[int, dict[int, float] | None]]:
    """The prompt tokens as completion logprob items: each token's logprob and its top_n alternatives."""
    out: list[tuple[int, dict[int, float] | None]] = []
    for i, tok in enumerate(prompt_ids):
        e = entries[i] if entries is not None and i < len(entries) else None
        out.append((tok, None if e is None else {t: v for t, (v, r) in e.items() if r <= top_n or t == tok}))
    return out


def prompt_logprobs_json(prompts: PromptBuilder, entries: list[PromptEntry] | tuple[PromptEntry, ...] | None,
                         ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or {token id: {logprob, rank,
    decoded_token}} for the token itself and the top-n alternatives."""
    if entries is None:
        return None
    return [None if e is None else
            {str(t): {"logprob": _lp(v), "rank": r, "decoded_token": prompts.piece(t)} for t, (v, r) in e.items()}
            for e in entries]


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
