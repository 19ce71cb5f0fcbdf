"""Load patterns and the async runner that drives any target with them.

A pattern is vLLM's pair of knobs: a client-side cap on requests in flight (`concurrency`, a semaphore)
and an arrival process (`request_rate`). Arrivals follow a gamma process with shape `burstiness` and mean
inter-arrival 1/rate: burstiness 1 is Poisson, below 1 burstier, above 1 more regular. As in vLLM the
sampled gaps are rescaled so that the last arrival lands exactly at n/rate, which removes the 1-2%
run-to-run throughput jitter a finite sample of gaps would add. A request that arrives while the
semaphore is full waits for a slot, and its clock (`start`) starts when it is actually sent.

The runner never lets one request break a run: an exception from `send` becomes a failed record. Ctrl-C
(asyncio cancels the main task) or cancelling the runner's task returns what finished so far, with the
requests that were in flight marked `interrupted`; requests not yet sent are simply absent.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from llmopt.bench.records import ERROR_INTERRUPTED, RequestRecord
from llmopt.bench.workloads import BenchRequest
from llmopt.errors import LlmoptError

SendFn = Callable[[BenchRequest], Awaitable[RequestRecord]]


class LoadPattern(BaseModel):
    """How requests are released: at most `concurrency` in flight, arriving at `request_rate` per second."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    concurrency: int | None = Field(None, ge=1, description="Max requests in flight; None is unbounded.")
    request_rate: float = Field(math.inf, gt=0, description="Arrivals per second; inf sends all at once.")
    burstiness: float = Field(1.0, gt=0, description="Gamma shape of inter-arrival times; 1 is Poisson.")
    seed: int = 0

    def label(self) -> str:
        """`concurrency 8`, `rate 4 req/s`, `rate 4 req/s, concurrency 8` or `all at once`."""
        parts = []
        if not math.isinf(self.request_rate):
            parts.append(f"rate {self.request_rate:g} req/s")
        if self.concurrency is not None:
            parts.append(f"concurrency {self.concurrency}")
        return ", ".join(parts) or "all at once"


def _parse_level(item: str, kind: str, text: str) -> float:
    if item.lower() in ("inf", "infinity"):
        return math.inf
    try:
        v = float(item)
    except ValueError:
        raise LlmoptError(f"cannot parse {kind} sweep {text!r}: {item!r} is not a number or 'inf'") from None
    if not v > 0 or not math.isfinite(v):
        raise LlmoptError(f"{kind} values must be positive, got {item!r} in {text!r}")
    if kind == "concurrency" and v != int(v):
        raise LlmoptError(f"concurrency must be a whole number, got {item!r} in {text!r}")
    return v


def parse_sweep(
    text: str,
    kind: Literal["concurrency", "request_rate"],
    *,
    burstiness: float = 1.0,
    seed: int = 0,
    max_concurrency: int | None = None,
) -> list[LoadPattern]:
    """`"1,2,4,8"` or `"1,2,4,inf"` into patterns; `inf` means unbounded concurrency / all at once.

    For a request-rate sweep, `max_concurrency` caps requests in flight at every level (as vLLM's
    `--max-concurrency` does alongside `--request-rate`).
    """
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise LlmoptError(f"empty {kind} sweep: use e.g. 1,2,4,8 or 1,2,4,inf")
    if burstiness <= 0:
        raise LlmoptError(f"burstiness must be positive, got {burstiness}")
    out = []
    for item in items:
        v = _parse_level(item, kind, text)
        if kind == "concurrency":
            out.append(LoadPattern(concurrency=None if math.isinf(v) else int(v), burstiness=burstiness, seed=seed))
        else:
            out.append(LoadPattern(request_rate=v, concurrency=max_concurrency, burstiness=burstiness, seed=seed))
    return out


def arrival_schedule(
    n: int, rate: float, burstiness: float = 1.0, seed: int = 0, *, normalize: bool = True
) -> list[float]:
    """Send offsets (seconds from the start) of `n` requests: cumulative gamma(shape=b, scale=1/(rate*b)) gaps.

    The first request also waits one gap, as in vLLM. With `normalize`, offsets are rescaled so the last
    one is exactly n/rate (vLLM's default); without it they are the raw gamma process.
    """
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise LlmoptError(f"request rate and burstiness must be positive, got {rate} and {burstiness}")
    rng = np.random.default_rng(seed)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    offsets = np.cumsum(gaps)
    if normalize and offsets[-1] > 0:
        offsets *= (n / rate) / offsets[-1]
    return [float(t) for t in offsets]


def request_offsets(requests: Sequence[BenchRequest], pattern: LoadPattern) -> list[float] | None:
    """Send offsets (s) of a run: a trace's own arrivals when the requests carry them, else the pattern's
    schedule; None when everything goes at once."""
    if any(r.arrival_s is not None for r in requests):
        return [r.arrival_s or 0.0 for r in requests]
    if math.isinf(pattern.request_rate):
        return None
    return arrival_schedule(len(requests), pattern.request_rate, pattern.burstiness, pattern.seed)


