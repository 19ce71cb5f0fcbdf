"""Fixtures for the recipe tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    """The machine is shared: one intra-op thread for every engine a recipe test starts."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
