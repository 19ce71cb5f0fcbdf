"""Priorities: higher classes are scheduled first, key classes cap requests, and aging bounds starvation.

One sequence runs at a time (max_num_seqs=1). A blocker stream holds the slot while two requests queue;
closing the blocker frees the slot, and the completion order shows whom the scheduler picked.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.serve._server import MODEL_NAME, serve
from tests.serve.test_errors import assert_openai_error

KEYS = {"gold": 5, "bronze": -5}
SHORT = {"model": MODEL_NAME, "max_tokens": 20, "temperature": 0, "ignore_eos": True}


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.005)


async def race(srv, first: tuple[dict, str], second: tuple[dict, str], gap_s: float = 0.0) -> list[str]:
    """Queue `first`, then (after `gap_s`) `second`, behind a blocker; return the names in completion order."""
    order: list[str] = []

    async def send(c: httpx.AsyncClient, body: dict, key: str, name: str) -> None:
        r = await c.post("/v1/completions", json={**SHORT, **body}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        order.append(name)

    async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as c:
        blocker = c.stream("POST", "/v1/completions", json={**SHORT, "prompt": "blocker", "max_tokens": 1000,
                                                              "stream": True},
                           headers={"Authorization": "Bearer gold"})
        resp = await blocker.__aenter__()
        lines = resp.aiter_lines()
        await lines.__anext__()  # the blocker is running
        eng = srv.state.engine_loop
        a = asyncio.ensure_future(send(c, first[0], first[1], "first"))
        await asyncio.to_thread(wait_until, lambda: len(eng.active) == 2 and srv.state.admission.waiting == 1)
        await asyncio.sleep(gap_s)
        b = asyncio.ensure_future(send(c, second[0], second[1], "second"))
        await asyncio.to_thread(wait_until, lambda: len(eng.active) == 3 and srv.state.admission.waiting == 2)
        await blocker.__aexit__(None, None, None)  # client gone: the blocker is aborted, the slot frees
        await asyncio.gather(a, b)
    return order


@pytest.fixture(scope="module")
def prio(tiny_llama):
    with serve(tiny_llama, engine_kw={"max_num_seqs": 1}, api_keys=["gold", "bronze", "plain"],
               api_key_priorities=KEYS) as srv:
        yield srv


def test_higher_priority_is_scheduled_first(prio):
    order = asyncio.run(race(prio, ({"prompt": "low", "priority": -3}, "gold"),
                             ({"prompt": "high", "priority": 4}, "gold")))
    assert order == ["second", "first"]


def test_key_class_caps_the_requested_priority(prio):
    # bronze asks for 100 but its class is -5; the plain key (class 0) arrives later and still goes first
    order = asyncio.run(race(prio, ({"prompt": "bronze", "priority": 100}, "bronze"),
                             ({"prompt": "plain"}, "plain")))
    assert order == ["second", "first"]


def test_equal_priority_is_first_come_first_served(prio):
    order = asyncio.run(race(prio, ({"prompt": "one", "priority": 1}, "gold"),
                             ({"prompt": "two", "priority": 1}, "gold")))
    assert order == ["first", "second"]


def test_aging_lets_a_long_waiting_low_priority_request_through(tiny_llama):
    # 0.02 s per class: after waiting 0.25 s the class -3 request outranks a fresh class 4 one. The gap is
    # kept short because the 1000-token blocker must still be running when the second request queues.
    with serve(tiny_llama, engine_kw={"max_num_seqs": 1}, api_keys=["gold"], priority_aging_s=0.02) as srv:
        order = asyncio.run(race(srv, ({"prompt": "old", "priority": -3}, "gold"),
                                 ({"prompt": "new", "priority": 4}, "gold"), gap_s=0.25))
    assert order == ["first", "second"]


def test_fcfs_server_refuses_the_priority_field(tiny_llama):
    with serve(tiny_llama, engine_kw={"scheduling_policy": "fcfs"}, enable_priorities=False) as srv:
        body = {**SHORT, "prompt": "x"}
        assert httpx.post(srv.v1 + "/completions", json=body).status_code == 200
        assert_openai_error(httpx.post(srv.v1 + "/completions", json={**body, "priority": 2}), 400, param="priority")
