"""The in-process target: our engine, driven in this thread as if a client were sending it requests.

Nothing goes over HTTP, so the timings are the engine's own (`RequestOutput.metrics`, perf_counter): a
request's `start` is its arrival time, its chunks are `token_times` (one token each), its end the last of
them. What we emulate is the *client*: the loop below releases requests exactly when the load pattern
would have sent them and adds them to the engine between steps with `arrival_time` set to that moment.

* Request rate: request i arrives at `t0 + offset_i` (`load.arrival_schedule`, the same gamma process as
  over HTTP). A request that "arrives" while a step is running is added after the step with its true
  arrival time, so the wait for the step boundary counts in its TTFT, as it would on a real server.
* Concurrency C: C slots. A finished request frees its slot at its last token's time; the next request
  starts at max(its arrival, that time). Unbounded concurrency (None) never waits for a slot.
* Static batching (`batching="static"`, batch size = the pattern's concurrency): the first C requests are
  admitted together; the next C only when *every* request of the batch has finished, all starting at the
  moment the last one did. Each request still runs to its own `max_tokens`; the batch holds its C slots
  until its longest request ends. This is the classic "pad and wait" schedule of `model.generate` on a
  batch, minus one thing: a finished row leaves the engine's batch instead of computing padding, so our
  static batching spends no compute on finished rows and streams each token as it is made. Both favour
  static batching, so continuous batching's measured advantage is, if anything, understated.

Warm-up requests run first at the same concurrency and are discarded, then the prefix cache is emptied so
that every measured run starts cold and variants (e.g. static then continuous on one engine) cannot reuse
each other's prompts. Ctrl-C stops the run: in-flight requests are aborted and recorded as interrupted,
and the partial result is returned.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from rich.progress import Progress, TaskID

from llmopt.bench.engine_counters import StepStatsCollector
from llmopt.bench.http_target import ServerMetrics
from llmopt.bench.load import LoadPattern, LoadResult, request_offsets, warmup_requests
from llmopt.bench.records import ERROR_INTERRUPTED, RequestRecord
from llmopt.bench.workloads import BenchRequest
from llmopt.errors import LlmoptError

if TYPE_CHECKING:
    from llmopt.engine.llm_engine import LLMEngine
    from llmopt.engine.outputs import RequestOutput

Batching = Literal["continuous", "static"]


class OfflineEngineTarget:
    """Runs a workload through an `LLMEngine` under a load pattern; see the module docstring."""

    def __init__(self, engine: LLMEngine, *, temperature: float = 0.0):
        self.engine = engine
        self.temperature = temperature
        self.collector = StepStatsCollector()
        engine.stat_listeners.append(self.collector)
        self._ids = itertools.count()

    def close(self) -> None:
        """Detach from the engine (it may be reused by another target)."""
        if self.collector in self.engine.stat_listeners:
            self.engine.stat_listeners.remove(self.collector)

    # ------------------------------------------------------------------------------------- requests

    def prompt_ids(self, req: BenchRequest) -> list[int]:
        """Token ids the engine will see: ids as given, text encoded, chat messages templated then encoded."""
        p = req.prompt
        if isinstance(p, str):
            return list(self.engine.encode_prompt(p))
        if req.is_chat:
            text = self.engine.apply_chat_template(p)  # type: ignore[arg-type]
            return list(self.engine.tokenizer.encode(text, add_special_tokens=False))
        return [int(t) for t in p]  # type: ignore[union-attr]

    def _params(self, req: BenchRequest) -> Any:
        from llmopt.engine.sampling_params import SamplingParams

        return SamplingParams(temperature=self.temperature, max_tokens=req.max_tokens, ignore_eos=req.ignore_eos)

    def check_capacity(self, pattern: LoadPattern, batching: Batching) -> None:
        """Static batches must fit the engine at once, or they would not be batches at all."""
        if batching == "static":
            if pattern.concurrency is None or not math.isinf(pattern.request_rate):
                raise LlmoptError("static batching needs a fixed batch size (a concurrency level) and no "
                                  "request rate")
            if pattern.concurrency > self.engine.config.max_num_seqs:
                raise LlmoptError(f"static batch size {pattern.concurrency} exceeds the engine's max_num_seqs "
                                  f"{self.engine.config.max_num_seqs}; raise --max-num-seqs")

    # ------------------------------------------------------------------------------------------ run

    def run(
        self,
        requests: Sequence[BenchRequest],
        pattern: LoadPattern,
        *,
        batching: Batching = "continuous",
        warmup: int = 0,
        progress: Progress | None = None,
        description: str | None = None,
    ) -> tuple[LoadResult, ServerMetrics]:
        """One load level: optional warm-up, then the measured run; returns its records and engine counters."""
        if not requests:
            raise LlmoptError("no requests to send")
        self.check_capacity(pattern, batching)
        desc = description or pattern.label()
        if warmup:
            warm = warmup_requests(requests, warmup)
            _, _, stopped = self._phase(warm, LoadPattern(concurrency=pattern.concurrency), "continuous",
                                        progress, f"warm-up ({desc})", transient=True)
            if stopped:
                return LoadResult(pattern=pattern, records=[], duration_s=0.0, interrupted=True), ServerMetrics()
        self.engine.reset_prefix_cache()
        self.collector.reset()
        records, duration, stopped = self._phase(requests, pattern, batching, progress, desc)
        return (LoadResult(pattern=pattern, records=records, duration_s=duration, interrupted=stopped),
                self.collector.server_metrics())

    def _phase(
        self,
        requests: Sequence[BenchRequest],
        pattern: LoadPattern,
        batching: Batching,
        progress: Progress | None,
        description: str,
        *,
        transient: bool = False,
    ) -> tuple[list[RequestRecord], float, bool]:
        task: TaskID | None = None
        failed = 0
        if progress is not None:
            task = progress.add_task(description, total=len(requests), failed=0)

        def on_done(rec: RequestRecord) -> None:
            nonlocal failed
            failed += not rec.success
            if progress is not None and task is not None:
                progress.update(task, advance=1, failed=failed)

        try:
            return self._drive(requests, pattern, batching, on_done)
        finally:
            if progress is not None and task is not None and transient:
                progress.remove_task(task)

    def _drive(
        self,
        requests: Sequence[BenchRequest],
        pattern: LoadPattern,
        batching: Batching,
        on_done: Callable[[RequestRecord], None],
    ) -> tuple[list[RequestRecord], float, bool]:
        """The client-emulating loop: release requests per the pattern, step the engine, collect records."""
        eng = self.engine
        n = len(requests)
        offsets = request_offsets(requests, pattern) or [0.0] * n
        records: dict[int, RequestRecord] = {}
        in_flight: dict[str, int] = {}  # engine request id -> workload index
        t0 = time.perf_counter()
        cap = pattern.concurrency
        # times since which each free slot has been free; a new request takes the earliest one
        free_slots: list[float] = [t0] * cap if cap is not None else []
        batch_end = t0  # static batching: when the previous batch's last request finished
        next_i = 0
        interrupted = False

        def finish(idx: int, rec: RequestRecord) -> None:
            rec.index = idx
            records[idx] = rec
            if cap is not None:
                heapq.heappush(free_slots, rec.end)
            on_done(rec)

        def release(idx: int, start: float) -> None:
            req = requests[idx]
            rid = f"bench-{next(self._ids)}"
            try:
                ids = self.prompt_ids(req)
                eng.add_request(rid, prompt_token_ids=ids, params=self._params(req), arrival_time=start)
            except LlmoptError as e:  # too long, empty, bad template: the request is refused, like a 400
                finish(idx, RequestRecord.failure(start=start, end=time.perf_counter(), error_code="rejected",
                                                  error=str(e), prompt_tokens=req.expected_prompt_tokens or 0))
                return
            in_flight[rid] = idx

        try:
            while next_i < n or in_flight:
                now = time.perf_counter()
                if batching == "static":
                    if not in_flight and next_i < n:
                        assert cap is not None
                        batch = range(next_i, min(n, next_i + cap))
                        next_i = batch.stop
                        free_slots.clear()
                        for i in batch:
                            release(i, batch_end)
                else:
                    while next_i < n and t0 + offsets[next_i] <= now and (cap is None or free_slots):
                        slot_free = heapq.heappop(free_slots) if cap is not None else t0
                        release(next_i, max(t0 + offsets[next_i], slot_free))
                        next_i += 1
                if not in_flight:
                    if next_i < n and batching != "static":
                        wait = t0 + offsets[next_i] - time.perf_counter()
                        if wait > 0:
                            time.sleep(wait)
                    continue
                try:
                    outputs = eng.step()
                except Exception as e:  # the engine failed this step: its requests fail, the run goes on
                    for rid, idx in list(in_flight.items()):
                        del in_flight[rid]
                        start = _arrival(eng, rid, t0)
                        _abort_quietly(eng, rid)
                        finish(idx, RequestRecord.failure(
                            start=start, end=time.perf_counter(),
                            error_code=f"exception:{type(e).__name__}", error=f"{type(e).__name__}: {e}",
                            prompt_tokens=requests[idx].expected_prompt_tokens or 0))
                    continue
                for out in outputs:
                    if out.finished and out.request_id in in_flight:
                        idx = in_flight.pop(out.request_id)
                        rec = _record(out)
                        batch_end = max(batch_end, rec.end)
                        finish(idx, rec)
        except KeyboardInterrupt:
            interrupted = True
            now = time.perf_counter()
            for rid, idx in in_flight.items():
                records[idx] = RequestRecord.failure(
                    start=_arrival(eng, rid, now), end=now, error_code=ERROR_INTERRUPTED, error="run interrupted",
                    prompt_tokens=requests[idx].expected_prompt_tokens or 0, index=idx, interrupted=True)
                _abort_quietly(eng, rid)
        duration = time.perf_counter() - t0
        return [records[i] for i in sorted(records)], duration, interrupted


def _record(out: RequestOutput) -> RequestRecord:
    """A finished engine request as the client would have seen it (one chunk per token)."""
    m = out.metrics
    comp = out.outputs[0]
    prompt_tokens = len(out.prompt_token_ids)
    if comp.finish_reason in ("abort", "timeout") or not m.token_times:
        return RequestRecord.failure(start=m.arrival_time, end=m.finished_time or time.perf_counter(),
                                     error_code=comp.finish_reason or "no_tokens",
                                     error=f"the engine finished the request with {comp.finish_reason!r}",
                                     prompt_tokens=prompt_tokens)
    return RequestRecord.from_chunks(start=m.arrival_time, token_times=list(m.token_times),
                                     prompt_tokens=prompt_tokens, output_tokens=len(comp.token_ids))


def _arrival(eng: LLMEngine, rid: str, default: float) -> float:
    req = eng.get_request(rid)
    return req.seqs[0].metrics.arrival_time if req is not None and req.seqs else default


def _abort_quietly(eng: LLMEngine, rid: str) -> None:
    """Free a request's KV blocks; an engine in a broken state must not turn cleanup into a crash."""
    try:
        eng.abort_request(rid)
    except Exception:  # best effort: the engine itself already failed
        pass
