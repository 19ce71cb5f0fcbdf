"""Fixtures of the HTML report tests: the bench tests' scripted server on loopback, one thread."""

from __future__ import annotations

from tests.shared_fixtures import _one_thread, closed_port, fake_server

__all__ = ["_one_thread", "closed_port", "fake_server"]
