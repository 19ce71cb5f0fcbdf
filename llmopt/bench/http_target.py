"""Benchmark any OpenAI-compatible server (ours, vLLM, llama.cpp's server) over streaming HTTP.

Each request streams (`stream: true`) so that we can time the first token and every chunk after it;
`stream_options.include_usage` asks for a final usage block, whose token counts are authoritative (a chunk
may carry several tokens). Without usage we count token-bearing chunks.

A chunk is *token-bearing* when it carries generated text: completions `choices[0].text`, chat
`delta.content` (or reasoning / tool-call deltas). Unlike vLLM's client we do not count a chat chunk that
only announces `role: assistant` (llama.cpp sends it before prefill ends, which would fake a tiny TTFT),
nor a trailing chunk with only a `finish_reason`. The request's end is the last token-bearing chunk
(vLLM's latency), not the `[DONE]` line.

`ignore_eos` is a vLLM extension that strict servers reject, so it is sent only when asked for, or, left
on auto, when `/v1/models` says the server is ours (`owned_by: llmopt`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any, Literal

import httpx
from pydantic import BaseModel, Field

from llmopt.bench.records import RequestRecord
from llmopt.bench.workloads import BenchRequest
from llmopt.errors import LlmoptError

OUR_OWNER = "llmopt"


def normalize_base_url(url: str) -> str:
    """`localhost:8000/v1/` -> `http://localhost:8000`: the server root, endpoints are added per call."""
    u = url.strip()
    if not u:
        raise LlmoptError("empty server URL")
    if "://" not in u:
        u = "http://" + u
    u = u.rstrip("/")
    if u.endswith("/v1"):
        u = u[: -len("/v1")]
    return u


# ------------------------------------------------------------------------------------------------ SSE


class SseParser:
    """Incremental Server-Sent Events parser: feed decoded text, get back complete `data` payloads.

    Follows the SSE framing rules that matter here: lines end in LF, CRLF or CR; `data:` lines (one optional
    space after the colon) accumulate, joined by newlines, until a blank line dispatches the event;
    lines starting with `:` are comments (keep-alive pings); other fields (`event:`, `id:`) are ignored.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []

    def feed(self, text: str) -> list[str]:
        self._buf += text
        events: list[str] = []
        while True:
            cut = self._line_end()
            if cut is None:
                break
            end, nxt = cut
            line, self._buf = self._buf[:end], self._buf[nxt:]
            self._line(line, events)
        return events

    def flush(self) -> list[str]:
        """End of stream: a last event without its terminating blank line still counts."""
        events: list[str] = []
        if self._buf:
            self._line(self._buf, events)
            self._buf = ""
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line_end(self) -> tuple[int, int] | None:
        for i, ch in enumerate(self._buf):
            if ch == "\n":
                return i, i + 1
            if ch == "\r":
                if i + 1 == len(self._buf):
                    return None  # a CR at the end of the buffer may be the first half of CRLF
                return i, i + 2 if self._buf[i + 1] == "\n" else i + 1
        return None

    def _line(self, line: str, events: list[str]) -> None:
        if line == "":
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            return
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


def _chunk_has_token(obj: dict[str, Any], chat: bool) -> bool:
    choices = obj.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    if not chat:
        text = choice.get("text")
        return text is not None and (text != "" or choice.get("finish_reason") is None)
    delta = choice.get("delta") or {}
    for key in ("content", "reasoning_content", "reasoning"):
        if delta.get(key):
            return True
    if delta.get("tool_calls"):
        return True
    # an empty content delta mid-stream is a token that detokenized to nothing; a role-only or
    # finish-only delta is not
    return "content" in delta and delta.get("content") == "" and "role" not in delta \
        and choice.get("finish_reason") is None


def _chunk_text(obj: dict[str, Any], chat: bool) -> str:
    choice = obj["choices"][0]
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    return text if isinstance(text, str) else ""


