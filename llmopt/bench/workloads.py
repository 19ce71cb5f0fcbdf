"""Workloads: the list of requests a benchmark sends, reproducible from a small pydantic spec.

Random prompts are built from the *target's* tokenizer so that "512 input tokens" means 512 tokens to the
model under test, not 512 words. A tokenizer here is any object with `encode(text)` and `decode(ids)`
(every Hugging Face tokenizer qualifies). Token-id prompts are exact; text prompts are decoded random
tokens that we re-encode and adjust until the length matches, because decode/encode does not round-trip
in general (byte-level BPE merges across token boundaries). `expected_prompt_tokens` is always the
re-encoded length of what is actually sent (without special tokens such as BOS).

`ignore_eos` defaults on: a benchmark wants exactly `max_tokens` of decode per request, or output
lengths, and with them every throughput number, would depend on what a random-weight model happens to say.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, Union

import numpy as np
from pydantic import BaseModel, Field, field_validator

from llmopt.errors import LlmoptError

Message = dict[str, Any]


class Tokenizer(Protocol):
    """The two methods we need; any Hugging Face tokenizer satisfies it."""

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any: ...

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> str: ...


class BenchRequest(BaseModel):
    """One request to send: a text prompt, token ids (completions API) or chat messages (chat API)."""

    prompt: Union[str, list[int], list[Message]]
    max_tokens: int = Field(ge=1)
    expected_prompt_tokens: int | None = Field(None, description="Prompt tokens as we counted them, if known.")
    ignore_eos: bool = True
    arrival_s: float | None = Field(None, ge=0, description="Trace replay: send offset (s) from the run's start.")

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], dict)


# ---------------------------------------------------------------------------------------------- lengths

_INT = r"([0-9]+)"
_NUM = r"([0-9]*\.?[0-9]+)"


class LengthDist(BaseModel):
    """A token-length distribution: fixed `N`, uniform `LO:HI` (inclusive) or `normal:MEAN,STD`.

    Normal samples are rounded and clipped to at least 1 token.
    """

    kind: Literal["fixed", "uniform", "normal"]
    lo: int = 1
    hi: int = 1
    mean: float = 0.0
    std: float = 0.0

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [self.lo] * n
        if self.kind == "uniform":
            return [int(v) for v in rng.integers(self.lo, self.hi + 1, size=n)]
        return [max(1, int(round(v))) for v in rng.normal(self.mean, self.std, size=n)]


def parse_length(text: str | int) -> LengthDist:
    """Parse `128`, `64:256` or `normal:128,32` into a `LengthDist`."""
    s = str(text).strip().lower()
    if m := re.fullmatch(_INT, s):
        v = int(m.group(1))
        if v < 1:
            raise LlmoptError(f"token length must be at least 1, got {text!r}")
        return LengthDist(kind="fixed", lo=v, hi=v, mean=v)
    if m := re.fullmatch(rf"{_INT}\s*:\s*{_INT}", s):
        lo, hi = int(m.group(1)), int(m.group(2))
        if lo < 1 or hi < lo:
            raise LlmoptError(f"uniform length range {text!r} needs 1 <= LO <= HI")
        return LengthDist(kind="uniform", lo=lo, hi=hi, mean=(lo + hi) / 2)
    if m := re.fullmatch(rf"normal\s*:\s*{_NUM}\s*,\s*{_NUM}", s):
        mean, std = float(m.group(1)), float(m.group(2))
        if mean < 1:
            raise LlmoptError(f"normal length {text!r} needs a mean of at least 1")
        return LengthDist(kind="normal", mean=mean, std=std)
    raise LlmoptError(f"cannot parse token length {text!r}: use N, LO:HI or normal:MEAN,STD (e.g. 512, 64:256)")


def _length_field(v: Any) -> str:
    parse_length(v)  # raises LlmoptError with a clear message
    return str(v).strip()


# ------------------------------------------------------------------------------------- token sampling


def _encode(tok: Tokenizer, text: str) -> list[int]:
    try:
        ids = tok.encode(text, add_special_tokens=False)
    except TypeError:  # non-HF tokenizers (tiktoken-style) have no such keyword
        ids = tok.encode(text)
    return [int(i) for i in ids]


def _vocab_size(tok: Any) -> int:
    for get in (lambda: len(tok), lambda: tok.vocab_size, lambda: tok.n_vocab):
        try:
            n = int(get())
        except (TypeError, AttributeError):
            continue
        if n > 0:
            return n
    raise LlmoptError("the tokenizer does not tell its vocabulary size (no len(), vocab_size or n_vocab)")


class TokenSampler:
    """Draws random prompt tokens that survive a decode/encode round trip.

    Candidates are (up to `max_candidates` of) the non-special ids; we keep those whose text is printable
    and re-encodes to the same single id, so random text keeps close to the intended length.
    """

    def __init__(self, tokenizer: Tokenizer, rng: np.random.Generator, max_candidates: int = 8192):
        self.tok = tokenizer
        self.rng = rng
        special = {int(i) for i in getattr(tokenizer, "all_special_ids", None) or []}
        vocab = _vocab_size(tokenizer)
        ids = np.array([i for i in range(vocab) if i not in special], dtype=np.int64)
        if ids.size > max_candidates:
            ids = np.sort(rng.choice(ids, size=max_candidates, replace=False))
        clean = []
        for i in ids.tolist():
            s = tokenizer.decode([i])
            if s and s.isprintable() and "\ufffd" not in s and _encode(tokenizer, s) == [i]:
                clean.append(i)
        self.pool = np.array(clean, dtype=np.int64) if clean else ids
        if self.pool.size == 0:
            raise LlmoptError("the tokenizer has no usable (non-special) tokens to build prompts from")

    def ids(self, n: int) -> list[int]:
        return [int(i) for i in self.rng.choice(self.pool, size=n)] if n > 0 else []

    def text(self, n: int, max_rounds: int = 10) -> tuple[str, int]:
        """Random text that encodes to `n` tokens if we can get there, else the closest; (text, length)."""
        ids = self.ids(n)
        best: tuple[str, int] | None = None
        for _ in range(max_rounds):
            text = self.tok.decode(ids)
            enc = _encode(self.tok, text)
            if best is None or abs(len(enc) - n) < abs(best[1] - n):
                best = (text, len(enc))
            if len(enc) == n:
                break
            ids = enc[:n] if len(enc) > n else enc + self.ids(n - len(enc))
        assert best is not None
        return best


# ------------------------------------------------------------------------------------------ workloads


def _token_rng(rng: np.random.Generator, seed: int, salt: int | None) -> np.random.Generator:
    """The generator prompt tokens come from: the lengths' own without a salt (the historic streams),
    else a separate one, so that a salt changes the tokens and never the lengths."""
    return rng if salt is None else np.random.default_rng([seed, salt])


class RandomWorkload(BaseModel):
    """Random prompts with input/output lengths drawn from distributions (vLLM's `random` dataset)."""

    kind: Literal["random"] = "random"
    num_requests: int = Field(100, ge=1)
    input_len: str = "512"
    output_len: str = "128"
    seed: int = 0
    token_ids: bool = Field(False, description="Send token ids instead of text (exact prompt lengths).")
    ignore_eos: bool = True
    salt: int | None = Field(None, description="Other prompt tokens, same lengths (A/B rounds over HTTP).")

    _check_lengths = field_validator("input_len", "output_len", mode="before")(_length_field)

    def build(self, tokenizer: Tokenizer) -> list[BenchRequest]:
        rng = np.random.default_rng(self.seed)
        sampler = TokenSampler(tokenizer, _token_rng(rng, self.seed, self.salt))
        in_lens = parse_length(self.input_len).sample(rng, self.num_requests)
        out_lens = parse_length(self.output_len).sample(rng, self.num_requests)
        out: list[BenchRequest] = []
        for n_in, n_out in zip(in_lens, out_lens, strict=True):
            if self.token_ids:
                prompt: str | list[int] = sampler.ids(n_in)
                n = n_in
            else:
                prompt, n = sampler.text(n_in)
            out.append(BenchRequest(prompt=prompt, max_tokens=n_out, expected_prompt_tokens=n,
                                    ignore_eos=self.ignore_eos))
        return out


class PrefixWorkload(BaseModel):
    """`num_prefixes` shared prefixes of `prefix_len` tokens, each request adding a unique suffix.

    Requests cycle through the prefixes round-robin, so a server with prefix caching should hit on all but
    the first request of each prefix. In text mode a newline separates prefix and suffix so the tokenizer
    cannot merge tokens across the boundary and every request sees the same prefix tokens.
    """

    kind: Literal["prefix"] = "prefix"
    num_requests: int = Field(100, ge=1)
    num_prefixes: int = Field(4, ge=1)
    prefix_len: int = Field(512, ge=1)
    suffix_len: str = "64"
    output_len: str = "128"
    seed: int = 0
    token_ids: bool = False
    ignore_eos: bool = True
    salt: int | None = Field(None, description="Other prompt tokens, same lengths (A/B rounds over HTTP).")

    _check_lengths = field_validator("suffix_len", "output_len", mode="before")(_length_field)

    def build(self, tokenizer: Tokenizer) -> list[BenchRequest]:
        rng = np.random.default_rng(self.seed)
        sampler = TokenSampler(tokenizer, _token_rng(rng, self.seed, self.salt))
        suffix_lens = parse_length(self.suffix_len).sample(rng, self.num_requests)
        out_lens = parse_length(self.output_len).sample(rng, self.num_requests)
        if self.token_ids:
            prefix_ids = [sampler.ids(self.prefix_len) for _ in range(self.num_prefixes)]
        else:
            prefix_texts = [sampler.text(self.prefix_len)[0] for _ in range(self.num_prefixes)]
        out: list[BenchRequest] = []
        for i, (n_suf, n_out) in enumerate(zip(suffix_lens, out_lens, strict=True)):
            p = i % self.num_prefixes
            if self.token_ids:
                ids = prefix_ids[p] + sampler.ids(n_suf)
                out.append(BenchRequest(prompt=ids, max_tokens=n_out, expected_prompt_tokens=len(ids),
                                        ignore_eos=self.ignore_eos))
            else:
                text = prefix_texts[p] + "\n" + sampler.text(n_suf)[0]
                out.append(BenchRequest(prompt=text, max_tokens=n_out,
                                        expected_prompt_tokens=len(_encode(tokenizer, text)),
                                        ignore_eos=self.ignore_eos))
        return out


class JsonlWorkload(BaseModel):
    """Requests from a file, one JSON object per line: `{"prompt": ... | "messages": [...], "max_tokens": N}`.

    `prompt` is text or a list of token ids; `messages` is an OpenAI chat list. Optional per line:
    `ignore_eos`. With `num_requests` larger than the file, lines are reused in order.
    """

    kind: Literal["jsonl"] = "jsonl"
    path: str
    num_requests: int | None = Field(None, ge=1)
    default_max_tokens: int | None = Field(None, ge=1, description="For lines without max_tokens.")
    ignore_eos: bool = True

    def build(self, tokenizer: Tokenizer | None = None) -> list[BenchRequest]:
        reqs = load_jsonl(self.path, tokenizer=tokenizer, default_max_tokens=self.default_max_tokens,
                          ignore_eos=self.ignore_eos)
        if self.num_requests is None:
            return reqs
        return [reqs[i % len(reqs)] for i in range(self.num_requests)]


WorkloadSpec = Annotated[Union[RandomWorkload, PrefixWorkload, JsonlWorkload], Field(discriminator="kind")]


def build_requests(spec: RandomWorkload | PrefixWorkload | JsonlWorkload,
                   tokenizer: Tokenizer | None) -> list[BenchRequest]:
    """Materialize a workload. Random and prefix workloads need the target's tokenizer."""
    if isinstance(spec, JsonlWorkload):
        return spec.build(tokenizer)
    if tokenizer is None:
        raise LlmoptError(f"the {spec.kind} workload needs a tokenizer (pass --tokenizer or a model)")
    return spec.build(tokenizer)


# ------------------------------------------------------------------------------------------- jsonl


def _count_chat_tokens(tok: Any, messages: list[Message]) -> int | None:
    apply = getattr(tok, "apply_chat_template", None)
    if apply is None:
        return None
    try:
        ids = apply(messages, tokenize=True, add_generation_prompt=True)
    except Exception:  # no template, or a template that rejects these messages: unknown, not fatal
        return None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return len(ids)


def _is_messages(v: Any) -> bool:
    return (isinstance(v, list) and bool(v) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list))
        for m in v))


