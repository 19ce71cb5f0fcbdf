"""Fixtures for the bench tests: a live fake OpenAI server, a closed port, the tiny tokenizer."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from scripted_sse_server import ScriptedSSEServer


@pytest.fixture(scope="module")
def fake_server() -> Iterator[ScriptedSSEServer]:
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


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from llmopt.testing.tiny_model import build_tokenizer

    return build_tokenizer()
