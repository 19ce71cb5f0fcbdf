"""Fixtures more than one test folder uses. A folder's conftest imports the ones it wants by name (an
autouse one then applies to that folder only)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tests.bench.scripted_sse_server import ScriptedSSEServer


@pytest.fixture(scope="module")
def fake_server() -> Iterator[ScriptedSSEServer]:
    """A live fake OpenAI server on loopback that streams scripted tokens."""
    srv = ScriptedSSEServer()
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    """The machine is shared: one intra-op thread for every engine a test starts."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