def _spread(total: int, chunks: int) -> list[int]:
    """Split `total` tokens over `chunks` chunks as evenly as integers allow (at least 1 each)."""
    if chunks <= 0:
        return []
    if total <= chunks:
        return [1] * chunks
    base, extra = divmod(total, chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


# ----------------------------------------------------------------------------------------- the client


# httpx's message when a connection closed before any response byte. Servers (llama.cpp's cpp-httplib)
# close idle keep-alive connections; a request the client had already put on one never reached the
# server, so `send` resends it once instead of counting a server failure.
STALE_CONNECTION = "without sending a response"


class HttpTargetConfig(BaseModel):
    """Where and how to send requests."""

    base_url: str
    model: str | None = Field(None, description="Model name to send; None: the first of /v1/models.")
    endpoint: Literal["auto", "completions", "chat"] = Field(
        "auto", description="auto: chat for message prompts, completions otherwise.")
    send_ignore_eos: bool | None = Field(
        None, description="Send the ignore_eos extension; None: only if the server is llmopt's.")
    temperature: float = 0.0
    timeout_s: float = Field(600.0, gt=0, description="Per-request deadline, connection to last byte.")
    connect_timeout_s: float = Field(10.0, gt=0)
    api_key: str | None = None
    extra_body: dict[str, Any] = Field(default_factory=dict, description="Merged into every request body.")
    max_connections: int | None = Field(None, ge=1, description="Connection pool size; None: unlimited.")


class HttpTarget:
    """Streaming OpenAI-compatible client; `send` is the `run_load` callback. Use as an async context."""

    def __init__(self, config: HttpTargetConfig):
        self.config = config
        self.base_url = normalize_base_url(config.base_url)
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=None),
        )
        self.model: str | None = config.model
        self.owned_by: str | None = None
        self.send_ignore_eos: bool = bool(config.send_ignore_eos)

    async def __aenter__(self) -> HttpTarget:
        await self.prepare()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.client.aclose()

    async def prepare(self) -> None:
        """Ask /v1/models for the model name and owner; servers without it still work (no `model` sent)."""
        try:
            r = await self.client.get("/v1/models", timeout=self.config.connect_timeout_s)
            data = r.json().get("data") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            data = None
        if data and isinstance(data, list) and isinstance(data[0], dict):
            self.owned_by = data[0].get("owned_by")
            if self.model is None:
                self.model = data[0].get("id")
        if self.config.send_ignore_eos is None:
            self.send_ignore_eos = self.owned_by == OUR_OWNER

    async def probe(self, chat: bool) -> None:
        """One short request before the run, as vLLM's bench sends: a client error here (a model name the
        server does not serve, a missing API key, an endpoint it lacks) would fail every request of the run,
        so it stops the run in one line. Server errors and overload (5xx, 429) stay results, counted as
        ever. The prompt is not the workload's, so no prefix cache is warmed by it."""
        prompt: str | list[dict[str, str]] = [{"role": "user", "content": "Hi"}] if chat else "Hi"
        rec = await self.send(BenchRequest(prompt=prompt, max_tokens=1))  # type: ignore[arg-type]
        code = rec.error_code or ""
        if code.startswith("http_4") and code not in ("http_408", "http_429"):
            raise LlmoptError(f"{self.base_url} refused a test request, so every request would fail: {rec.error}")

    def endpoint_for(self, req: BenchRequest) -> Literal["completions", "chat"]:
        """The API a request goes to; token-id prompts cannot go to chat."""
        if self.config.endpoint == "auto":
            return "chat" if req.is_chat else "completions"
        if self.config.endpoint == "completions" and req.is_chat:
            raise LlmoptError("chat-message prompts need the chat endpoint (--endpoint chat or auto)")
        if self.config.endpoint == "chat" and isinstance(req.prompt, list) and not req.is_chat:
            raise LlmoptError("token-id prompts need the completions endpoint (--endpoint completions or auto)")
        return self.config.endpoint

    def validate_requests(self, requests: list[BenchRequest]) -> None:
        """Reject a workload/endpoint mismatch before the run instead of failing every request."""
        for req in requests:
            self.endpoint_for(req)

    def build_payload(self, req: BenchRequest) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) for one request."""
        kind = self.endpoint_for(req)
        body: dict[str, Any] = {}
        if self.model:
            body["model"] = self.model
        if kind == "chat":
            path = "/v1/chat/completions"
            body["messages"] = req.prompt if req.is_chat else [{"role": "user", "content": req.prompt}]
        else:
            path = "/v1/completions"
            body["prompt"] = req.prompt
        body.update(max_tokens=req.max_tokens, temperature=self.config.temperature, stream=True,
                    stream_options={"include_usage": True})
        if self.send_ignore_eos:
            body["ignore_eos"] = req.ignore_eos
        body.update(self.config.extra_body)
        return path, body

    async def send(self, req: BenchRequest) -> RequestRecord:
        """Send one request and time its stream. Never raises for server or network failures."""
        path, body = self.build_payload(req)
        chat = path.endswith("chat/completions")
        prompt_est = req.expected_prompt_tokens or 0
        start = time.perf_counter()

        def fail(code: str, msg: str) -> RequestRecord:
            return RequestRecord.failure(start=start, end=time.perf_counter(), error_code=code, error=msg,
                                         prompt_tokens=prompt_est)

        async def stream(state: _StreamState) -> tuple[str, str] | None:
            """Read the whole response into `state`; (error_code, message) when it is not a good stream."""
            async with self.client.stream("POST", path, json=body) as resp:
                state.answered = True
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode("utf-8", "replace").strip().replace("\n", " ")
                    return f"http_{resp.status_code}", f"HTTP {resp.status_code}: {detail[:300]}"
                parser = SseParser()
                async for text in resp.aiter_text():
                    problem = state.handle(parser.feed(text), time.perf_counter())
                    if problem:
                        return problem
                return state.handle(parser.flush(), time.perf_counter())

        for attempt in range(2):
            state = _StreamState(chat)
            left = self.config.timeout_s - (time.perf_counter() - start)
            try:
                problem = await asyncio.wait_for(stream(state), left)  # one deadline for the whole request
            except TimeoutError:  # builtin TimeoutError from 3.11 on, a separate class on 3.10
                return fail("timeout", f"no complete response within {self.config.timeout_s:g} s")
            except httpx.TimeoutException as e:
                return fail("timeout", f"{type(e).__name__}: {e or 'timed out'}")
            except httpx.ConnectError as e:
                return fail("connect_error", f"cannot connect to {self.base_url}: {e}")
            except httpx.RemoteProtocolError as e:
                if attempt == 0 and not state.answered and STALE_CONNECTION in str(e):
                    continue  # see STALE_CONNECTION: resent once, the latency keeps the lost attempt
                return fail("protocol_error", f"{e}")
            except httpx.HTTPError as e:
                return fail(f"http_error:{type(e).__name__}", f"{type(e).__name__}: {e}")
            break
        if problem:
            return fail(*problem)
        if not state.times:
            return fail("no_tokens", "the stream ended without any generated token")
        prompt_tokens, output_tokens, counts = state.totals(prompt_est)
        rec = RequestRecord.from_chunks(start=start, token_times=state.times, chunk_token_counts=counts,
                                        prompt_tokens=prompt_tokens, output_tokens=output_tokens)
        rec.output_text = "".join(state.text)
        return rec


class _StreamState:
    """Accumulates chunk arrivals and usage over one response stream."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.times: list[float] = []
        self.counts: list[int] = []
        self.per_chunk_usage = False
        self.cum_completion = 0
        self.usage: dict[str, Any] | None = None
        self.answered = False  # response headers arrived
        self.text: list[str] = []  # the generated text, which a conversation's next turn resends

    def handle(self, events: list[str], now: float) -> tuple[str, str] | None:
        """Consume SSE payloads that arrived at `now`; returns (error_code, message) on a bad stream."""
        for data in events:
            if data.strip() == "[DONE]":
                continue
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                return "bad_response", f"stream chunk is not JSON: {data[:200]!r}"
            if not isinstance(obj, dict):
                return "bad_response", f"stream chunk is not an object: {data[:200]!r}"
            if obj.get("error") and not obj.get("choices"):
                err = obj["error"]
                msg = err.get("message", err) if isinstance(err, dict) else err
                return "stream_error", f"server error mid-stream: {msg}"
            usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else None
            if _chunk_has_token(obj, self.chat):
                self.text.append(_chunk_text(obj, self.chat))
                n = 1
                ct = usage.get("completion_tokens") if usage else None
                if isinstance(ct, int):  # continuous usage stats: exact tokens per chunk
                    self.per_chunk_usage = True
                    n = max(ct - self.cum_completion, 1)
                    self.cum_completion = ct
                self.times.append(now)
                self.counts.append(n)
            if usage:
                self.usage = usage
        return None

    def totals(self, prompt_estimate: int) -> tuple[int, int, list[int]]:
        """(prompt tokens, output tokens, tokens per chunk), preferring the server's usage block."""
        prompt_tokens, output_tokens, counts = prompt_estimate, sum(self.counts), self.counts
        u = self.usage or {}
        if isinstance(u.get("prompt_tokens"), int):
            prompt_tokens = u["prompt_tokens"]
        if isinstance(u.get("completion_tokens"), int) and u["completion_tokens"] > 0:
            output_tokens = u["completion_tokens"]
            if not self.per_chunk_usage and output_tokens != len(self.times):
                counts = _spread(output_tokens, len(self.times))  # best estimate of tokens per chunk
        return prompt_tokens, output_tokens, counts


