"""The multi-turn workload: N users, each holding a conversation of K turns with think time between them.

Agent and chat traffic is conversations: every turn resends the whole history (earlier messages and
the model's own answers) plus one new message, so prompts grow turn by turn and a prefix cache can serve
all but the new part. A script fixes what each user will say (message lengths, answer lengths, think
times, seeded); what the model answers is only known at run time and goes into the next turn's prompt:
in-process as the generated token ids, over HTTP as the answer text in an OpenAI `messages` list (or,
with `--endpoint completions`, concatenated into one text prompt).

The per-turn TTFT this yields (`TurnStats`) is the number a chat user feels: with prefix caching, a
later turn's first token should not cost a prefill of the whole history.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field, field_validator

from llmopt.bench.metrics import LatencyStats
from llmopt.bench.records import RequestRecord
from llmopt.bench.workloads import BenchRequest, Tokenizer, TokenSampler, _length_field, parse_length
from llmopt.errors import LlmoptError

_SECONDS = r"([0-9]*\.?[0-9]+)"


def parse_think_time(text: str) -> tuple[float, float]:
    """`2` (seconds) or `0.5:3` (uniform) into (lo, hi)."""
    s = str(text).strip().lower().removesuffix("s")
    if m := re.fullmatch(_SECONDS, s):
        return float(m.group(1)), float(m.group(1))
    if m := re.fullmatch(rf"{_SECONDS}\s*:\s*{_SECONDS}", s):
        lo, hi = float(m.group(1)), float(m.group(2))
        if hi < lo:
            raise LlmoptError(f"think time {text!r} needs LO <= HI")
        return lo, hi
    raise LlmoptError(f"cannot parse think time {text!r}: use seconds S or a uniform range LO:HI (e.g. 1 or 0.5:2)")


class ConversationScript(BaseModel):
    """What one user will send: K messages, K answer lengths, and the pause after each answer."""

    user: int
    messages: list[str | list[int]]
    max_tokens: list[int]
    think_s: list[float]
    ignore_eos: bool = True

    @property
    def turns(self) -> int:
        return len(self.messages)


class ConversationWorkload(BaseModel):
    """`num_users` concurrent users, `turns` turns each; the first message is `first_len` tokens (the
    context a conversation opens with), later ones `message_len`; answers are `output_len` tokens."""

    kind: Literal["conversation"] = "conversation"
    num_users: int = Field(4, ge=1)
    turns: int = Field(4, ge=1)
    first_len: str = "256"
    message_len: str = "64"
    output_len: str = "64"
    think_time: str = "1"
    seed: int = 0
    salt: int | None = Field(None, description="Other message tokens, same lengths (A/B rounds over HTTP).")
    token_ids: bool = False
    ignore_eos: bool = True

    _check_lengths = field_validator("first_len", "message_len", "output_len", mode="before")(_length_field)

    @field_validator("think_time", mode="before")
    @classmethod
    def _check_think(cls, v: Any) -> str:
        parse_think_time(v)
        return str(v).strip()

    @property
    def num_requests(self) -> int:
        return self.num_users * self.turns

    def build(self, tokenizer: Tokenizer) -> list[ConversationScript]:
        rng = np.random.default_rng(self.seed)
        n, k = self.num_users, self.turns
        first = parse_length(self.first_len).sample(rng, n)
        later = parse_length(self.message_len).sample(rng, n * k)
        outs = parse_length(self.output_len).sample(rng, n * k)
        lo, hi = parse_think_time(self.think_time)
        think = rng.uniform(lo, hi, size=n * k) if hi > lo else np.full(n * k, lo)
        sampler = TokenSampler(tokenizer, rng if self.salt is None else np.random.default_rng([self.seed, self.salt]))
        scripts = []
        for u in range(n):
            lens = [first[u]] + later[u * k + 1:(u + 1) * k]
            msgs: list[str | list[int]] = [sampler.ids(m) if self.token_ids else sampler.text(m)[0] for m in lens]
            scripts.append(ConversationScript(user=u, messages=msgs, max_tokens=outs[u * k:(u + 1) * k],
                                              think_s=[float(t) for t in think[u * k:(u + 1) * k]],
                                              ignore_eos=self.ignore_eos))
        return scripts


def turn_request(script: ConversationScript, turn: int, history: list[Any], *, chat: bool) -> BenchRequest:
    """The request of `turn` given the history so far (ids, chat messages, or text pieces)."""
    msg = script.messages[turn]
    if isinstance(msg, list):
        prompt: Any = [*history, *msg]
    elif chat:
        prompt = [*history, {"role": "user", "content": msg}]
    else:
        prompt = "\n".join([*history, msg])
    return BenchRequest(prompt=prompt, max_tokens=script.max_tokens[turn], ignore_eos=script.ignore_eos,
                        expected_prompt_tokens=len(prompt) if isinstance(msg, list) else None)


def next_history(req: BenchRequest, answer: Any, *, chat: bool) -> list[Any]:
    """The history after a turn: its prompt plus the answer (token ids, or text)."""
    if isinstance(req.prompt, list) and not req.is_chat:
        return [*req.prompt, *answer]
    if chat:
        return [*req.prompt, {"role": "assistant", "content": answer}]  # type: ignore[misc]
    return [str(req.prompt), answer]


def describe_scripts(scripts: Sequence[ConversationScript]) -> str:
    turns = sum(s.turns for s in scripts)
    return f"{len(scripts)} users x {scripts[0].turns} turns = {turns} requests"


class TurnStats(BaseModel):
    """TTFT of every conversation's turn `turn` (0 = the first message)."""

    turn: int
    completed: int
    failed: int
    prompt_tokens_mean: float | None = None
    ttft_ms: LatencyStats


def turn_stats(records: Sequence[RequestRecord]) -> list[TurnStats]:
    """Per-turn TTFT over the records that carry a turn index."""
    turns = sorted({r.turn for r in records if r.turn is not None})
    out = []
    for t in turns:
        rs = [r for r in records if r.turn == t and not r.interrupted]
        ok = [r for r in rs if r.success]
        out.append(TurnStats(turn=t, completed=len(ok), failed=len(rs) - len(ok),
                             prompt_tokens_mean=float(np.mean([r.prompt_tokens for r in ok])) if ok else None,
                             ttft_ms=LatencyStats.from_seconds([r.ttft for r in ok if r.ttft is not None])))
    return out
