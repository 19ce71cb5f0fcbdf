"""Structured outputs: grammar-constrained decoding with llguidance.

A request names one constraint (vLLM's `structured_outputs`: json, json_object, regex, choice or a
Lark/GBNF grammar). `StructuredOutputCompiler` compiles each distinct one once (LRU cache); every
sequence gets a cheap copy of the compiled matcher, advanced as tokens are appended. Each step the
sampler sets the logits of tokens the grammar refuses to -inf before anything else, so constrained
and plain requests share a batch; the request ends ("stop") when the grammar is complete. JSON comes
in one fixed layout (json.dumps' separators), and llguidance refuses schema keywords it cannot
enforce, so every output of a compiled schema validates. `draft_masks` keeps speculation exact.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (each holds a template matcher)
MAX_ERROR_CHARS = 300
# one space after "," and ":" (as json.dumps writes and models usually do), none anywhere else
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BITS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """A constraint llguidance cannot compile; the message names the problem (one line)."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint, with vLLM's field names. `json` is a schema (dict or JSON text)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured outputs need exactly one of json, regex, choice, grammar and json_object"
                             + (f" (got {', '.join(given)})" if given else ""))
        if self.choice is not None and not self.choice:
            raise ValueError("choice must list at least one string")
        if self.regex == "" or self.grammar == "":
            raise ValueError("regex and grammar must not be empty")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar is cached under."""
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json, ensure_ascii=False)
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice, ensure_ascii=False)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""


def _one_line(msg: str) -> str:
    """llguidance errors can span lines (a caret diagram, its internal state); keep the first useful one."""
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    text = lines[0] if lines else "invalid grammar"
    if text.rstrip(":").endswith("error") and len(lines) > 1:  # "regex parse error:" then the detail
        text = f"{text} {' '.join(ln for ln in lines[1:] if ln.startswith('error:'))}".strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


class GrammarMatcher:
    """One sequence's grammar state (an llguidance LLMatcher)."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed-next-token bitmask (int32, bit t%32 of word t//32) into a contiguous CPU row."""
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token: int) -> bool:
        """Advance by one token; False if the grammar refuses it (the matcher is then in error)."""
        return self._m.consume_token(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def validate(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the grammar would accept, without advancing."""
        return self._m.validate_tokens(tokens) if tokens else 0

    @property
    def is_terminated(self) -> bool:
        """Nothing can follow (the value is complete, an end token was accepted, or an error)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return _one_line(self._m.get_error()) if self._m.is_error() else None


class StructuredOutputCompiler:
    """Compiles constraints for one tokenizer, once each (LRU cache); safe to share between threads. The
    llguidance tokenizer (~1 s for a 49k vocabulary) is built on the first compile only."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int] | tuple[int, ...],
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = [int(t) for t in eos_token_ids] or None
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer = None
        self.num_compiled = 0
        self.num_cache_hits = 0

    def _ll_tokenizer(self):
        if self._tokenizer is None:
            try:
                import llguidance.hf
            except ImportError:
                raise GrammarError("structured outputs need the llguidance package "
                                   "(pip install 'llmopt[serve]')") from None
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, self.vocab_size,
                                                               eos_token=self._eos)
            except ValueError as e:  # a slow (non-Rust) tokenizer
                raise GrammarError(f"structured outputs are not available for this tokenizer: {e}") from None
        return self._tokenizer

    @staticmethod
    def _grammar_text(kind: str, text: str, spec: StructuredOutputsParams) -> str:
        import llguidance

        try:
            if kind == "json":
                schema = json.loads(text) if isinstance(spec.json, str) else spec.json
                if not isinstance(schema, dict):
                    raise GrammarError("a JSON schema must be a JSON object")
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
            if kind == "choice":
                return llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice or []))
            return llguidance.grammar_from("regex" if kind == "regex" else "grammar", text)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        except (ValueError, TypeError, RecursionError) as e:  # GBNF that cannot be converted, odd JSON
            raise GrammarError(_one_line(str(e))) from None

    def compile(self, spec: StructuredOutputsParams):
        """The compiled template matcher for `spec` (cached); GrammarError names what is wrong with it."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return hit
            tok = self._ll_tokenizer()
        import llguidance

        grammar = self._grammar_text(*key, spec)
        try:
            template = llguidance.LLMatcher(tok, grammar, log_level=0)  # compiles; reports errors by is_error
        except BaseException as e:  # llguidance's own failure (a Rust panic is a BaseException) on odd input
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise GrammarError(f"cannot compile: {_one_line(str(e))}") from None
        if template.is_error():
            raise GrammarError(_one_line(template.get_error()))
        with self._lock:
            self._cache[key] = template
            self.num_compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return template

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one sequence: a copy of the cached compiled one."""
        return GrammarMatcher(self.compile(spec).deep_copy(), self.vocab_size)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits[i, t] = -inf wherever bit t of bitmask[i] is 0 (in place; bitmask int32 [N, words])."""
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(bitmask.shape[0], -1)[:, :logits.shape[1]]
    logits.masked_fill_(allowed.to(logits.device) == 0, float("-inf"))


def mask_rows(logits: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher]) -> None:
    """Constrain logits[rows[j]] by matchers[j]'s next-token mask, in place."""
    if not rows:
        return
    bm = torch.zeros(len(rows), bitmask_words(logits.shape[1]), dtype=torch.int32)
    for j, m in enumerate(matchers):
        m.fill_bitmask(bm[j])
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, idx)
    apply_bitmask(sub, bm)
    logits.index_copy_(0, idx, sub)


def draft_masks(grammar: GrammarMatcher, drafts: list[int], logits: torch.Tensor) -> None:
    """Constrain row i of `logits` ([len(drafts)+1, V]) by the grammar state after drafts[:i], up to the
    first draft it refuses (which the verifier then rejects: masked probability 0) or the one that
    completes it, then roll the matcher back. Later rows are never used."""
    words = bitmask_words(logits.shape[1])
    bm = torch.zeros(len(drafts) + 1, words, dtype=torch.int32)
    consumed = 0
    for i in range(len(drafts) + 1):
        grammar.fill_bitmask(bm[i])
        if i == len(drafts) or grammar.is_terminated:  # a finished matcher takes no more (rollback would miscount)
            break
        d = drafts[i]
        if not (0 <= d < logits.shape[1]) or not (int(bm[i, d >> 5]) >> (d & 31)) & 1:
            break
        grammar.accept(d)
        consumed += 1
    grammar.rollback(consumed)
    n = consumed + 1
    apply_bitmask(logits[:n], bm[:n])