def warmup_requests(requests: Sequence[BenchRequest], n: int) -> list[BenchRequest]:
    """The first `n` requests (reused cyclically), all sent at once: a trace's arrival times do not apply."""
    return [requests[i % len(requests)].model_copy(update={"arrival_s": None}) for i in range(n)]


class LoadResult(BaseModel):
    """The records of one run (warm-up excluded, workload order) and its wall duration."""

    pattern: LoadPattern
    records: list[RequestRecord]
    duration_s: float
    interrupted: bool = False


def make_progress(console: Console | None, enabled: bool) -> Progress:
    """The live bar every phase of a benchmark shares: done/total, failures so far, elapsed and remaining."""
    return Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("[red]{task.fields[failed]} failed"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )


async def _run_phase(
    send: SendFn,
    requests: Sequence[BenchRequest],
    pattern: LoadPattern,
    on_done: Callable[[RequestRecord], None],
) -> tuple[list[RequestRecord], float, bool]:
    """Release `requests` per `pattern`; returns (records in order, duration, interrupted)."""
    sem = asyncio.Semaphore(pattern.concurrency) if pattern.concurrency is not None else None
    records: dict[int, RequestRecord] = {}

    async def one(i: int, req: BenchRequest) -> None:
        if sem is not None:
            await sem.acquire()  # cancelled while queued: never sent, so no record
        try:
            t0 = time.perf_counter()
            try:
                rec = await send(req)
            except asyncio.CancelledError:
                records[i] = RequestRecord.failure(
                    start=t0, end=time.perf_counter(), error_code=ERROR_INTERRUPTED, error="run interrupted",
                    prompt_tokens=req.expected_prompt_tokens or 0, index=i, interrupted=True)
                raise
            except Exception as e:  # the target's bug or a network failure: one failed request, not a crash
                rec = RequestRecord.failure(
                    start=t0, end=time.perf_counter(), error_code=f"exception:{type(e).__name__}",
                    error=f"{type(e).__name__}: {e}", prompt_tokens=req.expected_prompt_tokens or 0)
            if not isinstance(rec, RequestRecord):
                rec = RequestRecord.failure(start=t0, end=time.perf_counter(), error_code="bad_record",
                                            error=f"send returned {type(rec).__name__}, not a RequestRecord")
            rec.index = i
            records[i] = rec
            on_done(rec)
        finally:
            if sem is not None:
                sem.release()

    offsets = request_offsets(requests, pattern)
    tasks: list[asyncio.Task[None]] = []
    interrupted = False
    t_start = time.perf_counter()
    try:
        for i, req in enumerate(requests):
            if offsets is not None:
                delay = t_start + offsets[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, req)))
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        interrupted = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        uncancel = getattr(asyncio.current_task(), "uncancel", None)  # Python 3.11+
        if uncancel is not None:
            uncancel()  # we handled it: return partial results instead of propagating
    duration = time.perf_counter() - t_start
    return [records[i] for i in sorted(records)], duration, interrupted


async def run_load(
    send: SendFn,
    requests: Sequence[BenchRequest],
    pattern: LoadPattern,
    *,
    warmup: int = 0,
    progress: bool | Progress = True,
    console: Console | None = None,
    description: str | None = None,
) -> LoadResult:
    """Send `requests` through `send` under `pattern` and collect one record per request sent.

    Cancellation returns partial results (see the module docstring). Under `asyncio.run` on Python
    3.11+, Ctrl-C cancels the main task and so reaches us; on 3.10 the caller should route SIGINT to
    the task itself: `loop.add_signal_handler(signal.SIGINT, task.cancel)`.

    `warmup` extra requests (the first ones of the workload, reused cyclically) go first under the same
    concurrency, all at once, and are discarded: they absorb connection setup, CUDA graph capture and
    cold caches. `progress` is a bool (own live bar) or an existing rich `Progress` to add a task to.
    """
    if not requests:
        raise LlmoptError("no requests to send")
    if warmup < 0:
        raise LlmoptError(f"warm-up count must be non-negative, got {warmup}")
    desc = description or pattern.label()
    own = not isinstance(progress, Progress)
    bar = make_progress(console, bool(progress)) if own else progress
    assert isinstance(bar, Progress)

    def advance(task_id: TaskID) -> Callable[[RequestRecord], None]:
        failed = 0

        def on_done(rec: RequestRecord) -> None:
            nonlocal failed
            failed += not rec.success
            bar.update(task_id, advance=1, failed=failed)

        return on_done

    if own:
        bar.start()
    try:
        if warmup:
            warm = warmup_requests(requests, warmup)
            wid = bar.add_task(f"warm-up ({desc})", total=len(warm), failed=0)
            _, _, stopped = await _run_phase(send, warm, LoadPattern(concurrency=pattern.concurrency),
                                             advance(wid))
            bar.remove_task(wid)
            if stopped:
                return LoadResult(pattern=pattern, records=[], duration_s=0.0, interrupted=True)
        tid = bar.add_task(desc, total=len(requests), failed=0)
        records, duration, stopped = await _run_phase(send, requests, pattern, advance(tid))
    finally:
        if own:
            bar.stop()
    return LoadResult(pattern=pattern, records=records, duration_s=duration, interrupted=stopped)
