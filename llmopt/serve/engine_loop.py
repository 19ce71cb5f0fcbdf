"""EngineLoop: the one thread that owns the LLMEngine.

The engine is not thread-safe, so exactly one thread builds it, warms it up and drives it: it drains a
thread-safe queue of commands (add, abort), steps while there is work, and hands each step's outputs to
the asyncio loop in one `call_soon_threadsafe` per step. Outputs are turned into immutable `StreamEvent`s
here, on the engine thread, because a `RequestOutput` shares lists (logprobs) that later steps extend.
The engine's free capacity (sequence slots, KV blocks) travels in the same call whenever it changed, so
admission sees it together with the events of the step that produced it, never half a step apart.

Priority aging also lives here (through `LLMEngine.set_priority`): a request's engine
priority improves by one class per `aging_s` seconds since its arrival, which bounds starvation.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmopt.engine.llm_engine import LLMEngine, RequestError
from llmopt.engine.outputs import RequestOutput
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.stats import StepStats

log = logging.getLogger("llmopt.serve")

IDLE_POLL_S = 0.005  # wait when work exists but nothing could be scheduled (lets deadlines fire)


@dataclass(frozen=True)
class ChoiceDelta:
    """What one of a request's n completions gained in one step."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...] | None
    finish_reason: str | None  # set once, on the event that finishes this choice


@dataclass(frozen=True)
class StreamEvent:
    request_id: str
    tag: int  # which prompt of the HTTP request this engine request serves
    choices: tuple[ChoiceDelta, ...]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None  # the engine refused or failed the request (the message is for the client)
    error_status: int = 400  # 400: the engine refused the request; 500: the engine failed
    # prompt logprobs (SamplingParams.prompt_logprobs), once: on the first event with tokens (the prefill is done)
    prompt_logprobs: tuple[dict[int, tuple[float, int]] | None, ...] | None = None


class EventSink:
    """The asyncio side of one HTTP request: events of all its engine requests, in order. The first event
    of each engine request (an empty one when the scheduler admits it) calls `on_first`."""

    def __init__(self, on_first: Callable[[str], None] | None = None):
        self.queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._on_first = on_first
        self._started: set[str] = set()

    def put(self, ev: StreamEvent) -> None:
        if ev.request_id not in self._started:
            self._started.add(ev.request_id)
            if self._on_first is not None:
                self._on_first(ev.request_id)
        self.queue.put_nowait(ev)


@dataclass
class _Add:
    request_id: str
    tag: int
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int  # engine convention: lower is scheduled first
    deadline: float | None
    arrival: float
    sink: EventSink


@dataclass
class _Abort:
    request_id: str | None  # None: every request
    reason: str


@dataclass
class _Stream:
    tag: int
    sink: EventSink
    priority: int
    arrival: float
    sent: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    prompt_logprobs_sent: bool = False


_STOP = object()


