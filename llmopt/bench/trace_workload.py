"""Trace replay: requests with arrival times and lengths from a Mooncake-style JSONL trace.

One object per line, the format Mooncake published its production traces in and that vLLM
(`vllm bench serve --dataset-name timed_trace`), GuideLLM (`kind=mooncake`), SGLang and AIPerf replay:

    {"timestamp": 0, "input_length": 655, "output_length": 52, "hash_ids": [46, 47]}

* `timestamp`: arrival, in milliseconds by default (Mooncake's unit; `time_unit="s"` for seconds).
  Requests are sorted by it and sent at (timestamp - first timestamp) * unit * `time_scale`.
* `input_length`, `output_length`: prompt tokens and `max_tokens`.
* `hash_ids` (optional): one id per block of `block_size` prompt tokens (512 in Mooncake's traces, also
  GuideLLM's default; vLLM's `--timed-trace-chunk-hash-size` defaults to 16, so pass the trace's own
  size). Equal ids mean equal token blocks, so the trace's prefix sharing, and the prefix-cache hits it
  causes, are reproduced: each id becomes `block_size` random tokens (seeded by the id), the blocks are
  concatenated, and the prompt is cut or filled with fresh tokens to exactly `input_length`.

Other keys (`tools`, `extra`, session ids) are ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from llmopt.bench.workloads import BenchRequest, Tokenizer, TokenSampler, _encode, jsonl_objects
from llmopt.errors import LlmoptError

MOONCAKE_BLOCK_SIZE = 512


class TraceEntry(BaseModel):
    """One line of a trace."""

    timestamp: float = Field(ge=0)
    input_length: int = Field(ge=1)
    output_length: int = Field(ge=1)
    hash_ids: list[int] = Field(default_factory=list)


class TraceWorkload(BaseModel):
    """Replay a Mooncake-style trace: its arrivals, lengths and shared prompt blocks."""

    kind: Literal["trace"] = "trace"
    path: str
    block_size: int = Field(MOONCAKE_BLOCK_SIZE, ge=1, description="Prompt tokens per hash id.")
    time_unit: Literal["ms", "s"] = "ms"
    time_scale: float = Field(1.0, gt=0, description="Multiplies every arrival offset: 0.5 replays 2x faster.")
    num_requests: int | None = Field(None, ge=1, description="Only the first N requests (by arrival).")
    seed: int = 0
    salt: int | None = Field(None, description="Other prompt tokens, same lengths (A/B rounds over HTTP).")
    token_ids: bool = False
    ignore_eos: bool = True

    def build(self, tokenizer: Tokenizer) -> list[BenchRequest]:
        entries = load_trace(self.path)[: self.num_requests]
        t0 = entries[0].timestamp
        unit = 1e-3 if self.time_unit == "ms" else 1.0
        sampler = TokenSampler(tokenizer, np.random.default_rng(self.seed))
        salt = 0 if self.salt is None else self.salt + 1
        fill = np.random.default_rng([self.seed, salt, 1 << 62])
        blocks: dict[int, list[int]] = {}

        def block(h: int) -> list[int]:
            if h not in blocks:
                rng = np.random.default_rng([self.seed, salt, h])
                blocks[h] = [int(t) for t in rng.choice(sampler.pool, size=self.block_size)]
            return blocks[h]

        out: list[BenchRequest] = []
        for e in entries:
            ids = [t for h in e.hash_ids for t in block(h)][: e.input_length]
            if len(ids) < e.input_length:
                ids += [int(t) for t in fill.choice(sampler.pool, size=e.input_length - len(ids))]
            arrival = (e.timestamp - t0) * unit * self.time_scale
            if self.token_ids:
                prompt: str | list[int] = ids
                n = len(ids)
            else:
                prompt = tokenizer.decode(ids)
                n = len(_encode(tokenizer, prompt))
            out.append(BenchRequest(prompt=prompt, max_tokens=e.output_length, expected_prompt_tokens=n,
                                    ignore_eos=self.ignore_eos, arrival_s=arrival))
        return out


def load_trace(path: str | Path) -> list[TraceEntry]:
    """Parse and sort a trace by arrival; a bad line is an LlmoptError naming `file:line`."""
    entries: list[TraceEntry] = []
    for where, obj in jsonl_objects(path, "trace"):
        for key in ("timestamp", "input_length", "output_length"):
            if key not in obj:
                raise LlmoptError(f"{where}: missing \"{key}\" (a trace line is {{\"timestamp\": ms, "
                                  "\"input_length\": N, \"output_length\": M, \"hash_ids\": [...]}})")
        ts, n_in, n_out = obj["timestamp"], obj["input_length"], obj["output_length"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
            raise LlmoptError(f"{where}: \"timestamp\" must be a non-negative number, got {ts!r}")
        for key, v in (("input_length", n_in), ("output_length", n_out)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LlmoptError(f"{where}: \"{key}\" must be a positive integer, got {v!r}")
        hashes = obj.get("hash_ids", [])
        if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0
                                                   for h in hashes):
            raise LlmoptError(f"{where}: \"hash_ids\" must be a list of non-negative integers")
        entries.append(TraceEntry(timestamp=float(ts), input_length=n_in, output_length=n_out, hash_ids=hashes))
    if not entries:
        raise LlmoptError(f"{Path(path)}: no requests (the trace is empty)")
    return sorted(entries, key=lambda e: e.timestamp)
