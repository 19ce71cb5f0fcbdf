"""Helpers: a real uvicorn server on 127.0.0.1 (a free port) in a background thread, over a tiny model."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from llmopt.engine.config import EngineConfig
from llmopt.serve.config import ServerConfig
from llmopt.serve.server import DrainingServer, listen_socket, make_server

MODEL_NAME = "tiny"


@dataclass
class RunningServer:
    server: DrainingServer
    base_url: str
    thread: threading.Thread

    @property
    def state(self):
        return self.server.state

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def metrics(self) -> dict[str, float]:
        """Sample name (with labels, sorted) -> value, from a real scrape of /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


def engine_config(model_dir: Path | None, **kw) -> EngineConfig:
    base = dict(model=None if model_dir is None else str(model_dir), dtype="float32", device="cpu", kv_cache_memory="8MiB", num_threads=1,
                max_num_seqs=64, scheduling_policy="priority")
    base.update(kw)
    return EngineConfig(**base)


@contextlib.contextmanager
def serve(model_dir: Path | None, engine_kw: dict | None = None, wait_ready: bool = True, **server_kw) -> Iterator[RunningServer]:
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    cfg = ServerConfig(host="127.0.0.1", port=port, log_level="warning",
                       **{"served_model_name": MODEL_NAME, **server_kw})
    server = make_server(engine_config(model_dir, **(engine_kw or {})), cfg, MODEL_NAME)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    running = RunningServer(server, f"http://127.0.0.1:{port}", thread)
    try:
        if wait_ready:
            wait_healthy(running)
        yield running
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def wait_healthy(srv: RunningServer, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(srv.base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if srv.state.fatal is not None:
            raise RuntimeError(f"server failed: {srv.state.fatal}")
        time.sleep(0.05)
    raise TimeoutError("server did not become healthy")