# ------------------------------------------------------------------------------------ reachability


def _reason(e: Exception) -> str:
    text = str(e).lower()
    for needle, reason in (("refused", "connection refused"), ("name or service", "unknown host"),
                           ("nodename nor servname", "unknown host"), ("no address", "unknown host"),
                           ("unreachable", "network unreachable")):
        if needle in text:
            return reason
    if isinstance(e, httpx.TimeoutException):
        return "timed out"
    return str(e) or type(e).__name__


def check_reachable(url: str, timeout_s: float = 3.0) -> None:
    """Fail fast with a one-line LlmoptError when nothing answers HTTP at `url`.

    Any HTTP response counts as reachable (a 404 on /v1/models still proves a server is there).
    """
    base = normalize_base_url(url)
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout_s)) as client:
            client.get(base + "/v1/models")
    except httpx.InvalidURL as e:
        raise LlmoptError(f"invalid server URL {url!r}: {e}") from None
    except httpx.HTTPError as e:
        raise LlmoptError(f"cannot reach {base}: {_reason(e)}") from None


# ------------------------------------------------------------------------------- Prometheus metrics


class MetricsSnapshot(BaseModel):
    """One scrape of `/metrics`: sample name -> value, summed over label sets (counters, gauges, sums)."""

    values: dict[str, float]
    taken_at: float = Field(description="time.time() of the scrape.")


