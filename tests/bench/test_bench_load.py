"""Load patterns and the async runner, with real async `send` functions (no wall-clock rate checks)."""

from __future__ import annotations

import asyncio
import io
import math
import time

import numpy as np
import pytest
from rich.console import Console

from llmopt.bench.load import LoadPattern, arrival_schedule, parse_sweep, run_load
from llmopt.bench.records import RequestRecord
from llmopt.bench.workloads import BenchRequest
from llmopt.errors import LlmoptError


def _reqs(n: int) -> list[BenchRequest]:
    return [BenchRequest(prompt=f"p{i}", max_tokens=2, expected_prompt_tokens=3) for i in range(n)]


class InFlight:
    """A real async target that sleeps like a server and records how many requests overlap."""

    def __init__(self, delay: float = 0.01, fail_every: int = 0):
        self.now = 0
        self.max = 0
        self.calls = 0
        self.delay = delay
        self.fail_every = fail_every

    async def send(self, req: BenchRequest) -> RequestRecord:
        self.calls += 1
        call = self.calls
        self.now += 1
        self.max = max(self.max, self.now)
        start = time.perf_counter()
        try:
            await asyncio.sleep(self.delay)
            if self.fail_every and call % self.fail_every == 0:
                raise ValueError(f"boom {req.prompt}")
            t = time.perf_counter()
            return RequestRecord.from_chunks(start=start, token_times=[t, t], prompt_tokens=3)
        finally:
            self.now -= 1


def test_parse_sweep():
    c = parse_sweep("1,2,4,inf", "concurrency")
    assert [p.concurrency for p in c] == [1, 2, 4, None]
    assert all(math.isinf(p.request_rate) for p in c)
    r = parse_sweep("0.5, 2,inf", "request_rate", burstiness=0.5, max_concurrency=8)
    assert [p.request_rate for p in r] == [0.5, 2, math.inf]
    assert all(p.concurrency == 8 and p.burstiness == 0.5 for p in r)
    assert [p.label() for p in c[2:]] == ["concurrency 4", "all at once"]
    assert r[0].label() == "rate 0.5 req/s, concurrency 8"
    for text, kind, needle in [("1,x", "concurrency", "not a number"), ("0", "concurrency", "positive"),
                               ("1.5", "concurrency", "whole number"), ("", "request_rate", "empty"),
                               ("-2", "request_rate", "positive")]:
        with pytest.raises(LlmoptError, match=needle):
            parse_sweep(text, kind)


def test_poisson_schedule_rate_and_shape():
    n, rate = 20000, 5.0
    raw = np.diff(arrival_schedule(n, rate, 1.0, seed=1, normalize=False), prepend=0.0)
    assert raw.mean() == pytest.approx(1 / rate, rel=0.03)
    assert raw.std() / raw.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.diff(arrival_schedule(n, rate, 4.0, seed=1, normalize=False), prepend=0.0)
    assert bursty.mean() == pytest.approx(1 / rate, rel=0.03)
    assert bursty.std() / bursty.mean() == pytest.approx(0.5, rel=0.05)  # gamma shape k: CV 1/sqrt(k)
    norm = arrival_schedule(100, rate, 1.0, seed=2)
    assert norm[-1] == pytest.approx(100 / rate)  # vLLM's rescaling: exactly n/rate overall
    assert all(b >= a for a, b in zip(norm, norm[1:], strict=False))
    assert arrival_schedule(100, rate, 1.0, seed=2) == norm  # seeded
    assert arrival_schedule(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_schedule(4, 2.0, math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_concurrency_is_never_exceeded():
    target = InFlight(delay=0.01)
    res = asyncio.run(run_load(target.send, _reqs(24), LoadPattern(concurrency=3), progress=False))
    assert target.max == 3
    assert len(res.records) == 24 and all(r.success for r in res.records)
    assert [r.index for r in res.records] == list(range(24))
    assert not res.interrupted and res.duration_s > 0


def test_unbounded_sends_everything_at_once():
    target = InFlight(delay=0.05)
    asyncio.run(run_load(target.send, _reqs(15), LoadPattern(), progress=False))
    assert target.max == 15


def test_rate_limited_run_takes_the_scheduled_time():
    target = InFlight(delay=0.0)
    res = asyncio.run(run_load(target.send, _reqs(10), LoadPattern(request_rate=100.0), progress=False))
    assert res.duration_s >= 10 / 100.0 * 0.95  # the last arrival is scheduled at n/rate


def test_send_errors_become_failed_records():
    target = InFlight(delay=0.001, fail_every=3)
    res = asyncio.run(run_load(target.send, _reqs(9), LoadPattern(concurrency=1), progress=False))
    failed = [r for r in res.records if not r.success]
    assert len(failed) == 3
    assert all(r.error_code == "exception:ValueError" and "boom" in r.error for r in failed)
    assert all(r.prompt_tokens == 3 for r in failed)


def test_warmup_is_sent_but_not_recorded():
    target = InFlight(delay=0.001)
    out = io.StringIO()
    res = asyncio.run(run_load(target.send, _reqs(5), LoadPattern(concurrency=2), warmup=3,
                               console=Console(file=out, width=100)))
    assert target.calls == 8 and len(res.records) == 5
    assert "5/5" in out.getvalue()  # the rich progress bar rendered


async def _until_in_flight(target: InFlight, n: int) -> None:
    """Wait (up to 10 s) until `n` requests are in flight: a fixed sleep raced the sends on a loaded machine."""
    for _ in range(1000):
        if target.now >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"only {target.now} of {n} requests were ever in flight")


def test_cancel_returns_partial_records():
    target = InFlight(delay=10.0)

    async def main():
        task = asyncio.create_task(run_load(target.send, _reqs(5), LoadPattern(concurrency=2), progress=False))
        await _until_in_flight(target, 2)
        t0 = time.perf_counter()
        task.cancel()
        return await task, time.perf_counter() - t0

    res, took = asyncio.run(main())
    assert took < 2  # the in-flight requests (10 s each) were cancelled, not awaited
    assert res.interrupted
    assert len(res.records) == 2  # the two in flight; the three queued were never sent
    assert all(r.interrupted and r.error_code == "interrupted" for r in res.records)


def test_no_requests_is_an_error():
    with pytest.raises(LlmoptError, match="no requests"):
        asyncio.run(run_load(InFlight().send, [], LoadPattern(), progress=False))


def test_ctrl_c_under_asyncio_run_returns_partial_records():
    import signal

    target = InFlight(delay=10.0)

    async def interrupt():
        await _until_in_flight(target, 3)
        signal.raise_signal(signal.SIGINT)

    async def main():
        ctrl_c = asyncio.create_task(interrupt())
        res = await run_load(target.send, _reqs(4), LoadPattern(concurrency=3), progress=False)
        await ctrl_c
        return res

    # Ctrl-C as in a terminal: a process started in the background by a non-interactive shell inherits
    # SIGINT ignored, and asyncio.run then installs no handler
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        res = asyncio.run(main())  # no KeyboardInterrupt escapes: the runner handled the cancellation
    finally:
        signal.signal(signal.SIGINT, previous)
    assert res.interrupted and len(res.records) == 3
