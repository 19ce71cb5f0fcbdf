"""Quantization tests: deterministic, and on one intra-op thread (tiny tensors gain nothing from
more, and on a shared CPU extra OpenMP threads make small ops stall)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_one_thread() -> Iterator[None]:
    torch.manual_seed(0)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