class EngineLoop:
    """Build the engine on its own thread, then serve `submit`/`abort` from the asyncio loop."""

    def __init__(self, engine_factory: Callable[[], LLMEngine], *,
                 warmup: Callable[[LLMEngine], None] | None = None,
                 stat_listeners: list[Callable[[StepStats], None]] | None = None,
                 aging_s: float | None = None, is_degraded: Callable[[], bool] | None = None,
                 on_capacity: Callable[[int, int], None] | None = None):
        """`on_capacity(free_seqs, free_blocks)` runs on the asyncio loop, after the events of the same step."""
        self._factory = engine_factory
        self._on_capacity = on_capacity
        self._capacity: tuple[int, int] | None = None  # engine thread only: the last one posted
        self._is_degraded = is_degraded
        self._warmup = warmup
        self._listeners = list(stat_listeners or [])
        self._aging_s = aging_s
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_ready: Callable[[], None] | None = None
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._unscheduled: set[str] = set()  # engine thread only: added, not yet admitted by the scheduler
        self._last_batch = 0
        self._need_step = False
        self.engine: LLMEngine | None = None  # read-only facts (max_model_len, weights_dir) after `ready`; None again once stopped
        self.ready = threading.Event()  # set when the engine is built and warm, or failed
        self.failure: BaseException | None = None
        self.active: set[str] = set()  # asyncio side: submitted and not yet finished

    # ---- asyncio side -------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, on_ready: Callable[[], None] | None = None) -> None:
        self._loop = loop
        self._on_ready = on_ready
        self._thread = threading.Thread(target=self._run, name="llmopt-engine", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, tag: int, prompt_token_ids: list[int], params: SamplingParams,
               priority: int, deadline: float | None, sink: EventSink, arrival: float | None = None) -> None:
        """Queue a request; `arrival` (perf_counter) is when the HTTP request came in, for TTFT and queue time."""
        self.active.add(request_id)
        self._commands.put(_Add(request_id, tag, prompt_token_ids, params, priority, deadline,
                                time.perf_counter() if arrival is None else arrival, sink))

    def abort(self, request_id: str, reason: str = "abort") -> None:
        if request_id in self.active:
            self._commands.put(_Abort(request_id, reason))

    def abort_all(self, reason: str = "abort") -> None:
        self._commands.put(_Abort(None, reason))

    def stop(self, timeout: float = 10.0) -> None:
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    def _deliver(self, batch: list[tuple[EventSink, StreamEvent]], capacity: tuple[int, int] | None) -> None:
        for sink, ev in batch:
            if ev.finished:
                self.active.discard(ev.request_id)
            sink.put(ev)
        if capacity is not None and self._on_capacity is not None:
            self._on_capacity(*capacity)

    # ---- engine thread ------------------------------------------------------------------------
    def _post(self, batch: list[tuple[EventSink, StreamEvent]]) -> None:
        """Hand events to the asyncio loop, with the engine's free capacity at this moment if it changed."""
        assert self.engine is not None
        capacity = self.engine.free_capacity()
        if capacity == self._capacity:
            capacity = None
        if (batch or capacity is not None) and self._loop is not None:
            if capacity is not None:
                self._capacity = capacity
            try:
                self._loop.call_soon_threadsafe(self._deliver, batch, capacity)
            except RuntimeError:  # the event loop is closed: the server is gone
                pass

    def _run(self) -> None:
        try:
            self.engine = self._factory()
            # listening from the start keeps the engine's per-step deltas (prefix cache, preemptions)
            # anchored, so that warm-up traffic does not leak into the first metrics step
            self.engine.stat_listeners.append(self._on_stats)
            if self._warmup is not None:
                self._warmup(self.engine)
            self.engine.stat_listeners.extend(self._listeners)
        except BaseException as e:  # reported by the server, which then exits
            self.failure = e
            self.ready.set()
            self._notify_ready()
            return
        self._post([])  # the first capacity, ahead of readiness: no request is admitted against none
        self.ready.set()
        self._notify_ready()
        while True:
            try:
                if not self._drain(block=not self._has_work()):
                    # the thread owned the engine: drop it, so a stopped server (the recipe's serve smoke,
                    # a test) gives back the weights and KV pool instead of holding them until exit
                    self.engine = None
                    return
                if self._has_work():
                    self._step()
                    time.sleep(0)  # hand the GIL to the asyncio thread between steps: 429s and SSE stay prompt
            except Exception as e:  # a bug of ours: fail what is in flight, keep serving
                log.exception("engine loop error")
                self._fail_all(f"internal engine error: {type(e).__name__}")

    def _notify_ready(self) -> None:
        if self._on_ready is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._on_ready)
            except RuntimeError:
                pass

    def _has_work(self) -> bool:
        assert self.engine is not None
        return self._need_step or self.engine.has_unfinished_requests()

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; False once asked to stop."""
        try:
            if block:
                cmd = self._commands.get()
            elif self._last_batch == 0 and self._streams:
                cmd = self._commands.get(timeout=IDLE_POLL_S)
            else:
                cmd = self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is _STOP:
                return False
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: _Add | _Abort) -> None:
        eng = self.engine
        assert eng is not None
        if isinstance(cmd, _Abort):
            ids = list(self._streams) if cmd.request_id is None else [cmd.request_id]
            for rid in ids:
                if eng.abort_request(rid, cmd.reason):
                    self._need_step = True  # the abort output comes out of the next step
            return
        try:
            eng.add_request(cmd.request_id, params=cmd.params, prompt_token_ids=cmd.prompt_token_ids,
                            arrival_time=cmd.arrival, priority=cmd.priority, deadline=cmd.deadline)
        except Exception as e:  # RequestError: the client's fault (400); anything else is ours (500)
            status = 400 if isinstance(e, RequestError) else 500
            ev = StreamEvent(cmd.request_id, cmd.tag, (), True, len(cmd.prompt_token_ids), error=str(e),
                             error_status=status)
            self._post([(cmd.sink, ev)])
            return
        self._streams[cmd.request_id] = _Stream(cmd.tag, cmd.sink, cmd.priority, cmd.arrival)
        self._unscheduled.add(cmd.request_id)
        self._need_step = True

    def _age_priorities(self) -> None:
        """Raise requests one engine class per `aging_s` waited (engine: lower = sooner)."""
        assert self.engine is not None and self._aging_s is not None
        now = time.perf_counter()
        for rid, st in self._streams.items():
            self.engine.set_priority(rid, st.priority - math.floor((now - st.arrival) / self._aging_s))

    def _on_stats(self, stats: StepStats) -> None:
        self._last_batch = stats.batch_size

    def _step(self) -> None:
        eng = self.engine
        assert eng is not None
        self._need_step = False
        if self._aging_s is not None:
            self._age_priorities()
        if eng.spec_config is not None and self._is_degraded is not None:
            eng.spec_enabled = not self._is_degraded()  # under load, verification costs more than it saves
        try:
            outputs = eng.step()
        except Exception as e:  # an engine bug must not kill the server: fail what was running
            log.exception("engine step failed")
            self._fail_all(f"internal engine error: {type(e).__name__}")
            return
        batch = self._newly_scheduled()
        for out in outputs:
            st = self._streams.get(out.request_id)
            if st is None:
                continue
            ev = self._event(out, st)
            if ev is not None:
                batch.append((st.sink, ev))
            if out.finished:
                del self._streams[out.request_id]
        self._post(batch)

    def _newly_scheduled(self) -> list[tuple[EventSink, StreamEvent]]:
        """Empty events for requests the scheduler admitted this step: admission stops counting them
        as waiting (their first tokens may be many chunked-prefill steps away)."""
        eng = self.engine
        assert eng is not None
        batch = []
        for rid in list(self._unscheduled):
            req = eng.get_request(rid)
            if req is None or req.scheduled:
                self._unscheduled.discard(rid)
                st = self._streams.get(rid)
                if st is not None:
                    batch.append((st.sink, StreamEvent(rid, st.tag, (), False, len(req.prompt_token_ids) if req else 0)))
        return batch

    def _fail_all(self, message: str) -> None:
        eng = self.engine
        assert eng is not None
        batch = []
        for rid, st in self._streams.items():
            eng.abort_request(rid, "abort")
            batch.append((st.sink, StreamEvent(rid, st.tag, (), True, 0, error=message, error_status=500)))
        self._streams.clear()
        self._unscheduled.clear()
        self._post(batch)
        try:
            eng.step()  # flush the abort outputs so the engine starts clean
        except Exception:
            log.exception("engine step after a failure failed too")

    @staticmethod
    def _event(out: RequestOutput, st: _Stream) -> StreamEvent | None:
        choices = []
        for c in out.outputs:
            sent = st.sent.get(c.index, 0)
            new_ids = tuple(c.token_ids[sent:])
            finish = c.finish_reason if c.finish_reason is not None and c.index not in st.done else None
            if not new_ids and not c.delta_text and finish is None:
                continue
            lps = None
            if c.logprobs is not None:
                lps = tuple(dict(d) for d in c.logprobs[sent:sent + len(new_ids)])
            st.sent[c.index] = len(c.token_ids)
            if finish is not None:
                st.done.add(c.index)
            choices.append(ChoiceDelta(c.index, c.delta_text, new_ids, lps, finish))
        if not choices and not out.finished:
            return None
        plp = None
        if out.prompt_logprobs is not None and not st.prompt_logprobs_sent and (
                out.finished or any(c.token_ids for c in choices)):
            plp = tuple(out.prompt_logprobs)  # entries are never changed once written
            st.prompt_logprobs_sent = True
        return StreamEvent(out.request_id, st.tag, tuple(choices), out.finished, len(out.prompt_token_ids),
                           out.num_cached_tokens, prompt_logprobs=plp)