def jsonl_objects(path: str | Path, what: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`file:line`, object) for each non-blank line of a JSONL file; an unreadable file or a line that is not a
    JSON object is an LlmoptError naming `what` or `file:line`."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise LlmoptError(f"cannot read {what} {p}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise LlmoptError(f"{p}: not UTF-8 text ({e.reason})") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{p}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise LlmoptError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise LlmoptError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        yield where, obj


def load_jsonl(
    path: str | Path,
    *,
    tokenizer: Tokenizer | None = None,
    default_max_tokens: int | None = None,
    ignore_eos: bool = True,
) -> list[BenchRequest]:
    """Parse a JSONL workload; any bad line is an LlmoptError naming `file:line`."""
    out: list[BenchRequest] = []
    for where, obj in jsonl_objects(path, "workload file"):
        has_prompt, has_messages = "prompt" in obj, "messages" in obj
        if has_prompt == has_messages:
            raise LlmoptError(f"{where}: give exactly one of \"prompt\" or \"messages\"")
        expected: int | None = None
        prompt: str | list[int] | list[Message]
        if has_prompt:
            prompt = obj["prompt"]
            if isinstance(prompt, str):
                if not prompt:
                    raise LlmoptError(f"{where}: \"prompt\" is empty")
                expected = len(_encode(tokenizer, prompt)) if tokenizer is not None else None
            elif isinstance(prompt, list) and prompt and all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
                expected = len(prompt)
            else:
                raise LlmoptError(f"{where}: \"prompt\" must be a non-empty string or list of token ids")
        else:
            messages = obj["messages"]
            if not _is_messages(messages):
                raise LlmoptError(f"{where}: \"messages\" must be a non-empty list of {{role, content}} objects")
            prompt = messages
            expected = _count_chat_tokens(tokenizer, messages) if tokenizer is not None else None
        max_tokens = obj.get("max_tokens", default_max_tokens)
        if max_tokens is None:
            raise LlmoptError(f"{where}: missing \"max_tokens\" (or pass a default)")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise LlmoptError(f"{where}: \"max_tokens\" must be a positive integer, got {max_tokens!r}")
        line_eos = obj.get("ignore_eos", ignore_eos)
        if not isinstance(line_eos, bool):
            raise LlmoptError(f"{where}: \"ignore_eos\" must be true or false")
        out.append(BenchRequest(prompt=prompt, max_tokens=max_tokens, expected_prompt_tokens=expected,
                                ignore_eos=line_eos))
    if not out:
        raise LlmoptError(f"{Path(path)}: no requests (the file is empty)")
    return out


def describe_lengths(requests: Sequence[BenchRequest]) -> str:
    """`N requests, prompt ~A tokens, max_tokens ~B` for logs and reports."""
    known = [r.expected_prompt_tokens for r in requests if r.expected_prompt_tokens is not None]
    p = f"prompt ~{np.mean(known):.0f} tokens" if known else "prompt length unknown"
    return f"{len(requests)} requests, {p}, max_tokens ~{np.mean([r.max_tokens for r in requests]):.0f}"
