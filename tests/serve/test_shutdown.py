"""Warm-up gates /health; SIGTERM drains (503 for new work, in-flight finish or abort) and exits 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from llmopt.serve.engine_loop import EngineLoop
from tests.serve._server import MODEL_NAME, serve, wait_healthy
from tests.serve.test_errors import assert_openai_error


def test_health_is_503_until_warm_up_is_done(tiny_llama, monkeypatch):
    gate = threading.Event()
    original = EngineLoop._run

    def slow_start(self):  # hold the engine thread before it builds the engine
        gate.wait(30)
        original(self)

    monkeypatch.setattr(EngineLoop, "_run", slow_start)
    with serve(tiny_llama, wait_ready=False) as srv:
        deadline = time.monotonic() + 30
        while True:  # the server listens before the engine exists
            try:
                r = httpx.get(srv.base_url + "/health", timeout=2)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert r.status_code == 503 and r.json() == {"status": "starting"}
        early = httpx.post(srv.v1 + "/completions", json={"model": MODEL_NAME, "prompt": "hi"})
        assert_openai_error(early, 503, code="not_ready")
        assert early.headers["retry-after"]
        gate.set()
        wait_healthy(srv)
        assert httpx.post(srv.v1 + "/completions", json={"model": MODEL_NAME, "prompt": "hi"}).status_code == 200


def test_drain_lets_in_flight_requests_finish(tiny_llama):
    with serve(tiny_llama, drain_timeout_s=30) as srv:
        body = {"model": MODEL_NAME, "prompt": "Continuous batching", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.v1 + "/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            srv.server.request_drain()
            assert httpx.get(srv.base_url + "/health").status_code == 503
            refused = httpx.post(srv.v1 + "/completions", json={**body, "stream": False})
            assert_openai_error(refused, 503, code="shutting_down")
            raw = "\n".join(lines)
        assert '"finish_reason": "length"' in raw and raw.rstrip().endswith("data: [DONE]")
        srv.thread.join(15)
        assert not srv.thread.is_alive()  # the server stopped by itself once drained


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_sigterm_drains_aborts_late_requests_and_exits_0(tiny_llama):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "llmopt", "serve", str(tiny_llama), "--port", str(port),
                             "--served-model-name", MODEL_NAME, "--dtype", "float32", "--device", "cpu",
                             "--kv-cache-memory", "8MiB", "--drain-timeout", "0.2", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.1)
        body = {"model": MODEL_NAME, "prompt": [5] * 20, "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            raw = "\n".join(lines)  # longer than the drain allows: aborted, but the stream ends properly
        assert '"finish_reason": "abort"' in raw and raw.rstrip().endswith("data: [DONE]")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_engine_that_cannot_start_stops_the_server_with_exit_2(tiny_llama, monkeypatch, capsys):
    from llmopt.cli import main

    monkeypatch.setattr(sys, "argv", ["llmopt", "serve", str(tiny_llama), "--port", "0", "--device", "cpu",
                                      "--kv-cache-memory", "1", "--log-level", "critical"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the engine failed to start") and "too small" in err[-1]


@pytest.mark.parametrize("where", ["in use", "no such host"])
def test_an_address_it_cannot_listen_on_is_one_line_and_exit_2(where, tiny_llama, monkeypatch, capsys):
    """Bound before the engine is built: uvicorn's own bind failure exited while the engine's thread ran, and
    the process aborted (exit 134)."""
    import socket

    from llmopt.cli import main

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    host, port = ("127.0.0.1", taken.getsockname()[1]) if where == "in use" else ("999.1.1.1", 8000)
    built = []
    monkeypatch.setattr("llmopt.serve.server.make_server", lambda *a: built.append(a))
    monkeypatch.setattr(sys, "argv", ["llmopt", "serve", str(tiny_llama), "--host", host, "--port", str(port),
                                      "--device", "cpu", "--log-level", "critical"])
    try:
        with pytest.raises(SystemExit) as e:
            main()
    finally:
        taken.close()
    assert e.value.code == 2 and not built
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot listen on {host}:{port}"), err


def test_a_stopped_server_gives_its_engine_back(tiny_llama):
    """The recipe's serve smoke runs a server in-process and then the bench stage loads its own engine: once
    the server has stopped, nothing may keep the first engine (its weights and KV pool) alive."""
    import gc
    import weakref

    with serve(tiny_llama) as srv:
        r = httpx.post(srv.v1 + "/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200
        loop = srv.state.engine_loop
        engine = weakref.ref(loop.engine)
        assert engine() is not None
    assert loop.engine is None
    del srv, loop
    gc.collect()
    assert engine() is None, gc.get_referrers(engine())
