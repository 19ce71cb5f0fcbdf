"""Fixtures for the bench tests: a live fake OpenAI server, a closed port, the tiny tokenizer."""

from __future__ import annotations

import pytest

from tests.shared_fixtures import closed_port, fake_server

__all__ = ["closed_port", "fake_server"]


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from llmopt.testing.tiny_model import build_tokenizer

    return build_tokenizer()