async def scrape_metrics(url: str, *, client: httpx.AsyncClient | None = None,
                         timeout_s: float = 5.0) -> MetricsSnapshot | None:
    """Fetch and parse `/metrics`; None when the server has none (llama.cpp without --metrics) or it fails."""
    from prometheus_client.parser import text_string_to_metric_families

    target = normalize_base_url(url) + "/metrics"
    own = client is None
    c = client or httpx.AsyncClient(timeout=timeout_s)
    try:
        r = await c.get(target, timeout=timeout_s)
        if r.status_code != 200:
            return None
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                if s.name.endswith(("_bucket", "_created")) or not math.isfinite(s.value):
                    continue
                values[s.name] = values.get(s.name, 0.0) + float(s.value)
        return MetricsSnapshot(values=values, taken_at=time.time())
    except Exception:  # best-effort diagnostics: a missing or malformed /metrics must not fail a benchmark
        return None
    finally:
        if own:
            await c.aclose()


class ServerMetrics(BaseModel):
    """What the server itself counted during a run (deltas of its counters); None where not exported."""

    prefix_cache_hits: float | None = Field(None, description="Prompt tokens served from the prefix cache.")
    prefix_cache_queries: float | None = Field(None, description="Prompt tokens looked up in the prefix cache.")
    prefix_cache_hit_rate: float | None = None
    spec_decode_draft_tokens: float | None = None
    spec_decode_accepted_tokens: float | None = None
    spec_decode_acceptance_rate: float | None = Field(None, description="Accepted / proposed draft tokens.")
    spec_decode_mean_acceptance_length: float | None = Field(
        None, description="Tokens emitted per verification step: 1 + accepted / drafts.")
    preemptions: float | None = None
    kv_cache_usage_peak: float | None = Field(
        None, description="Highest KV-cache pool usage (0..1) seen during the run; offline engine only.")
    mean_batch_size: float | None = Field(
        None, description="Sequences per engine step, averaged over steps that ran; offline engine only.")
    counters: dict[str, float] = Field(
        default_factory=dict,
        description="Counters that changed during the run: every *_total over HTTP, engine step counts offline.")


_PREFIXES = ("llmopt:", "vllm:")


def _delta(before: MetricsSnapshot, after: MetricsSnapshot, *names: str) -> float | None:
    """Counter increase for the first name found (with our or vLLM's prefix, with or without _total)."""
    for name in names:
        for prefix in _PREFIXES:
            for key in (f"{prefix}{name}_total", f"{prefix}{name}"):
                if key in after.values:
                    d = after.values[key] - before.values.get(key, 0.0)  # counters may appear lazily
                    return d if d >= 0 else None  # a reset (server restart) makes the delta meaningless
    return None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def diff_metrics(before: MetricsSnapshot | None, after: MetricsSnapshot | None) -> ServerMetrics | None:
    """Derive per-run server metrics from two scrapes; tolerant of any metric being absent."""
    if before is None or after is None:
        return None
    hits = _delta(before, after, "prefix_cache_hits")
    queries = _delta(before, after, "prefix_cache_queries")
    drafts = _delta(before, after, "spec_decode_num_drafts")
    draft_tokens = _delta(before, after, "spec_decode_num_draft_tokens")
    accepted = _delta(before, after, "spec_decode_num_accepted_tokens")
    accept_len = None
    if accepted is not None and drafts:
        accept_len = 1.0 + accepted / drafts
    counters = {k: v - before.values.get(k, 0.0) for k, v in after.values.items()
                if k.endswith("_total") and v != before.values.get(k, 0.0)}
    return ServerMetrics(
        prefix_cache_hits=hits,
        prefix_cache_queries=queries,
        prefix_cache_hit_rate=_ratio(hits, queries),
        spec_decode_draft_tokens=draft_tokens,
        spec_decode_accepted_tokens=accepted,
        spec_decode_acceptance_rate=_ratio(accepted, draft_tokens),
        spec_decode_mean_acceptance_length=accept_len,
        preemptions=_delta(before, after, "num_preemptions", "preemptions"),
        counters=counters,
    )
