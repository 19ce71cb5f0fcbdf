"""The request pipeline shared by /v1/completions and /v1/chat/completions.

Order matters for cost: readiness, model name and capacity are checked from counters before any
tokenizing; then prompts are tokenized and measured (400 for what can never run); then the request is
admitted (429 when the queue is full), handed to the engine thread, and its events are either streamed
as SSE or collected into one response. Whatever happens to the HTTP side (client gone, error, shutdown),
`Job.close` aborts the engine requests still running, so their KV blocks are freed in the next step, and
returns the admission ticket.

Completions with `echo` put the prompt in front of each choice (its text, and its tokens' logprobs from
the engine's prefill, the first one null); `max_tokens: 0` with echo asks the engine for one token and
returns none of it (the prompt is scored by the same forward pass that samples that token). `best_of`
generates best_of completions per prompt and returns the n with the highest cumulative logprob.
/tokenize and /detokenize answer from the server's own tokenizer, without the engine.

Structured outputs (llmopt.serve.structured) are compiled before the request is admitted, so a bad
constraint is a 400 even when streaming. Chat with tools (llmopt.serve.tools) offers them through the
prompt; `tool_choice` required or a named function adds a grammar that only admits calls; every
choice's text goes through one `ToolCallParser`, whole or streamed, into `tool_calls` (finish_reason
"tool_calls" when the model stopped after calling) and the remaining content.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.structured_output import StructuredOutputsParams
from llmopt.serve.admission import Ticket
from llmopt.serve.engine_loop import EventSink, StreamEvent
from llmopt.serve.errors import ApiError, error_body
from llmopt.serve.prompts import PromptBuilder
from llmopt.serve.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from llmopt.serve.responses import (
    ChoiceState,
    Usage,
    chat_logprobs,
    completion_logprobs,
    echo_items,
    now_s,
    prompt_logprobs_json,
    sse,
)
from llmopt.serve.semantic_cache import CachedAnswer, Probe, bypass_reason, scope_of
from llmopt.serve.state import ServerState
from llmopt.serve.structured import compile_constraint, requested_constraint
from llmopt.serve.tools import ToolCallParser, parse_tool_calls, tool_dicts, tool_grammar


class Job:
    """One HTTP request's engine requests: their events, accumulated choices and usage, and cleanup."""

    def __init__(self, state: ServerState, job_id: str, request_ids: list[str], prompt_lens: list[int], n: int,
                 ticket: Ticket, sink: EventSink, count_output: bool = True):
        """`n`: engine completions per prompt; `count_output` False: generated tokens are discarded (echo
        with max_tokens 0), so usage counts none."""
        self.state = state
        self.id = job_id
        self.request_ids = request_ids
        self.n = n
        self.ticket = ticket
        self.sink = sink
        self.unfinished = set(request_ids)
        self.choices = {i: ChoiceState(i) for i in range(len(request_ids) * n)}
        self.usage = Usage(prompt_tokens=sum(prompt_lens))
        self.count_output = count_output
        self.prompt_logprobs: dict[int, tuple] = {}  # tag -> the engine's prompt logprobs
        self._cached: dict[str, int] = {}
        self.error: StreamEvent | None = None
        self._closed = False

    @property
    def done(self) -> bool:
        return not self.unfinished or self.error is not None

    def apply(self, ev: StreamEvent) -> None:
        if ev.finished:
            self.unfinished.discard(ev.request_id)
        if ev.error is not None:
            self.error = ev
            return
        self._cached[ev.request_id] = max(self._cached.get(ev.request_id, 0), ev.num_cached_tokens)
        self.usage.cached_tokens = sum(self._cached.values())
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs[ev.tag] = ev.prompt_logprobs
        for d in ev.choices:
            self.choices[ev.tag * self.n + d.index].add(d)
            if self.count_output:
                self.usage.completion_tokens += len(d.token_ids)

    async def next_event(self) -> StreamEvent:
        ev = await self.sink.queue.get()
        self.apply(ev)
        return ev

    async def run_to_end(self) -> None:
        while not self.done:
            await self.next_event()

    def close(self) -> None:
        """Abort what still runs (client gone, error) and give the admission ticket back. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for rid in self.unfinished:
            self.state.engine_loop.abort(rid, "abort")
        self.state.admission.release(self.ticket)


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that always runs `on_close`, even if its body is never iterated."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


BIG_PROMPT_CHARS = 16384  # ~4 ms of tokenizing; larger prompts are tokenized off the event loop


async def _off_loop(size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """Tokenize big prompts in a worker thread (a 4 MiB prompt takes seconds) so streams keep flowing."""
    if size > BIG_PROMPT_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class OpenAIServing:
    def __init__(self, state: ServerState):
        self.state = state

    # ---- checks ---------------------------------------------------------------------------------
    def _serving(self) -> PromptBuilder:
        st = self.state
        if st.draining:
            st.metrics.reject("shutting_down")
            raise ApiError(503, "server is shutting down", code="shutting_down", headers={"Connection": "close"})
        if not st.ready or st.prompts is None:
            st.metrics.reject("not_ready")
            raise ApiError(503, "server is starting (model loading or warm-up); retry later", code="not_ready",
                           headers={"Retry-After": "5"})
        return st.prompts

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.state.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.state.model_name!r}", param="model", code="model_not_found")

    def _priority(self, key: str | None, requested: int | None) -> int:
        if requested and not self.state.config.enable_priorities:
            raise ApiError(400, "priority needs priority scheduling, which this server has off", param="priority")
        return self.state.auth.priority(key, requested)

    def _check_length(self, prompts: PromptBuilder, ids: list[int], param: str) -> None:
        try:
            prompts.check_length(ids, param)
        except ApiError:
            self.state.metrics.reject("too_long")
            raise

    def _logit_bias(self, req: CompletionRequest | ChatCompletionRequest,
                    prompts: PromptBuilder) -> dict[int, float] | None:
        bias = req.token_bias()
        if bias and max(bias) >= prompts.vocab_size:
            raise ApiError(400, f"logit_bias: token ids must be in [0, {prompts.vocab_size}), got {max(bias)}",
                           param="logit_bias")
        return bias

    def _params(self, req: CompletionRequest | ChatCompletionRequest, prompt_len: int, requested: int | None,
                logprobs: int | None, *, n: int | None = None, prompt_logprobs: int | None = None,
                logit_bias: dict[int, float] | None = None,
                structured: StructuredOutputsParams | None = None) -> SamplingParams:
        room = self.state.prompts.max_model_len - prompt_len if self.state.prompts else 1
        max_tokens = room if requested is None else min(requested, room)
        if req.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens}, after capping at "
                           f"the {room} tokens left in the context)", param="min_tokens")
        try:
            return SamplingParams(
                n=n or req.n, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
                min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, seed=req.seed,
                max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, stop=req.stop,
                stop_token_ids=req.stop_token_ids or [], include_stop_str_in_output=req.include_stop_str_in_output,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=logit_bias,
                skip_special_tokens=req.skip_special_tokens, structured_outputs=structured)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(p) for p in first.get("loc", ()))
            msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
            raise ApiError(400, f"{loc}: {msg}" if loc else msg, param=loc or None) from None

    # ---- structured outputs and tools -----------------------------------------------------------
    async def _constraint(self, req: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
        """The request's structured-output constraint, compiled (400 naming the field when it cannot be)."""
        found = requested_constraint(req)
        if found is None:
            return None
        spec, param = found
        await compile_constraint(self.state.engine_loop.engine.structured_outputs, spec, param)
        return spec

    async def _tool_constraint(self, req: ChatCompletionRequest,
                               spec: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
        """Check tools and every tool's parameter schema; for tool_choice required or named, the grammar of a
        call."""
        problem = req.tool_problem()
        if problem is not None:
            raise ApiError(400, problem[0], param=problem[1])
        mode = req.tool_mode
        if mode is None:
            return spec
        compiler = self.state.engine_loop.engine.structured_outputs
        for i, t in enumerate(req.tools or []):
            if t.function.parameters:
                await compile_constraint(compiler, StructuredOutputsParams(json=t.function.parameters),
                                         f"tools.{i}.function.parameters")
        if mode == "auto":
            return spec
        if spec is not None:
            raise ApiError(400, f"tool_choice {mode!r} cannot be combined with a structured output constraint",
                           param="tool_choice")
        name = req.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
        grammar = StructuredOutputsParams(grammar=tool_grammar(req.tools or [], name, self._parallel(req)))
        await compile_constraint(compiler, grammar, "tools")
        return grammar

    @staticmethod
    def _parallel(req: ChatCompletionRequest) -> bool:
        """Several calls per turn: OpenAI's default, never for a named function."""
        return req.tool_mode != "named" and req.parallel_tool_calls is not False

    # ---- endpoints ------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, key: str | None, http: Request) -> Response:
        arrival = time.perf_counter()
        prompts = self._serving()
        self._check_model(req.model)
        priority = self._priority(key, req.priority)
        items = req.prompts()
        texts = [items[0]] if len(items) == 1 and isinstance(items[0], str) else None
        probe = await self._probe("completions", req, key, texts, req.temperature,
                                  req.logprobs is not None or req.echo or req.prompt_logprobs is not None
                                  or req.num_generated != req.n)
        if probe is not None and probe.hit is not None:
            return self._cached_completion(req, probe)
        self.state.admission.check_capacity(priority)
        if not items:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if len(items) > MAX_PROMPTS:
            raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        ids_list = []
        for i, p in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt.{i}"
            ids = await _off_loop(len(p), prompts.encode_prompt, p, param)
            self._check_length(prompts, ids, param)
            ids_list.append(ids)
        bias = self._logit_bias(req, prompts)
        structured = await self._constraint(req)
        gen_n = req.num_generated
        # best_of ranks completions by their tokens' logprobs; echo with logprobs needs the prompt's
        logprobs = 0 if req.logprobs is None and gen_n > req.n else req.logprobs
        wanted = [v for v in (req.prompt_logprobs, req.logprobs if req.echo else None) if v is not None]
        params = [self._params(req, len(ids), 1 if req.echo_only else req.max_tokens, logprobs, n=gen_n,
                               prompt_logprobs=max(wanted) if wanted else None, logit_bias=bias,
                               structured=structured)
                  for ids in ids_list]
        echo = [self._echo_text(prompts, p, ids) for p, ids in zip(items, ids_list, strict=True)] if req.echo else []
        job = self._start("cmpl", ids_list, params, gen_n, priority, arrival, count_output=not req.echo_only)
        return await self._respond(job, req.stream, probe, http,
                                   lambda: self._stream_completion(job, req, probe, ids_list, echo),
                                   lambda: self._completion_body(job, req, ids_list, echo))

    async def chat(self, req: ChatCompletionRequest, key: str | None, http: Request) -> Response:
        arrival = time.perf_counter()
        prompts = self._serving()
        self._check_model(req.model)
        priority = self._priority(key, req.priority)
        messages = req.template_messages()
        probe = await self._probe("chat", req, key, [m["content"] for m in messages], req.temperature,
                                  req.logprobs or req.prompt_logprobs is not None or req.tool_mode is not None,
                                  key_text=json.dumps(messages, ensure_ascii=False))
        if probe is not None and probe.hit is not None:
            return self._cached_chat(req, probe)
        self.state.admission.check_capacity(priority)
        tools = tool_dicts(req.tools) if req.tools and req.tool_mode is not None else None
        ids = await _off_loop(sum(len(m["content"]) for m in messages), prompts.encode_chat, messages,
                              req.add_generation_prompt, False, tools)
        self._check_length(prompts, ids, "messages")
        structured = await self._tool_constraint(req, await self._constraint(req))
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = [self._params(req, len(ids), req.requested_max_tokens(), top, prompt_logprobs=req.prompt_logprobs,
                               logit_bias=self._logit_bias(req, prompts), structured=structured)]
        job = self._start("chatcmpl", [ids], params, req.n, priority, arrival)
        return await self._respond(job, req.stream, probe, http, lambda: self._stream_chat(job, req, probe),
                                   lambda: self._chat_body(job, req))

    async def _respond(self, job: Job, stream: bool, probe: Probe | None, http: Request,
                       chunks: Callable[[], AsyncIterator[str]], body: Callable[[], dict[str, Any]]) -> Response:
        """Stream the job's chunks, or wait for it and answer with one JSON body; the job always closes."""
        if stream:
            return _ClosingStream(chunks(), job.close)
        try:
            await self._collect(job, http)
            self._remember(probe, job)
            return JSONResponse(body())
        finally:
            job.close()

    # ---- semantic cache -------------------------------------------------------------------------
    async def _probe(self, kind: str, req: CompletionRequest | ChatCompletionRequest, key: str | None,
                     texts: list[str] | None, temperature: float | None, logprobs: bool,
                     key_text: str | None = None) -> Probe | None:
        """Look the request up in the cache; None when the cache is off or the request bypasses it."""
        cache = self.state.cache
        if not cache.enabled or bypass_reason(temperature, req.n, logprobs, texts) is not None:
            return None
        assert texts is not None
        return await cache.lookup(scope_of(kind, key, req.model_dump()), key_text or texts[0])

    def _remember(self, probe: Probe | None, job: Job) -> None:
        if probe is None or job.error is not None or not job.choices:
            return
        c = job.choices[0]
        if c.finish_reason is not None:
            self.state.cache.store(probe, CachedAnswer(c.text, c.finish_reason, job.usage.prompt_tokens,
                                                       job.usage.completion_tokens))

    @staticmethod
    def _cached_usage(a: CachedAnswer) -> dict[str, Any]:
        return Usage(a.prompt_tokens, a.completion_tokens, cached_tokens=a.prompt_tokens).to_json()

    def _cached_completion(self, req: CompletionRequest, probe: Probe) -> Response:
        a = probe.hit
        assert a is not None
        rid, created = f"cmpl-{uuid.uuid4().hex}", now_s()
        headers = {"X-Llmopt-Cache": probe.match or "exact"}
        choice = {"index": 0, "text": a.text, "logprobs": None, "finish_reason": a.finish_reason}
        base = {"id": rid, "object": "text_completion", "created": created, "model": self._model()}
        if not req.stream:
            return JSONResponse({**base, "choices": [choice], "usage": self._cached_usage(a)}, headers=headers)

        async def events() -> AsyncIterator[str]:
            yield sse({**base, "choices": [choice], **({"usage": None} if req.include_usage else {})})
            if req.include_usage:
                yield sse({**base, "choices": [], "usage": self._cached_usage(a)})
            yield sse("[DONE]")

        return _ClosingStream(events(), lambda: None, headers)

    def _cached_chat(self, req: ChatCompletionRequest, probe: Probe) -> Response:
        a = probe.hit
        assert a is not None
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", now_s()
        headers = {"X-Llmopt-Cache": probe.match or "exact"}
        if not req.stream:
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self._model(),
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": a.text},
                                              "logprobs": None, "finish_reason": a.finish_reason}],
                                 "usage": self._cached_usage(a)}, headers=headers)
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self._model()}
        extra = {"usage": None} if req.include_usage else {}

        async def events() -> AsyncIterator[str]:
            for delta, finish in (({"role": "assistant", "content": ""}, None), ({"content": a.text}, a.finish_reason)):
                yield sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                           **extra})
            if req.include_usage:
                yield sse({**base, "choices": [], "usage": self._cached_usage(a)})
            yield sse("[DONE]")

        return _ClosingStream(events(), lambda: None, headers)

    # ---- engine hand-off ------------------------------------------------------------------------
    def _start(self, prefix: str, ids_list: list[list[int]], params: list[SamplingParams], n: int, priority: int,
               arrival: float, count_output: bool = True) -> Job:
        st = self.state
        base = f"{prefix}-{uuid.uuid4().hex}"
        rids = [base if len(ids_list) == 1 else f"{base}-{i}" for i in range(len(ids_list))]
        ticket = st.admission.admit({rid: len(ids) for rid, ids in zip(rids, ids_list, strict=True)}, n, priority)
        sink = EventSink(on_first=lambda rid: st.admission.started(ticket, rid))
        job = Job(st, base, rids, [len(i) for i in ids_list], n, ticket, sink, count_output)
        deadline = arrival + st.config.request_timeout_s
        for tag, (rid, ids, p) in enumerate(zip(rids, ids_list, params, strict=True)):
            st.engine_loop.submit(rid, tag, ids, p, -priority, deadline, sink, arrival)
        return job

    async def _collect(self, job: Job, http: Request) -> None:
        """Wait for every engine request to finish; a client that leaves aborts them (via `close`)."""
        run = asyncio.ensure_future(job.run_to_end())
        gone = asyncio.ensure_future(_wait_disconnect(http))
        try:
            await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not run.done():
                run.cancel()
        if not run.done() or run.cancelled():
            job.close()
            raise ApiError(499, "client closed the request", code="client_closed")
        run.result()
        if job.error is not None:
            raise ApiError(job.error.error_status, job.error.error or "request failed",
                           err_type="server_error" if job.error.error_status >= 500 else None)

    # ---- bodies ---------------------------------------------------------------------------------
    def _model(self) -> str:
        return self.state.model_name

    @staticmethod
    def _echo_text(prompts: PromptBuilder, prompt: str | list[int], ids: list[int]) -> str:
        return prompt if isinstance(prompt, str) else prompts.decode(ids, "prompt")

    def _completion_body(self, job: Job, req: CompletionRequest, ids_list: list[list[int]],
                         echo: list[str]) -> dict[str, Any]:
        prompts = self.state.prompts
        choices: list[dict[str, Any]] = []
        for tag, ids in enumerate(ids_list):
            group = [job.choices[tag * job.n + k] for k in range(job.n)]
            if job.n > req.n:  # best_of: the n most likely, most likely first
                group = sorted(group, key=lambda c: c.cumulative_logprob, reverse=True)[:req.n]
            for c in group:
                text = "" if req.echo_only else c.text
                items: list = [] if req.echo_only else list(c.logprobs)
                if req.echo:
                    text = echo[tag] + text
                    items = echo_items(ids, job.prompt_logprobs.get(tag), req.logprobs or 0) + items
                lps = completion_logprobs(prompts, items) if req.logprobs is not None and prompts else None
                choice = {"index": len(choices), "text": text, "logprobs": lps, "finish_reason": c.finish_reason}
                if req.prompt_logprobs is not None and prompts:
                    choice["prompt_logprobs"] = prompt_logprobs_json(prompts, job.prompt_logprobs.get(tag))
                choices.append(choice)
        return {"id": job.id, "object": "text_completion", "created": now_s(), "model": self._model(),
                "choices": choices, "usage": job.usage.to_json()}

    def _chat_body(self, job: Job, req: ChatCompletionRequest) -> dict[str, Any]:
        prompts = self.state.prompts
        choices = []
        for i, c in sorted(job.choices.items()):
            lps = chat_logprobs(prompts, c.logprobs, req.top_logprobs or 0) if req.logprobs and prompts else None
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish = c.finish_reason
            if req.tool_mode is not None:
                parsed = parse_tool_calls(c.text)
                calls = parsed.tool_calls if self._parallel(req) else parsed.tool_calls[:1]
                message["content"] = parsed.content if calls else parsed.content or ""
                if calls:
                    message["tool_calls"] = [{"id": _call_id(), "type": "function",
                                              "function": {"name": name, "arguments": args}} for name, args in calls]
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": i, "message": message, "logprobs": lps, "finish_reason": finish})
        body = {"id": job.id, "object": "chat.completion", "created": now_s(), "model": self._model(),
                "choices": choices, "usage": job.usage.to_json()}
        if req.prompt_logprobs is not None and prompts:  # vLLM: one list for the request, at the top level
            body["prompt_logprobs"] = prompt_logprobs_json(prompts, job.prompt_logprobs.get(0))
        return body

    def _error_chunk(self, ev: StreamEvent) -> str:
        kind = "server_error" if ev.error_status >= 500 else "invalid_request_error"
        return sse(error_body(ev.error or "request failed", kind, None, None))

    async def _stream_completion(self, job: Job, req: CompletionRequest, probe: Probe | None,
                                 ids_list: list[list[int]], echo: list[str]) -> AsyncIterator[str]:
        prompts = self.state.prompts
        created = now_s()
        usage_on = req.include_usage
        next_offset: dict[int, int] = {}  # per choice: text_offset of its next token (advanced by tokens sent)
        try:
            while not job.done:
                ev = await job.sink.queue.get()
                job.apply(ev)
                if job.error is not None:
                    yield self._error_chunk(ev)
                    break
                for d in ev.choices:
                    idx = ev.tag * job.n + d.index
                    text = "" if req.echo_only else d.text
                    items: list = [] if req.echo_only else list(zip(d.token_ids, d.logprobs or (), strict=False))
                    if req.echo and idx not in next_offset:  # the first chunk of this choice carries the prompt
                        text = echo[ev.tag] + text
                        items = echo_items(ids_list[ev.tag], job.prompt_logprobs.get(ev.tag), req.logprobs or 0) + items
                    lps = None
                    if req.logprobs is not None and prompts:
                        lps = completion_logprobs(prompts, items, next_offset.get(idx, 0))
                        if lps["tokens"]:
                            next_offset[idx] = lps["text_offset"][-1] + len(lps["tokens"][-1])
                    next_offset.setdefault(idx, 0)
                    chunk: dict[str, Any] = {"id": job.id, "object": "text_completion", "created": created,
                                             "model": self._model(),
                                             "choices": [{"index": idx, "text": text, "logprobs": lps,
                                                          "finish_reason": d.finish_reason}]}
                    if usage_on:
                        chunk["usage"] = job.usage.to_json() if req.continuous_usage else None
                    yield sse(chunk)
            else:
                self._remember(probe, job)
                if usage_on:
                    yield sse({"id": job.id, "object": "text_completion", "created": created,
                               "model": self._model(), "choices": [], "usage": job.usage.to_json()})
            yield sse("[DONE]")
        finally:
            job.close()

    async def _stream_chat(self, job: Job, req: ChatCompletionRequest, probe: Probe | None) -> AsyncIterator[str]:
        prompts = self.state.prompts
        created = now_s()
        usage_on = req.include_usage

        def chunk(idx: int, delta: dict[str, Any], finish: str | None, lps: dict[str, Any] | None = None) -> str:
            obj: dict[str, Any] = {"id": job.id, "object": "chat.completion.chunk", "created": created,
                                   "model": self._model(),
                                   "choices": [{"index": idx, "delta": delta, "logprobs": lps,
                                                "finish_reason": finish}]}
            if usage_on:
                obj["usage"] = job.usage.to_json() if req.continuous_usage else None
            return sse(obj)

        parsers = {idx: ToolCallParser() for idx in job.choices} if req.tool_mode is not None else None
        call_ids: dict[tuple[int, int], str] = {}
        try:
            for idx in sorted(job.choices):
                yield chunk(idx, {"role": "assistant", "content": ""}, None)
            while not job.done:
                ev = await job.sink.queue.get()
                job.apply(ev)
                if job.error is not None:
                    yield self._error_chunk(ev)
                    break
                for d in ev.choices:
                    idx = ev.tag * job.n + d.index
                    lps = None
                    if req.logprobs and d.logprobs is not None and prompts:
                        lps = chat_logprobs(prompts, list(zip(d.token_ids, d.logprobs, strict=False)),
                                            req.top_logprobs or 0)
                    if parsers is not None:
                        for delta, finish in self._tool_deltas(req, parsers[idx], call_ids, idx, d.text,
                                                               d.finish_reason):
                            yield chunk(idx, delta, finish, lps)
                            lps = None
                        if lps is not None:
                            yield chunk(idx, {}, None, lps)
                        continue
                    if d.text or d.token_ids:
                        yield chunk(idx, {"content": d.text}, d.finish_reason, lps)
                    elif d.finish_reason is not None:
                        yield chunk(idx, {}, d.finish_reason)
            else:
                self._remember(probe, job)
                if usage_on:
                    yield sse({"id": job.id, "object": "chat.completion.chunk", "created": created,
                               "model": self._model(), "choices": [], "usage": job.usage.to_json()})
            yield sse("[DONE]")
        finally:
            job.close()

    def _tool_deltas(self, req: ChatCompletionRequest, parser: ToolCallParser, call_ids: dict[tuple[int, int], str],
                     idx: int, text: str, finish_reason: str | None) -> list[tuple[dict[str, Any], str | None]]:
        """One choice's new text as OpenAI chat deltas: content, a call's first delta (id, type, name) and its
        argument chunks; the finish reason (tool_calls when it stopped after calling) on a last empty delta."""
        out: list[tuple[dict[str, Any], str | None]] = []
        parallel = self._parallel(req)
        for item in parser.feed(text, final=finish_reason is not None):
            if isinstance(item, str):
                out.append(({"content": item}, None))
            elif item.index > 0 and not parallel:
                continue
            elif item.name is not None:
                call_ids[(idx, item.index)] = cid = _call_id()
                out.append(({"tool_calls": [{"index": item.index, "id": cid, "type": "function",
                                             "function": {"name": item.name, "arguments": ""}}]}, None))
            else:
                out.append(({"tool_calls": [{"index": item.index, "function": {"arguments": item.arguments}}]}, None))
        if finish_reason is not None:
            out.append(({}, "tool_calls" if parser.num_calls and finish_reason == "stop" else finish_reason))
        return out

    # ---- tokenizer endpoints (vLLM's) -----------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> Response:
        prompts = self._serving()
        self._check_model(req.model)
        if req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await _off_loop(len(req.prompt), prompts.tokenize, req.prompt, add)
        else:
            messages = req.template_messages()
            ids = await _off_loop(sum(len(m["content"]) for m in messages), prompts.encode_chat, messages,
                                  req.add_generation_prompt, bool(req.add_special_tokens))
        body: dict[str, Any] = {"count": len(ids), "max_model_len": prompts.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = prompts.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(body)

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        prompts = self._serving()
        self._check_model(req.model)
        text = await _off_loop(len(req.tokens) * 4, prompts.decode, req.tokens)
        return JSONResponse({"prompt": text})


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
