"""Bursts against admission: a request that can start at once is not waiting (issue #13).

A real server, the real openai client, the real engine and admission. Only the engine's pace is
controlled: `held` wraps the engine's step so that each step sleeps (a slow engine) and, until the test
lets go, at most a few steps run. Every request asks for more tokens than that, so none can finish
(and free its slot) before the whole burst has its answers, however loaded the machine is, and the
number of 429s is exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from llmopt.serve.admission import AdmissionController
from llmopt.serve.errors import ApiError
from llmopt.serve.metrics import ServerMetrics
from tests.serve._server import MODEL_NAME, RunningServer, serve


class Hold:
    """The engine's own step, slowed by `delay_s`; while closed, at most `budget` steps run, then the
    engine thread waits (before stepping, so the engine is consistent) until `release`."""

    def __init__(self, engine, budget: int, delay_s: float):
        self.engine, self.real, self.delay_s = engine, engine.step, delay_s
        self.gate = threading.Event()
        self.close(budget)
        engine.step = self.step

    def close(self, budget: int) -> None:
        self.budget, self.steps = budget, 0
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    def step(self):
        if not self.gate.is_set():
            if self.steps >= self.budget:
                assert self.gate.wait(120), "the test never released the engine"
            self.steps += 1
        time.sleep(self.delay_s)
        return self.real()


@contextlib.contextmanager
def held(srv: RunningServer, budget: int, delay_s: float = 0.01) -> Iterator[Hold]:
    engine = srv.state.engine_loop.engine
    hold = Hold(engine, budget, delay_s)
    try:
        yield hold
    finally:
        hold.release()
        del engine.step  # the class's step again


def wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.005)


async def burst(c: openai.AsyncOpenAI, count: int, max_tokens: int, prompt=None, priority: int = 0) -> list:
    """`count` concurrent streaming requests; each result is an open stream or the 429 it got."""
    async def one(i: int):
        extra = {"ignore_eos": True, "priority": priority}
        try:
            if prompt is None:
                return await c.chat.completions.create(
                    model=MODEL_NAME, messages=[{"role": "user", "content": f"burst {i}"}], max_tokens=max_tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True}, extra_body=extra)
            return await c.completions.create(model=MODEL_NAME, prompt=prompt(i), max_tokens=max_tokens,
                                              temperature=0, stream=True, stream_options={"include_usage": True},
                                              extra_body=extra)
        except openai.RateLimitError as e:
            return e

    return list(await asyncio.gather(*(one(i) for i in range(count))))


async def drain(stream) -> int:
    """Read a stream to its end; its completion tokens."""
    usage = None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return usage


def split(results: list) -> tuple[list, list[openai.RateLimitError]]:
    busy = [r for r in results if isinstance(r, openai.RateLimitError)]
    return [r for r in results if not isinstance(r, openai.RateLimitError)], busy


def codes(busy: list[openai.RateLimitError]) -> set[str]:
    assert all(e.response.headers["retry-after"] == "1" for e in busy)
    return {e.response.json()["error"]["code"] for e in busy}


def client(srv: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=120)


def assert_idle(srv: RunningServer) -> None:
    wait_until(lambda: not srv.state.engine_loop.active)
    adm = srv.state.admission
    assert (adm.waiting, adm.starting, adm.queued_tokens) == (0, 0, 0)


def test_a_burst_that_fits_the_engine_gets_no_429(tiny_llama):
    """The issue: 2 × max_waiting concurrent streams, 64 sequence slots, none of them waits. Degradation
    (at 2 waiting, priority 0 is shed) does not start either: nothing waits."""
    with serve(tiny_llama, max_waiting=8, degrade_waiting=2) as srv:
        before = srv.metrics()

        async def main():
            c = client(srv)
            try:
                with held(srv, budget=8) as hold:
                    results = await burst(c, 16, max_tokens=40)
                    seen = (srv.state.admission.waiting, srv.metrics()["llmopt:degraded"])
                    hold.release()
                    tokens = await asyncio.gather(*(drain(s) for s in split(results)[0]))
                return results, seen, tokens
            finally:
                await c.close()

        results, (waiting, degraded), tokens = asyncio.run(main())
        ok, busy = split(results)
        assert not busy and len(ok) == 16
        assert waiting == 0 and degraded == 0.0
        assert tokens == [40] * 16
        after = srv.metrics()
        for reason in ("queue_full", "degraded", "queued_tokens"):
            key = f"llmopt:request_rejected_total{{reason={reason}}}"
            assert after[key] == before[key]
        assert_idle(srv)


def test_a_burst_past_running_plus_waiting_gets_429_for_exactly_the_excess(tiny_llama):
    """4 slots + 4 waiting = 8 of 12 admitted. Everyone then disconnects; once the engine has dropped
    them, the same burst gets exactly the same answer: the accounting returned to zero."""
    with serve(tiny_llama, engine_kw={"max_num_seqs": 4}, max_waiting=4, degrade_waiting=4) as srv:
        adm = srv.state.admission

        async def main():
            c = client(srv)
            try:
                with held(srv, budget=8) as hold:
                    first = await burst(c, 12, max_tokens=40, priority=1)
                    seen = (adm.waiting, len(srv.state.engine_loop.active), srv.metrics()["llmopt:degraded"])
                    for s in split(first)[0]:
                        await s.close()  # client gone: its ticket is returned at once, the abort is queued
                    await asyncio.to_thread(wait_until, lambda: adm.waiting == 0 and adm.starting == 0)
                    hold.release()  # the engine applies the aborts and frees the slots
                    await asyncio.to_thread(assert_idle, srv)
                    hold.close(budget=8)
                    second = await burst(c, 12, max_tokens=40, priority=1)
                    seen2 = (adm.waiting, len(srv.state.engine_loop.active))
                    hold.release()
                    tokens = await asyncio.gather(*(drain(s) for s in split(second)[0]))
                return first, seen, second, seen2, tokens
            finally:
                await c.close()

        first, (waiting, active, degraded), second, seen2, tokens = asyncio.run(main())
        ok, busy = split(first)
        assert (len(ok), len(busy)) == (8, 4)
        assert codes(busy) == {"queue_full"}
        assert (waiting, active) == (4, 8)
        assert degraded == 1.0  # 4 waiting = degrade_waiting
        ok2, busy2 = split(second)
        assert (len(ok2), len(busy2)) == (8, 4) and seen2 == (4, 8)
        assert tokens == [40] * 8
        assert srv.metrics()["llmopt:degraded"] == 0.0
        assert_idle(srv)


def test_free_kv_blocks_bound_what_starts_at_once(tiny_llama):
    """Slots for everyone but 24 KV blocks: four 65-token prompts (5 blocks each) start, two wait, two get
    429. Ten tokens keep each sequence inside its fifth block, so nothing is preempted."""
    with serve(tiny_llama, engine_kw={"num_kv_blocks": 24}, max_waiting=2) as srv:
        adm = srv.state.admission

        async def main():
            c = client(srv)
            try:
                with held(srv, budget=4) as hold:
                    results = await burst(c, 8, max_tokens=10, prompt=lambda i: [20 + i] * 65)
                    seen = (adm.waiting, adm.queued_tokens, len(srv.state.engine_loop.active))
                    hold.release()
                    tokens = await asyncio.gather(*(drain(s) for s in split(results)[0]))
                return results, seen, tokens
            finally:
                await c.close()

        results, seen, tokens = asyncio.run(main())
        ok, busy = split(results)
        assert (len(ok), len(busy)) == (6, 2)
        assert codes(busy) == {"queue_full"}
        assert seen == (2, 2 * 65, 6)
        assert tokens == [10] * 6
        assert_idle(srv)


def test_queued_tokens_count_only_waiting_requests(tiny_llama):
    """--max-queued-tokens 100 with 60-token prompts: the two that start at once do not count, the third
    waits with its 60 tokens, and each further one would pass 100: 429 queued_tokens."""
    with serve(tiny_llama, engine_kw={"max_num_seqs": 2}, max_queued_tokens=100, max_waiting=8) as srv:
        adm = srv.state.admission

        async def main():
            c = client(srv)
            try:
                with held(srv, budget=4) as hold:
                    results = await burst(c, 6, max_tokens=20, prompt=lambda i: [30 + i] * 60)
                    seen = (adm.waiting, adm.queued_tokens)
                    hold.release()
                    tokens = await asyncio.gather(*(drain(s) for s in split(results)[0]))
                return results, seen, tokens
            finally:
                await c.close()

        results, seen, tokens = asyncio.run(main())
        ok, busy = split(results)
        assert (len(ok), len(busy)) == (3, 3)
        assert codes(busy) == {"queued_tokens"}
        assert seen == (1, 60)
        assert tokens == [20] * 3
        assert_idle(srv)


# ---- the controller's bookkeeping, step by step (no server) --------------------------------------

@pytest.fixture
def adm() -> AdmissionController:
    return AdmissionController(ServerMetrics("tiny"), max_waiting=2, max_queued_tokens=1000, block_size=16,
                               degrade_waiting=1)


def counts(a: AdmissionController) -> tuple[int, int, int]:
    return a.starting, a.waiting, a.queued_tokens


def test_nothing_starts_at_once_before_the_engine_reports(adm):
    adm.admit({"a": 10}, 1, 1)
    assert counts(adm) == (0, 1, 10) and adm.degraded
    adm.set_capacity(4, 100)
    assert counts(adm) == (1, 0, 0) and not adm.degraded


def test_shrinking_capacity_turns_starting_requests_back_into_waiting_ones(adm):
    adm.set_capacity(2, 10)
    a = adm.admit({"a": 32}, 1, 1)  # 2 blocks
    b = adm.admit({"b": 64}, 1, 1)  # 4 blocks
    assert counts(adm) == (2, 0, 0)
    adm.set_capacity(2, 3)  # running sequences took blocks: b, the later one, no longer fits and waits
    assert counts(adm) == (1, 1, 64)
    adm.set_capacity(1, 10)  # and a slot
    assert counts(adm) == (1, 1, 64)
    adm.started(a, "a")
    adm.set_capacity(0, 8)  # the step that scheduled a
    assert counts(adm) == (0, 1, 64)
    adm.set_capacity(1, 8)  # a finished
    assert counts(adm) == (1, 0, 0)
    adm.started(b, "b")
    assert counts(adm) == (0, 0, 0)


def test_head_of_line_a_big_waiting_request_keeps_later_small_ones_waiting(adm):
    adm.set_capacity(8, 4)
    adm.admit({"big": 100}, 1, 1)  # 7 blocks: waits
    adm.admit({"small": 1}, 1, 1)  # would fit, but someone waits ahead of it
    assert counts(adm) == (0, 2, 101)
    with pytest.raises(ApiError) as e:
        adm.check_capacity(5)
    assert e.value.status == 429 and e.value.code == "queue_full"


def test_a_request_with_several_prompts_frees_its_share_as_each_starts(adm):
    adm.set_capacity(3, 100)
    t = adm.admit({"r0": 16, "r1": 16}, 2, 1)  # 2 prompts × n=2: 4 sequences, 3 slots
    assert counts(adm) == (0, 1, 64)
    adm.started(t, "r0")  # its first prompt's two sequences were scheduled
    adm.set_capacity(1, 98)
    assert counts(adm) == (0, 1, 32)
    adm.set_capacity(2, 98)
    assert counts(adm) == (1, 0, 0)
    adm.started(t, "r1")
    adm.started(t, "r1")  # a repeated or late event changes nothing
    assert counts(adm) == (0, 0, 0)
    adm.release(t)
    assert counts(adm) == (0, 0, 0)


def test_release_returns_starting_and_waiting_tickets_and_promotes_the_next(adm):
    adm.set_capacity(1, 100)
    a = adm.admit({"a": 5}, 1, 1)
    b = adm.admit({"b": 6}, 1, 1)
    c = adm.admit({"c": 7}, 1, 1)
    assert counts(adm) == (1, 2, 13)
    adm.release(a)  # a starting request disconnects: b takes its place
    assert counts(adm) == (1, 1, 7)
    adm.release(c)  # a waiting one disconnects
    assert counts(adm) == (1, 0, 0)
    adm.release(b)
    adm.release(b)  # idempotent
    assert counts(adm) == (0, 0, 0)
    assert adm.metrics.registry.get_sample_value("llmopt:degraded", {"model_name": "tiny"}) == 0
